"""The helpers of ``awa_sa.testing``, on the databases of its own plugin (``awa_engine``).

``running_attempt`` is compared with a real claim in ``test_testing_real_claim.py``; here are its
defaults, its transaction and its unique claims, ``locate`` in every place a job can end up, and
``set_phase`` against the published ``awa storage`` commands.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from conftest import run_awa

import awa_sa
from awa_sa import (
    CancelledDuplicate,
    Migrated,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    UniqueConflict,
    ValidationError,
    reschedule_canonical_attempt,
)
from awa_sa.testing import (
    Location,
    Phase,
    contested_attempt,
    locate,
    running_attempt,
    set_phase,
)
from awa_sa.testing.server import EmbeddedPostgres


def job_row(conn: sa.Connection, job_id: int) -> dict[str, Any]:
    row = conn.execute(sa.text("SELECT * FROM awa.jobs_hot WHERE id = :id"), {"id": job_id})
    return dict(row.mappings().one())


def claims(conn: sa.Connection) -> list[tuple[bytes, int]]:
    rows = conn.execute(sa.text("SELECT unique_key, job_id FROM awa.job_unique_claims ORDER BY 2"))
    return [(bytes(key), int(job_id)) for key, job_id in rows]


def test_running_attempt_defaults_are_awas_insert_defaults_claimed_once(
    awa_engine: sa.Engine,
) -> None:
    with awa_engine.begin() as conn:
        job_id, lease = running_attempt(conn)
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
        row = job_row(conn, job_id)
    assert lease == 1
    assert row == {
        "id": job_id,
        "kind": "example_job",
        "queue": "default",
        "args": {},
        "state": "running",
        "priority": 2,
        "attempt": 1,
        "max_attempts": 25,
        "run_at": now,
        "heartbeat_at": now,
        "deadline_at": now + dt.timedelta(minutes=5),
        "attempted_at": now,
        "finalized_at": None,
        "created_at": now,
        "errors": [],
        "metadata": {},
        "tags": [],
        "unique_key": None,
        "unique_states": None,
        "callback_id": None,
        "callback_timeout_at": None,
        "callback_filter": None,
        "callback_on_complete": None,
        "callback_on_fail": None,
        "callback_transform": None,
        "run_lease": 1,
        "progress": None,
    }


def test_running_attempt_writes_every_argument(awa_engine: sa.Engine) -> None:
    callback = uuid.uuid4()
    retried_at = dt.datetime(2026, 1, 5, 10, tzinfo=dt.UTC)
    with awa_engine.begin() as conn:
        job_id, lease = running_attempt(
            conn,
            kind="send_invoice",
            queue="billing",
            args={"invoice": 7, "amounts": [1.5, 2]},
            priority=4,
            attempt=3,
            max_attempts=5,
            metadata={"tenant": "eu-1"},
            tags=["eu", "invoices"],
            unique_key=b"\x01\x02",
            unique_states="01100000",
            callback_id=callback,
            callback_timeout_secs=90,
            callback_filter="status == 200",
            callback_on_complete="done",
            callback_on_fail="failed",
            callback_transform=".body",
            run_lease=5,
            errors=[{"error": "timeout", "attempt": 1}, "plain"],
            finalized_at=retried_at,
            progress={"page": 2},
            deadline_secs=30,
        )
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
        row = job_row(conn, job_id)
    assert lease == 5
    expected = {
        "kind": "send_invoice",
        "queue": "billing",
        "args": {"invoice": 7, "amounts": [1.5, 2]},
        "priority": 4,
        "attempt": 3,
        "max_attempts": 5,
        "metadata": {"tenant": "eu-1"},
        "tags": ["eu", "invoices"],
        "unique_key": b"\x01\x02",
        "unique_states": "01100000",
        "callback_id": callback,
        "callback_timeout_at": now + dt.timedelta(seconds=90),
        "callback_filter": "status == 200",
        "callback_on_complete": "done",
        "callback_on_fail": "failed",
        "callback_transform": ".body",
        "run_lease": 5,
        "errors": [{"error": "timeout", "attempt": 1}, "plain"],
        "finalized_at": retried_at,
        "progress": {"page": 2},
        "deadline_at": now + dt.timedelta(seconds=30),
    }
    assert {column: row[column] for column in expected} == expected


def test_running_attempt_joins_the_callers_transaction(awa_engine: sa.Engine) -> None:
    with awa_engine.connect() as conn, awa_engine.connect() as other:
        job_id, _ = running_attempt(conn)
        seen = "SELECT count(*) FROM awa.jobs_hot WHERE id = :id"
        assert conn.execute(sa.text(seen), {"id": job_id}).scalar_one() == 1
        assert other.execute(sa.text(seen), {"id": job_id}).scalar_one() == 0
        conn.rollback()
        assert conn.execute(sa.text(seen), {"id": job_id}).scalar_one() == 0


def test_a_key_is_claimed_while_the_mask_claims_running(awa_engine: sa.Engine) -> None:
    with awa_engine.begin() as conn:
        default_mask, _ = running_attempt(conn, unique_key=b"a")
        not_running, _ = running_attempt(conn, unique_key=b"b", unique_states="11001000")
        assert job_row(conn, default_mask)["unique_states"] == "11111000"
        assert claims(conn) == [(b"a", default_mask)]
    with awa_engine.begin() as conn, pytest.raises(sa.exc.IntegrityError) as refused:
        running_attempt(conn, unique_key=b"a")
    assert isinstance(refused.value.orig, psycopg.errors.UniqueViolation)
    assert refused.value.orig.diag.constraint_name == "idx_awa_jobs_unique"
    # The attempt that does not hold its key loses it to a newer job, as in Awa.
    with awa_engine.begin() as conn:
        newer, _ = running_attempt(conn, unique_key=b"b")
        assert claims(conn) == [(b"a", default_mask), (b"b", newer)]
        assert newer > not_running


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"attempt": 0}, "attempt >= 1"), ({"attempt": 3, "run_lease": 2}, "run_lease >= attempt")],
)
def test_running_attempt_refuses_what_no_claim_leaves(
    awa_engine: sa.Engine, arguments: dict[str, Any], message: str
) -> None:
    with awa_engine.begin() as conn:
        with pytest.raises(ValidationError, match=message):
            running_attempt(conn, **arguments)
        assert conn.execute(sa.text("SELECT count(*) FROM awa.jobs_hot")).scalar_one() == 0


def test_locate_follows_each_outcome(awa_engine: sa.Engine) -> None:
    """Each outcome leads to its own row, even where two rows share an id: the migrated job's
    fresh queue-storage id is the canonical job's id (both sequences start at 1), so only the
    outcome's type tells ``locate`` which table to read."""
    with awa_engine.begin() as conn:
        canonical, lease = running_attempt(conn, attempt=2)
        staying, _ = running_attempt(conn)
    rescheduled = reschedule_canonical_attempt(awa_engine, canonical, lease, RetryAfter(60))
    assert isinstance(rescheduled, Rescheduled)
    assert reschedule_canonical_attempt(awa_engine, staying, 99, Snooze(1)) == Stale()

    with awa_engine.begin() as conn:
        migrating, lease = running_attempt(conn, errors=["first"])
        set_phase(conn, "mixed_transition")
    migrated = reschedule_canonical_attempt(
        awa_engine, migrating, lease, RetryBackoff(), error="second"
    )
    assert isinstance(migrated, Migrated)
    assert migrated.job_id == rescheduled.job_id  # the shared id the docstring relies on

    with awa_engine.connect() as conn:
        location = Location(
            "awa", "scheduled_jobs", canonical, "retryable", 2, 2, rescheduled.run_at, ()
        )
        assert locate(conn, canonical) == locate(conn, rescheduled) == location
        assert locate(conn, staying) == Location(
            "awa", "jobs_hot", staying, "running", 1, 1, job_row(conn, staying)["run_at"], ()
        )
        assert locate(conn, migrated) == Location(
            "awa_qs", "deferred_jobs", migrated.job_id, "retryable", 1, 1, migrated.run_at,
            ("first", "second"),
        )  # fmt: skip
        assert locate(conn, migrated.job_id, schema="awa_qs") == locate(conn, migrated)
        assert locate(conn, migrating) is None  # the canonical id is gone
        assert locate(conn, 10_000) is None


