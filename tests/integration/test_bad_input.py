"""Bad input the database must judge: a clear error, and every table and id sequence as before.

Overflowing backoff, non-object metadata, a bad routing schema name: each is refused with
nothing written, on a real ``awa migrate`` cluster. Input judged without the database is
refused before a connection is checked out (tests/unit/test_validation.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import KINDS, advance_all, insert_job, snapshot_of

from awa_sa import (
    Attempt,
    AwaSAError,
    DatabaseError,
    InvalidSchemaName,
    Migrated,
    Rescheduled,
    RetryBackoff,
    Snooze,
    Stale,
    ValidationError,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
)
from awa_sa.settle.binds import in_transaction
from awa_sa.settle.inputs import prepare


def test_bigint_edges_are_accepted(engine: sa.Engine) -> None:
    """The largest id and lease a bigint holds are bound and matched exactly, and the attempt
    is written; the smallest finds no job (ids are positive) and changes nothing."""
    top = 2**63 - 1
    with engine.begin() as conn:
        job = insert_job(conn)
        conn.execute(
            sa.text("UPDATE awa.jobs_hot SET id = :top, run_lease = :top WHERE id = :job"),
            {"top": top, "job": job},
        )
    outcome = reschedule_canonical_attempt(engine, top, top, RetryBackoff())
    assert isinstance(outcome, Rescheduled)
    assert outcome.job_id == top
    with engine.connect() as conn:
        moved = conn.execute(
            sa.text("SELECT id, run_lease, state::text FROM awa.scheduled_jobs WHERE id = :top"),
            {"top": top},
        ).one()
    assert tuple(moved) == (top, top, "retryable")
    before = snapshot_of(engine)
    bottom = -(2**63)
    assert reschedule_canonical_attempt(engine, bottom, bottom, RetryBackoff()) == Stale()
    assert snapshot_of(engine) == before


def test_autocommit_bind_is_refused(engine: sa.Engine) -> None:
    """Without a transaction the routing lock would not outlive its own statement."""
    with engine.begin() as conn:
        job = insert_job(conn)
    before = snapshot_of(engine)
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with pytest.raises(ValidationError, match="AUTOCOMMIT"):
        reschedule_canonical_attempt(autocommit, job, 1, Snooze(1))
    with autocommit.connect() as conn, pytest.raises(ValidationError, match="AUTOCOMMIT"):
        reschedule_canonical_attempt(conn, job, 1, Snooze(1))
    assert snapshot_of(engine) == before


# -- judged by the database ----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_backoff_overflow_changes_nothing(cluster: Any, phase: str) -> None:
    """Attempts whose backoff always overflows: 22003 from 1024 (2^1024 is not a double).

    From 43 to about 1023 v040's result depends on the jitter (an error, or an arbitrary run_at);
    tests/integration/test_hostile_input.py accepts exactly those outcomes.
    """
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        jobs = {a: insert_job(conn, attempt=a, max_attempts=1000) for a in (1024, 2000)}
    before = snapshot_of(cluster.engine)
    for attempt, job in jobs.items():
        with pytest.raises(DatabaseError) as info:
            reschedule_canonical_attempt(cluster.engine, job, 1, RetryBackoff(), error={"e": 1})
        assert info.value.sqlstate in ("22008", "22003"), attempt
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError)
    assert snapshot_of(cluster.engine) == before  # not even an id from awa_qs.job_id_seq


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_snooze_at_the_smallint_floor_keeps_it(cluster: Any, phase: str) -> None:
    """A Snooze takes one off the attempt, saturating at -32768 as Awa's subtraction does."""
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        alone = insert_job(conn, attempt=-32768)
        batch = [insert_job(conn, attempt=a) for a in (-32768, -32767, -32766)]
    outcomes = [reschedule_canonical_attempt(cluster.engine, alone, 1, Snooze(1))]
    outcomes += reschedule_canonical_attempts(
        cluster.engine, [Attempt(job, 1, Snooze(1)) for job in batch]
    )
    moved = [o for o in outcomes if isinstance(o, Rescheduled | Migrated)]
    assert [o.attempt for o in moved] == [-32768, -32768, -32768, -32767]
    with cluster.engine.connect() as conn:
        if phase == "canonical":
            table, ids = "awa.scheduled_jobs WHERE id", [alone, *batch]
        else:
            table, ids = "awa_qs.deferred_jobs WHERE job_id", [o.job_id for o in moved]
        stored = [
            conn.execute(sa.text(f"SELECT attempt FROM {table} = :id"), {"id": i}).scalar_one()
            for i in ids
        ]
    assert stored == [-32768, -32768, -32768, -32767]


def test_non_object_metadata_is_refused_in_queue_storage(cluster: Any) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        jobs = [
            insert_job(conn, metadata=m, unique_key=m.encode(), unique_states="11111000")
            for m in ("[1, 2]", '"text"', "null", "3")
        ]
    before = snapshot_of(cluster.engine)
    for job in jobs:
        for kind in KINDS.values():
            with pytest.raises(ValidationError, match="metadata must be a JSON object"):
                reschedule_canonical_attempt(cluster.engine, job, 1, kind)
    assert snapshot_of(cluster.engine) == before  # the take was undone; no id was consumed


def test_non_object_metadata_is_carried_canonically(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        job = insert_job(conn, metadata="[1, 2]")
    assert isinstance(reschedule_canonical_attempt(engine, job, 1, Snooze(1)), Rescheduled)


def test_routing_schema_must_be_a_plain_identifier(cluster: Any) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        job = insert_job(conn)
    for schema in ("Bad-Name", "awa_qs; drop table x", "1awa", "a" * 64):
        with cluster.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE awa.storage_transition_state"
                    " SET details = jsonb_build_object('schema', CAST(:s AS text))"
                ),
                {"s": schema},
            )
        before = snapshot_of(cluster.engine)
        with pytest.raises(InvalidSchemaName) as info:
            reschedule_canonical_attempt(cluster.engine, job, 1, Snooze(1))
        assert info.value.schema == schema
        assert isinstance(info.value, ValidationError)
        assert isinstance(info.value, AwaSAError)
        assert snapshot_of(cluster.engine) == before


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_run_at_outside_python_range_fails_inside_the_statement(cluster: Any, phase: str) -> None:
    """The SQL backstop behind the delay check (and the only guard for a wild backoff).

    A run_at PostgreSQL can store but Python cannot read (BC, or past 9999) must fail the
    statement with 22008 rather than be written and then fail to load.
    """
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        job = insert_job(conn)
    before = snapshot_of(cluster.engine)
    for delay in (-1e11, 3e11):  # about 1200 BC, and about year 11500
        call = prepare(job, 1, Snooze(1), None, None)
        call = dataclasses.replace(call, item=call.item._replace(delay=delay))
        with cluster.engine.begin() as conn, pytest.raises(DatabaseError) as info:
            in_transaction(conn, [call])
        assert info.value.sqlstate == "22008"
    assert snapshot_of(cluster.engine) == before
