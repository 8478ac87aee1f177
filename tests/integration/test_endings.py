"""Every way a canonical attempt ends, written as Awa 0.6.9's worker writes it, in every phase.

Complete, Cancel and a terminal Fail end the attempt in place: the row stays in
``awa.jobs_hot`` under its id, ``finalized_at`` is the transaction's clock, ``heartbeat_at`` and
``deadline_at`` are kept, a completion clears the progress and appends no error, the others
append the worker's entry and write the progress given. A retryable Fail ends the attempt
``failed`` only on its final attempt (no ``terminal`` key) and is otherwise retried with
backoff, its entry carrying the attempt and the clock. The unique claim goes exactly when the
new state leaves the row's mask. tests/integration/test_real_worker.py compares these rows
with the real worker's.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import insert_job, snapshot_of
from recording import recording

import awa_sa
from awa_sa import (
    Cancel,
    Cancelled,
    Complete,
    Completed,
    Fail,
    Failed,
    Migrated,
    QueueStorageAttempt,
    Rescheduled,
    RetryAfter,
    Settle,
    Snooze,
    Stale,
    ValidationError,
)
from awa_sa.testing import locate, queue_storage_attempt

PHASES = ["canonical", "prepared", "mixed_transition", "active"]
QS = "awa_qs"


def _row(engine: sa.Engine, job_id: int) -> dict[str, Any]:
    with engine.connect() as conn:
        row = (
            conn.execute(
                sa.text(
                    "SELECT state::text AS state, attempt, run_lease, errors, progress,"
                    " finalized_at, heartbeat_at,"
                    " deadline_at FROM awa.jobs_hot WHERE id = :id"
                ),
                {"id": job_id},
            )
            .mappings()
            .one()
        )
        claims = conn.execute(
            sa.text("SELECT count(*) FROM awa.job_unique_claims WHERE job_id = :id"),
            {"id": job_id},
        ).scalar_one()
    return {**row, "claims": claims}


def _job(cluster: Cluster, **values: Any) -> int:
    with cluster.engine.begin() as conn:
        job = insert_job(conn, **values)
        conn.execute(
            sa.text(
                "UPDATE awa.jobs_hot SET heartbeat_at = now(),"
                " deadline_at = now() + interval '5 minutes' WHERE id = :id"
            ),
            {"id": job},
        )
    return job


@pytest.mark.parametrize("phase", PHASES)
def test_each_ending_in_place_in_every_phase(cluster: Cluster, phase: str) -> None:
    cluster.set_phase(phase, QS)
    keyed = {"unique_states": "11111000", "progress": '{"p": 1}'}
    done = _job(cluster, unique_key=b"done", **keyed)
    cancelled = _job(cluster, unique_key=b"cancel", **keyed)
    terminal = _job(cluster, unique_key=b"terminal", **keyed)
    final = _job(cluster, unique_key=b"final", attempt=3, max_attempts=3, **keyed)
    before = {job: _row(cluster.engine, job) for job in (done, cancelled, terminal, final)}
    engine = cluster.engine
    assert awa_sa.settle_canonical_attempt(engine, done, 1, Complete()) == Completed(done)
    assert awa_sa.settle_canonical_attempt(
        engine, cancelled, 1, Cancel("no longer wanted"), progress={"p": 2}
    ) == Cancelled(cancelled)
    assert awa_sa.settle_canonical_attempt(
        engine, terminal, 1, Fail("Boom: it broke", terminal=True), progress={"p": 3}
    ) == Failed(terminal, terminal=True)
    assert awa_sa.settle_canonical_attempt(
        engine, final, 1, Fail("Flaky: again"), progress={"p": 4}
    ) == Failed(final, terminal=False)
    rows = {job: _row(engine, job) for job in before}
    for job, row in rows.items():
        kept = before[job]
        assert (row["heartbeat_at"], row["deadline_at"]) == (
            kept["heartbeat_at"],
            kept["deadline_at"],
        )
        assert row["finalized_at"] is not None
        assert (row["attempt"], row["run_lease"]) == (kept["attempt"], kept["run_lease"])
    assert (rows[done]["state"], rows[done]["progress"]) == ("completed", None)
    assert rows[done]["errors"] == before[done]["errors"]  # a completion appends no error
    assert rows[done]["claims"] == 1  # completed is in the mask
    for job, state, error, progress in (
        (cancelled, "cancelled", "cancelled: no longer wanted", {"p": 2}),
        (terminal, "failed", "Boom: it broke", {"p": 3}),
        (final, "failed", "Flaky: again", {"p": 4}),
    ):
        row = rows[job]
        assert (row["state"], row["progress"], row["claims"]) == (state, progress, 0)
        (entry,) = row["errors"]
        expected = {"error", "attempt", "at"} | ({"terminal"} if job == terminal else set())
        assert set(entry) == expected
        assert (entry["error"], entry["attempt"]) == (error, before[job]["attempt"])
        assert entry.get("terminal", True) is True
        assert entry["at"].endswith("+00:00")
        assert entry["at"][10] == "T"


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_a_retryable_failure_with_attempts_left_is_retried_with_backoff(
    cluster: Cluster, phase: str
) -> None:
    cluster.set_phase(phase, QS)
    job = _job(cluster, attempt=2, max_attempts=5)
    outcome = awa_sa.settle_canonical_attempt(cluster.engine, job, 1, Fail("Flaky: try again"))
    assert isinstance(outcome, Rescheduled if phase == "canonical" else Migrated)
    assert outcome.attempt == 2
    table, key = (
        ("awa.scheduled_jobs", "id") if phase == "canonical" else (f"{QS}.deferred_jobs", "job_id")
    )
    column = "errors" if phase == "canonical" else "payload->'errors'"
    with cluster.engine.connect() as conn:
        state, errors = conn.execute(
            sa.text(f"SELECT state::text, {column} FROM {table} WHERE {key} = :id"),
            {"id": outcome.job_id},
        ).one()
    assert state == "retryable"
    (entry,) = errors
    assert set(entry) == {"error", "attempt", "at"}
    assert (entry["error"], entry["attempt"]) == ("Flaky: try again", 2)


def test_a_mask_holding_the_end_state_keeps_the_claim(cluster: Cluster) -> None:
    job = _job(cluster, unique_key=b"all", unique_states="11111110")
    assert awa_sa.settle_canonical_attempt(cluster.engine, job, 1, Cancel()) == Cancelled(job)
    row = _row(cluster.engine, job)
    assert (row["state"], row["claims"]) == ("cancelled", 1)
    assert row["errors"][0]["error"] == "cancelled: cancelled by handler"


def test_a_stale_ending_changes_nothing(cluster: Cluster) -> None:
    job = _job(cluster)
    before = snapshot_of(cluster.engine)
    for result in (Complete(), Cancel(), Fail("x"), Fail("x", terminal=True)):
        assert awa_sa.settle_canonical_attempt(cluster.engine, job, 2, result) == Stale()
    assert snapshot_of(cluster.engine) == before


def test_an_ending_in_the_engine_form_is_one_statement_and_no_routing_lock(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        jobs = [insert_job(conn) for _ in range(3)]
    results: list[Complete | Cancel | Fail] = [Complete(), Cancel(), Fail("x", terminal=True)]
    for job, result in zip(jobs, results, strict=True):
        with recording(engine, lambda sql: sql, events=()) as sent:
            awa_sa.settle_canonical_attempt(engine, job, 1, result)
        assert len(sent) == 1
        assert "FOR SHARE" not in sent[0]
        assert "UPDATE awa.jobs_hot" in sent[0]


def test_a_batch_is_its_items_one_after_another(cluster: Cluster) -> None:
    with cluster.engine.begin() as conn:
        jobs = [insert_job(conn) for _ in range(6)]
        final = insert_job(conn, attempt=2, max_attempts=2)
    items = [
        Settle(jobs[0], 1, Complete()),
        Settle(jobs[1], 1, Snooze(30)),
        Settle(jobs[2], 1, Cancel("stop")),
        Settle(jobs[3], 1, Fail("again")),
        Settle(final, 1, Fail("last")),
        Settle(jobs[0], 1, Cancel()),  # ended by the first item: Stale
        Settle(jobs[4], 1, RetryAfter(5)),
        Settle(jobs[5], 1, Fail("over", terminal=True)),
    ]
    outcomes = awa_sa.settle_canonical_attempts(cluster.engine, items)
    assert [type(o).__name__ for o in outcomes] == [
        "Completed",
        "Rescheduled",
        "Cancelled",
        "Rescheduled",
        "Failed",
        "Stale",
        "Rescheduled",
        "Failed",
    ]
    assert outcomes[4] == Failed(final, terminal=False)
    assert outcomes[7] == Failed(jobs[5], terminal=True)


def test_settle_ends_the_attempt_it_was_given(cluster: Cluster) -> None:
    with cluster.engine.begin() as conn:
        job = insert_job(conn, kind="send_email", queue="mail")
    (attempt,) = awa_sa.running_attempts(cluster.engine)
    assert awa_sa.settle(cluster.engine, attempt, Complete()) == Completed(job)
    with cluster.engine.connect() as conn:
        where = locate(conn, job)  # the kit finds ended rows too
    assert where is not None
    assert (where.relation, where.state) == ("awa.jobs_hot", "completed")


def test_a_bare_ending_naming_a_queue_storage_claim_is_refused(cluster: Cluster) -> None:
    cluster.set_phase("mixed_transition", QS)
    with cluster.engine.begin() as conn:
        job = insert_job(conn)
        claim = queue_storage_attempt(conn, schema=QS)
    assert (job, 1) == (claim.job_id, claim.run_lease), "the planes must collide"
    before = snapshot_of(cluster.engine)
    for result in (Complete(), Cancel(), Fail("x"), Fail("x", terminal=True)):
        with pytest.raises(QueueStorageAttempt) as refused:
            awa_sa.settle_canonical_attempt(cluster.engine, job, 1, result)
        assert refused.value.canonical_too is True
    assert snapshot_of(cluster.engine) == before
    (canonical,) = [a for a in awa_sa.running_attempts(cluster.engine) if not a.on_queue_storage]
    assert awa_sa.settle(cluster.engine, canonical, Complete()) == Completed(job)


def test_bad_results_and_negative_delays_are_refused(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        job = insert_job(conn)
    before = snapshot_of(engine)
    for bad in (
        lambda: awa_sa.settle_canonical_attempt(engine, job, 1, "complete"),  # type: ignore[arg-type]
        lambda: awa_sa.settle_canonical_attempt(engine, job, 1, Fail("x"), error={"e": 1}),
        lambda: awa_sa.settle_canonical_attempt(engine, job, 1, Fail("nul \x00")),
        lambda: awa_sa.reschedule_canonical_attempt(engine, job, 1, Complete()),  # type: ignore[arg-type]
        lambda: awa_sa.reschedule_canonical_attempt(engine, job, 1, RetryAfter(-1e9)),
        lambda: Fail(42),  # type: ignore[arg-type]
        lambda: Snooze(-1),
    ):
        with pytest.raises(ValidationError):
            bad()
    assert snapshot_of(engine) == before