def test_locate_finds_a_cancelled_duplicate(awa_engine: sa.Engine) -> None:
    with awa_engine.begin() as conn:
        # The attempt does not hold its key while running, so a newer job takes it.
        job_id, lease = running_attempt(conn, unique_key=b"k", unique_states="11001000")
        running_attempt(conn, kind="newer", unique_key=b"k")
        set_phase(conn, "mixed_transition")
    outcome = reschedule_canonical_attempt(awa_engine, job_id, lease, RetryAfter(5))
    assert isinstance(outcome, CancelledDuplicate)
    with awa_engine.connect() as conn:
        location = locate(conn, outcome)
    assert location is not None
    assert (location.relation, location.job_id, location.state) == (
        "awa_qs.done_entries",
        outcome.job_id,
        "cancelled",
    )
    assert location.errors[-1]["error"].startswith("rescheduled as duplicate")


def test_locate_needs_a_schema_once_routing_is_back_to_canonical(awa_engine: sa.Engine) -> None:
    with awa_engine.begin() as conn:
        job_id, lease = running_attempt(conn)
        set_phase(conn, "mixed_transition", "awa")  # v040's default substrate
    outcome = reschedule_canonical_attempt(awa_engine, job_id, lease, Snooze(5))
    assert isinstance(outcome, Migrated)
    with awa_engine.begin() as conn:
        routed = locate(conn, outcome)
        set_phase(conn, "aborted")
        with pytest.raises(ValidationError, match="pass schema="):
            locate(conn, outcome)
        assert locate(conn, outcome, schema="awa") == routed
    assert routed is not None
    assert (routed.relation, routed.state) == ("awa.deferred_jobs", "scheduled")


