"""Decision-table rows 1-4 (routing canonical), on an ``awa migrate`` cluster (``cluster``).

Routing is canonical in the ``canonical`` and ``prepared`` phases and after an abort; each row is
checked for every kind in each of them. Every assertion reads rows back.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import (
    CALLBACK_VALUES,
    KINDS,
    Called,
    advance_all,
    call,
    check_run_at,
    duplicate_mask,
    insert_holder,
    insert_job,
    jsonb_text,
    next_state,
    row_text,
    rows,
    seq_next,
    snapshot_of,
)

from awa_sa import Kind, Rescheduled, RetryBackoff, Snooze, Stale, UniqueConflict

CANONICAL_PHASES = ("canonical", "prepared", "aborted")
CALLBACKS = list(CALLBACK_VALUES)
CARRIED = [
    "kind",
    "queue",
    "args",
    "priority",
    "max_attempts",
    "attempted_at",
    "created_at",
    "metadata",
    "tags",
    "unique_key",
    "unique_states",
    "callback_id",
    "callback_timeout_at",
    "callback_filter",
    "callback_on_complete",
    "callback_on_fail",
    "callback_transform",
    "run_lease",
]


@pytest.fixture(params=CANONICAL_PHASES)
def canon(cluster: Cluster, request: pytest.FixtureRequest) -> sa.Engine:
    cluster.set_phase(request.param, "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
    return cluster.engine


def _claims(engine: sa.Engine) -> set[tuple[bytes, int]]:
    with engine.connect() as conn:
        return {
            (bytes(r.unique_key), r.job_id)
            for r in rows(conn, "SELECT * FROM awa.job_unique_claims")
        }


def _check_moved(
    engine: sa.Engine,
    kind: Kind,
    called: Called,
    before: dict[str, Any],
    *,
    errors: list[Any] | None,
    progress: str | None,
) -> None:
    """Row 2/3: the same id, now in scheduled_jobs, as docs/contract.md#canonical-move says."""
    job_id = int(before["id"])
    attempt = int(before["attempt"]) - (1 if isinstance(kind, Snooze) else 0)
    outcome = called.outcome
    assert isinstance(outcome, Rescheduled)
    assert (outcome.job_id, outcome.attempt) == (job_id, attempt)
    with engine.connect() as conn:
        assert row_text(conn, "awa.jobs_hot", "id = :i", i=job_id) is None
        after = row_text(conn, "awa.scheduled_jobs", "id = :i", i=job_id)
        typed = rows(
            conn, "SELECT run_at, finalized_at FROM awa.scheduled_jobs WHERE id = :i", i=job_id
        )[0]
        assert after is not None
        assert {c: after[c] for c in CARRIED} == {c: before[c] for c in CARRIED}
        assert after["state"] == next_state(kind)
        assert int(after["attempt"]) == attempt
        assert after["heartbeat_at"] is None
        assert after["deadline_at"] is None
        assert typed.run_at == outcome.run_at
        check_run_at(kind, int(before["attempt"]), outcome.run_at, called.now)
        if isinstance(kind, Snooze):
            assert after["finalized_at"] == before["finalized_at"]  # carried, even if set
        else:
            assert typed.finalized_at == called.now
        expected_errors = None if errors is None else json.dumps(errors)
        assert jsonb_text(conn, after["errors"]) == jsonb_text(conn, expected_errors)
        assert jsonb_text(conn, after["progress"]) == jsonb_text(conn, progress)
    queue, kind_name = before["queue"], before["kind"]
    assert sorted((t, v) for (t, v, _) in called.new_marks.elements()) == [
        ("admin_dirty_kind_marks", kind_name),
        ("admin_dirty_kind_marks", kind_name),
        ("admin_dirty_queue_marks", queue),
        ("admin_dirty_queue_marks", queue),
    ]


def _before(engine: sa.Engine, job_id: int) -> dict[str, Any]:
    with engine.connect() as conn:
        row = row_text(conn, "awa.jobs_hot", "id = :i", i=job_id)
    assert row is not None
    return row


# -- row 1 --------------------------------------------------------------------------------


def test_row1_stale_changes_nothing(canon: sa.Engine) -> None:
    with canon.begin() as conn:
        running = insert_job(conn, run_lease=5, unique_key=b"k", unique_states="11111000")
        waiting = insert_job(conn, state="waiting_external", run_lease=1)
    before = snapshot_of(canon)
    for kind in KINDS.values():
        assert call(canon, running, kind, lease=4).outcome == Stale()  # rescued: lease moved on
        assert call(canon, waiting, kind, lease=1).outcome == Stale()  # not running
        assert call(canon, 999_999, kind, lease=1).outcome == Stale()  # gone
    assert snapshot_of(canon) == before  # no rows, marks, claims or sequence values


# -- rows 2 and 3 -------------------------------------------------------------------------