@pytest.mark.parametrize("job", [Stale(), True, "1"])
def test_locate_refuses_what_names_no_job(awa_engine: sa.Engine, job: Any) -> None:
    with awa_engine.connect() as conn, pytest.raises(ValidationError, match="an id or an outcome"):
        locate(conn, job)


def test_a_callback_wired_attempt_stays_canonical_after_the_flip(awa_engine: sa.Engine) -> None:
    with awa_engine.begin() as conn:
        job_id, lease = running_attempt(conn, callback_id=uuid.uuid4())
        set_phase(conn, "active")
    outcome = reschedule_canonical_attempt(awa_engine, job_id, lease, RetryAfter(5))
    assert isinstance(outcome, Rescheduled)
    with awa_engine.connect() as conn:
        location = locate(conn, outcome)
    assert location is not None
    assert location.relation == "awa.scheduled_jobs"


# What `awa storage` runs to reach each phase from the previous one (routing to awa_qs).
CLI_STEPS: dict[tuple[str, str], list[list[str]]] = {
    ("canonical", "prepared"): [
        ["storage", "prepare", "--engine", "queue_storage", "--details", '{"schema": "awa_qs"}']
    ],
    ("prepared", "mixed_transition"): [["storage", "enter-mixed-transition", "--quiesced"]],
    ("mixed_transition", "active"): [["storage", "finalize"]],
    ("prepared", "aborted"): [["storage", "abort"]],
    ("mixed_transition", "aborted"): [["storage", "abort"]],
}
SEQUENCES: list[list[Phase]] = [
    ["prepared"],
    ["prepared", "mixed_transition"],
    ["mixed_transition"],
    ["prepared", "mixed_transition", "active"],
    ["active"],
    ["prepared", "aborted"],
    ["mixed_transition", "aborted"],
]
PATH: list[str] = ["canonical", "prepared", "mixed_transition", "active"]


def cli_steps(phases: list[Phase]) -> list[list[str]]:
    """The CLI commands that walk a fresh cluster through *phases* (skipped phases included)."""
    steps, here = [], "canonical"
    for phase in phases:
        skipped = PATH[PATH.index(here) + 1 : PATH.index(phase) + 1] if phase in PATH else [phase]
        for stop in skipped:
            steps += CLI_STEPS[(here, stop)]
            here = stop
    return steps


def transition(conn: sa.Connection) -> dict[str, Any]:
    row = conn.execute(sa.text("SELECT * FROM awa.storage_transition_state")).mappings().one()
    markers = conn.execute(
        sa.text("SELECT backend, schema_name FROM awa.runtime_storage_backends ORDER BY 1")
    )
    routing = conn.execute(
        sa.text("SELECT awa.active_storage_engine(), awa.active_queue_storage_schema()")
    )
    return {
        **{key: row[key] for key in ("current_engine", "prepared_engine", "state", "details")},
        "transition_epoch": row["transition_epoch"],
        "finalized": row["finalized_at"] is not None,
        "markers": [tuple(marker) for marker in markers],
        "routing": tuple(routing.one()),
    }


@pytest.mark.parametrize("phases", SEQUENCES, ids="-".join)
def test_set_phase_leaves_what_the_awa_storage_commands_leave(
    awa_engine: sa.Engine,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
    real_template: str,
    phases: list[Phase],
) -> None:
    real_url = clone_database(real_template)
    for step in cli_steps(phases):
        run_awa(pg, sa.make_url(real_url).database or "", *step)
    with awa_engine.begin() as conn:
        for phase in phases:
            set_phase(conn, phase)
        kit = transition(conn)
    engine = sa.create_engine(real_url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        assert kit == transition(conn)
    engine.dispose()


def test_a_contested_attempt_conflicts_then_is_cancelled_as_a_duplicate(
    awa_engine: sa.Engine,
) -> None:
    with awa_engine.begin() as conn:
        first = contested_attempt(conn, unique_key=b"ada@example.com", kind="send_email")
        second = contested_attempt(conn, unique_key=b"bob@example.com", kind="send_email")
        assert claims(conn) == [
            (b"ada@example.com", first.holder_id),
            (b"bob@example.com", second.holder_id),
        ]
    assert first.holder_id > first.job_id  # the newer duplicate
    with pytest.raises(UniqueConflict) as conflict:
        reschedule_canonical_attempt(awa_engine, first.job_id, first.run_lease, Snooze(5))
    assert conflict.value.constraint == "idx_awa_jobs_unique"
    with awa_engine.begin() as conn:
        assert job_row(conn, first.job_id)["state"] == "running"  # until rescue, as in Awa
        set_phase(conn, "mixed_transition")
    outcome = reschedule_canonical_attempt(awa_engine, second.job_id, second.run_lease, Snooze(5))
    assert isinstance(outcome, CancelledDuplicate)
    with awa_engine.connect() as conn:
        assert claims(conn)[-1] == (b"bob@example.com", second.holder_id)


def test_running_attempt_seeds_an_old_final_claim(engine: sa.Engine) -> None:
    """An admin task's 'running for more than 30 minutes' and a final attempt, from the kit."""
    long_ago = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    with engine.begin() as conn:
        job_id, lease = running_attempt(conn, attempt=3, max_attempts=3, attempted_at=long_ago)
    (old,) = awa_sa.running_attempts(engine, running_for=dt.timedelta(minutes=30))
    assert (old.job_id, old.run_lease, old.attempted_at, old.heartbeat_at) == (
        job_id,
        lease,
        long_ago,
        long_ago,
    )
    assert old.deadline_at == long_ago + dt.timedelta(seconds=300)
    assert (old.attempt, old.max_attempts) == (3, 3)
    assert awa_sa.settle_canonical_attempt(engine, job_id, lease, awa_sa.Fail("x")) == (
        awa_sa.Failed(job_id, terminal=False)
    )