def test_rows2_3_rescheduled_in_place(canon: sa.Engine) -> None:
    claims: set[tuple[bytes, int]] = set()
    for name, kind in KINDS.items():
        claims |= _rows2_3_for(canon, name, kind)
    # Row 2: a claim held while running is released when the new state is outside the mask.
    # Row 3: a claiming successor (re)takes its key under the same id.
    assert _claims(canon) == claims
    with canon.connect() as conn:
        assert seq_next(conn, "awa.jobs_id_seq") == 1000 + 7 * len(KINDS)
        assert seq_next(conn, "awa.job_id_seq") == 5000  # queue storage untouched
        assert seq_next(conn, "awa_qs.job_id_seq") == 7000
        assert rows(conn, "SELECT * FROM awa_qs.deferred_jobs") == []
        assert rows(conn, "SELECT * FROM awa.deferred_jobs") == []


def _rows2_3_for(canon: sa.Engine, name: str, kind: Kind) -> set[tuple[bytes, int]]:
    """Seven attempts of one kind; returns the claims their successors must hold."""
    free_mask = duplicate_mask(kind, claims_cancelled=False)  # claims next, not running
    key = name.encode()
    with canon.begin() as conn:
        plain = insert_job(
            conn,
            args='{"to": "a@example.com", "big": 1e400}',
            metadata='{"tenant": "acme", "d": 0.1000000000000000000001, "n": 1e400}',
            tags=["t1", "t2"],
            attempt=3,
            progress='{"old": true}',
        )
        carried = insert_job(
            conn,
            finalized_at="2020-01-01 00:00:00+00",
            errors=['{"old": 1}', '"two"'],
            progress='{"old": true}',
            attempt=2,
        )
        empty_errors = insert_job(conn, errors=[])
        released = insert_job(conn, unique_key=key + b"-released", unique_states="00100000")
        free = insert_job(conn, unique_key=key + b"-free", unique_states=free_mask)
        held = insert_job(conn, unique_key=key + b"-held", unique_states="11111000")
        wired = insert_job(conn, callbacks=CALLBACKS)
    befores = {j: _before(canon, j) for j in (plain, carried, empty_errors)}

    error = {"error": "boom", "attempt": 3, "n": 10**30}
    called = call(canon, plain, kind, error=error, progress={"percent": 40})
    _check_moved(canon, kind, called, befores[plain], errors=[error], progress='{"percent": 40}')

    called = call(canon, carried, kind)  # no error: list unchanged; no progress: cleared
    _check_moved(canon, kind, called, befores[carried], errors=[{"old": 1}, "two"], progress=None)

    called = call(canon, empty_errors, kind)  # an empty list stays an empty list
    _check_moved(canon, kind, called, befores[empty_errors], errors=[], progress=None)

    for job in (released, free, held, wired):  # an array error is still one element
        before = _before(canon, job)
        called = call(canon, job, kind, error=[1, 2])
        _check_moved(canon, kind, called, before, errors=[[1, 2]], progress=None)
    return {(key + b"-free", free), (key + b"-held", held)}


# -- row 4 --------------------------------------------------------------------------------


def test_row4_unique_conflict_propagates_and_job_stays_running(canon: sa.Engine) -> None:
    jobs = {}
    with canon.begin() as conn:
        for name, kind in KINDS.items():
            mask = duplicate_mask(kind, claims_cancelled=False)
            jobs[name] = insert_job(conn, unique_key=name.encode(), unique_states=mask)
            insert_holder(conn, name.encode(), mask)
    before = snapshot_of(canon)
    for name, kind in KINDS.items():
        with pytest.raises(UniqueConflict) as info:
            call(canon, jobs[name], kind, error={"e": 1})
        assert info.value.constraint == "idx_awa_jobs_unique"
        assert isinstance(info.value.__cause__, sa.exc.IntegrityError)
    assert snapshot_of(canon) == before  # still running, claims and marks untouched


# -- routing edge and clock edges (one phase: they do not depend on it) --------------------


def test_missing_singleton_routes_canonical(cluster: Any) -> None:
    with cluster.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
        job = insert_job(conn, attempt=2)
    before = _before(cluster.engine, job)
    called = call(cluster.engine, job, KINDS["retry_after"])
    _check_moved(cluster.engine, KINDS["retry_after"], called, before, errors=None, progress=None)


def test_backoff_is_the_database_formula(cluster: Any) -> None:
    attempts = [0, 1, 10, 16, 17, 42]
    with cluster.engine.begin() as conn:
        jobs = {a: insert_job(conn, attempt=a, max_attempts=1000) for a in attempts}
    for attempt, job in jobs.items():
        called = call(cluster.engine, job, RetryBackoff())
        assert isinstance(called.outcome, Rescheduled)
        check_run_at(RetryBackoff(), attempt, called.outcome.run_at, called.now)


def test_delay_is_exact_to_the_microsecond(cluster: Any) -> None:
    delays = [0.0, 0.000001, 5.25, 123456.789012, 86400 * 365 * 100]
    with cluster.engine.begin() as conn:
        jobs = {d: insert_job(conn) for d in delays}
    for delay, job in jobs.items():
        called = call(cluster.engine, job, Snooze(delay))
        assert isinstance(called.outcome, Rescheduled)
        check_run_at(Snooze(delay), 1, called.outcome.run_at, called.now)
