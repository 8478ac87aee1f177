"""Settling a queue-storage attempt on the fixture: every result on a ``lease_claims`` receipt.

What each result writes is checked table by table (docs/contract.md#receipts), a running lease a
callback materialised too; the rows
themselves are compared with the real runtime's in test_queue_storage_worker.py. A second settle
of the same attempt is ``Stale`` and writes nothing, and so is a settle that names the attempt
with the wrong kind, queue or attempt. A compact receipt (a queue without a deadline) is refused
by every settle, alone or in a batch, sync or async, before any statement
(docs/contract.md#compact-receipts).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from calling import DRIVERS, driver_url, is_async
from jobs import every_row, insert_job
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
import awa_sa_schema
from awa_sa import RunningAttempt
from awa_sa.testing import locate, queue_storage_attempt

QS = "awa_qs"

RESULTS: dict[str, Any] = {
    "complete": awa_sa.Complete(),
    "cancel": awa_sa.Cancel("by test"),
    "terminal": awa_sa.Fail("boom", terminal=True),
    "retry": awa_sa.Fail("transient"),
    "final": awa_sa.Fail("transient"),
    "snooze": awa_sa.Snooze(60),
    "retry_after": awa_sa.RetryAfter(60),
    "backoff": awa_sa.RetryBackoff(),
}
ENDS = {
    "complete": "completed",
    "cancel": "cancelled",
    "terminal": "failed",
    "final": "failed",
    "retry": "retryable",
    "snooze": "scheduled",
    "retry_after": "retryable",
    "backoff": "retryable",
}
TABLES = (
    "lease_claim_closures",
    "lease_claim_closure_batches",
    "receipt_completion_batches",
    "done_entries",
    "deferred_jobs",
    "queue_terminal_count_deltas",
)


@pytest.fixture
def active(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "active", QS)
    return engine


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t: conn.execute(sa.text(f"SELECT count(*) FROM {QS}.{t}")).scalar_one() for t in TABLES
        }


def test_each_result_writes_its_rows_once(active: sa.Engine) -> None:
    """Every result on a bare and a tagged job, one attempt each, in one database: each
    settle's writes are counted as differences."""
    for name in sorted(RESULTS):
        for bare in (True, False):
            _settled_once(active, name, bare=bare)


def _settled_once(active: sa.Engine, name: str, *, bare: bool) -> None:
    extra: dict[str, Any] = {} if bare else {"tags": ["t1"], "metadata": {"tenant": "acme"}}
    with active.begin() as conn:
        attempt = queue_storage_attempt(
            conn,
            schema=QS,
            kind="mail",
            queue="mail",
            max_attempts=1 if name == "final" else 3,
            **extra,
        )
    assert attempt.claim_batch_id is None
    before = counts(active)
    with active.connect() as conn:
        running = locate(conn, attempt.job_id, schema=QS)
    assert running is not None
    assert (running.table, running.state) == ("lease_claims", "running")
    closed_before = _closures(active)
    outcome = awa_sa.settle(active, attempt, RESULTS[name])
    after = counts(active)
    state = ENDS[name]
    fast = name == "complete" and bare
    terminal = state in ("completed", "cancelled", "failed")
    written = {t: after[t] - before[t] for t in TABLES}
    assert written == {
        "lease_claim_closures": int(not fast),
        "lease_claim_closure_batches": int(fast),
        "receipt_completion_batches": int(fast),
        "done_entries": int(terminal and not fast),
        "deferred_jobs": int(not terminal),
        "queue_terminal_count_deltas": int(terminal and not fast),
    }
    if terminal:
        assert (
            outcome
            == {
                "completed": awa_sa.Completed(attempt.job_id),
                "cancelled": awa_sa.Cancelled(attempt.job_id),
                "failed": awa_sa.Failed(attempt.job_id, terminal=name == "terminal"),
            }[state]
        )
    else:
        assert isinstance(outcome, awa_sa.Rescheduled)
        assert outcome.job_id == attempt.job_id
        assert outcome.attempt == attempt.attempt - (name == "snooze")
    assert _closures(active) == [*closed_before, state]
    with active.connect() as conn:
        where = locate(conn, attempt.job_id, schema=QS)
    assert where is not None
    table = (
        "receipt_completion_batches" if fast else "done_entries" if terminal else "deferred_jobs"
    )
    assert (where.table, where.state, where.run_lease) == (table, state, 1)
    assert awa_sa.running_attempts(active) == []
    assert awa_sa.settle(active, attempt, RESULTS[name]) == awa_sa.Stale()
    assert counts(active) == after


async def test_a_compact_receipt_is_refused_by_every_settle(active: sa.Engine, db_url: str) -> None:
    """Every result, ``settle`` and ``settle_attempts`` (one compact item beside a
    ``lease_claims`` one), and their async twins: ``CompactReceipt`` before any statement, so
    every row reads as before and a caller's transaction goes on."""
    with active.begin() as conn:
        compact = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail", deadline_secs=0)
        keyed = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
    assert compact.claim_batch_id is not None
    before = every_row(active)
    for result in RESULTS.values():
        with pytest.raises(awa_sa.CompactReceipt, match="deadline_duration_ms") as refused:
            awa_sa.settle(active, compact, result)
    assert (refused.value.job_id, refused.value.schema, refused.value.index) == (
        compact.job_id,
        QS,
        None,
    )
    batch = [
        awa_sa.Settlement(keyed, awa_sa.Complete()),
        awa_sa.Settlement(compact, awa_sa.Complete()),
    ]
    with active.begin() as conn:
        with pytest.raises(awa_sa.CompactReceipt, match=r"^settlements\[1\]: ") as in_batch:
            awa_sa.settle_attempts(conn, batch)
        assert in_batch.value.index == 1
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1  # still usable
    face = create_async_engine(driver_url(db_url, "asyncpg"))
    try:
        with pytest.raises(awa_sa.CompactReceipt):
            await awa_async.settle(face, compact, awa_sa.Cancel("no"))
        with pytest.raises(awa_sa.CompactReceipt):
            await awa_async.settle_attempts(face, batch)
    finally:
        await face.dispose()
    assert every_row(active) == before


def _closures(engine: sa.Engine) -> list[str]:
    """Every closure's outcome, oldest first (closure rows and batches alike)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    f"SELECT outcome FROM (SELECT outcome, closed_at FROM {QS}.lease_claim_closures"
                    f" UNION ALL SELECT outcome, closed_at FROM {QS}.lease_claim_closure_batches)"
                    " AS c ORDER BY closed_at"
                )
            ).scalars()
        )


@pytest.mark.parametrize("field", ["kind", "queue", "attempt"])
def test_a_receipt_that_is_no_longer_that_attempt_is_stale(active: sa.Engine, field: str) -> None:
    with active.begin() as conn:
        attempt = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
    other = {"kind": "other", "queue": "other", "attempt": attempt.attempt + 1}[field]
    before = counts(active)
    wrong = attempt.__class__(**{**_fields(attempt), field: other})
    assert awa_sa.settle(active, wrong, awa_sa.Complete()) == awa_sa.Stale()
    assert counts(active) == before
    assert [a.receipt_id for a in awa_sa.running_attempts(active)] == [attempt.receipt_id]


def _fields(attempt: RunningAttempt) -> dict[str, Any]:
    return {name: getattr(attempt, name) for name in attempt.__slots__}


def _materialise(conn: sa.Connection, attempt: RunningAttempt, lane_seq: int) -> None:
    """The attempt's receipt materialised into a running lease, as ``register_callback``."""
    conn.execute(
        sa.text(
            f"INSERT INTO {QS}.leases (lease_slot, lease_generation, ready_slot,"
            " ready_generation, job_id, queue, state, priority, attempt, run_lease,"
            " max_attempts, lane_seq, attempted_at, callback_id)"
            " VALUES (0, 0, 0, 0, :job, 'mail', 'running', 2, 1, 1, 25, :seq, now(),"
            " gen_random_uuid())"
        ),
        {"job": attempt.job_id, "seq": lane_seq},
    )
    conn.execute(
        sa.text(
            f"INSERT INTO {QS}.attempt_state (job_id, run_lease, progress, updated_at)"
            " VALUES (:job, 1, '{\"p\": 1}', now())"
        ),
        {"job": attempt.job_id},
    )
    conn.execute(
        sa.text(f"UPDATE {QS}.lease_claims SET materialized_at = now() WHERE job_id = :job"),
        {"job": attempt.job_id},
    )


def test_a_materialised_lease_is_settled_once_and_closed_as_the_runtime(
    active: sa.Engine,
) -> None:
    """A callback registered (a running lease): a terminal failure deletes the lease and its
    ``attempt_state``, closes the receipt as ``rescue`` and files the failed row with the
    flushed progress; a second settle is Stale. The rows are the real runtime's in
    test_materialised_settles.py."""
    with active.begin() as conn:
        attempt = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        _materialise(conn, attempt, 1)
    before = counts(active)
    failed = awa_sa.settle(active, attempt, awa_sa.Fail("boom", terminal=True))
    assert failed == awa_sa.Failed(attempt.job_id, terminal=True)
    after = counts(active)
    assert {t: after[t] - before[t] for t in TABLES if after[t] != before[t]} == {
        "lease_claim_closures": 1,
        "done_entries": 1,
        "queue_terminal_count_deltas": 1,
    }
    with active.connect() as conn:
        left = conn.execute(
            sa.text(
                f"SELECT (SELECT count(*) FROM {QS}.leases) + (SELECT count(*) FROM"
                f" {QS}.attempt_state), (SELECT outcome FROM {QS}.lease_claim_closures),"
                f" (SELECT closed_at IS NOT NULL FROM {QS}.lease_claims),"
                f" (SELECT payload->'progress' FROM {QS}.done_entries)"
            )
        ).one()
    assert tuple(left) == (0, "rescue", True, {"p": 1})
    assert awa_sa.settle(active, attempt, awa_sa.Complete()) == awa_sa.Stale()
    assert counts(active) == after


def test_a_materialised_lease_settles_in_a_batch_in_three_statements_alone(
    active: sa.Engine,
) -> None:
    """Alone: the lock, the receipt statement that finds the lease, the lease's settle. In a
    batch beside a plain receipt, each item as alone."""
    with active.begin() as conn:
        plain = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        leased = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        _materialise(conn, leased, 2)
        alone = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        _materialise(conn, alone, 3)
    texts: list[str] = []

    def seen(*args: Any) -> None:
        texts.append(args[2])

    sa.event.listen(active, "before_cursor_execute", seen)
    try:
        with active.begin() as conn:
            texts.clear()
            assert awa_sa.settle(conn, alone, awa_sa.Snooze(60)).__class__ is awa_sa.Rescheduled
            assert len(texts) == 3
            assert "DELETE FROM awa_qs.leases" in texts[2]
    finally:
        sa.event.remove(active, "before_cursor_execute", seen)
    items = [
        awa_sa.Settlement(plain, awa_sa.Complete()),
        awa_sa.Settlement(leased, awa_sa.Cancel("no")),
    ]
    outcomes = awa_sa.settle_attempts(active, items)
    assert outcomes == [awa_sa.Completed(plain.job_id), awa_sa.Cancelled(leased.job_id)]
    with active.connect() as conn:
        closures = conn.execute(
            sa.text(f"SELECT job_id, outcome FROM {QS}.lease_claim_closures ORDER BY job_id")
        ).all()
        left = conn.execute(sa.text(f"SELECT count(*) FROM {QS}.leases")).scalar_one()
    assert [tuple(c) for c in closures] == [(leased.job_id, "rescue"), (alone.job_id, "rescue")]
    assert left == 0


def test_a_batch_of_both_planes_is_one_by_one(engine: sa.Engine) -> None:
    """``settle_attempts``: canonical and queue-storage items, in input order, a repeat Stale."""
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", QS)
        canonical_id = insert_job(conn, kind="mail", queue="mail")
        receipts = [queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail") for _ in "ab"]
    (canonical,) = [a for a in awa_sa.running_attempts(engine) if not a.on_queue_storage]
    assert canonical.job_id == canonical_id
    first, second = receipts
    items = [
        awa_sa.Settlement(first, awa_sa.Complete()),
        awa_sa.Settlement(canonical, awa_sa.Cancel("gone")),
        awa_sa.Settlement(second, awa_sa.Snooze(30)),
        awa_sa.Settlement(first, awa_sa.Complete()),
    ]
    outcomes = awa_sa.settle_attempts(engine, items)
    assert outcomes[:2] == [awa_sa.Completed(first.job_id), awa_sa.Cancelled(canonical_id)]
    assert isinstance(outcomes[2], awa_sa.Rescheduled)
    assert outcomes[3] == awa_sa.Stale()
    assert awa_sa.running_attempts(engine) == []
    assert awa_sa.settle_attempts(engine, []) == []


@pytest.mark.parametrize("form", ["engine", "connection"])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_the_batch_form_on_every_driver_and_face(
    engine: sa.Engine, db_url: str, driver: str, form: str
) -> None:
    """``settle_attempts`` (``awa_sa.asyncio``'s on the async drivers), as an Engine and
    inside a caller's transaction: both planes, each item once, the caller's commit keeps it."""
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", QS)
        canonical_id = insert_job(conn, kind="mail", queue="mail")
        receipt = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
    (canonical,) = [a for a in awa_sa.running_attempts(engine) if not a.on_queue_storage]
    items = [
        awa_sa.Settlement(receipt, awa_sa.Fail("boom", terminal=True)),
        awa_sa.Settlement(canonical, awa_sa.Complete()),
        awa_sa.Settlement(receipt, awa_sa.Complete()),
    ]
    url = driver_url(db_url, driver)
    if is_async(driver):
        face = create_async_engine(url)
        try:
            if form == "engine":
                outcomes = await awa_async.settle_attempts(face, items)
            else:
                async with face.begin() as aconn:
                    outcomes = await awa_async.settle_attempts(aconn, items)
        finally:
            await face.dispose()
    else:
        sync = sa.create_engine(url)
        try:
            if form == "engine":
                outcomes = awa_sa.settle_attempts(sync, items)
            else:
                with sync.begin() as conn:
                    outcomes = awa_sa.settle_attempts(conn, items)
        finally:
            sync.dispose()
    assert outcomes == [
        awa_sa.Failed(receipt.job_id, terminal=True),
        awa_sa.Completed(canonical_id),
        awa_sa.Stale(),
    ]
    assert awa_sa.running_attempts(engine) == []
    with engine.connect() as conn:
        where = locate(conn, receipt.job_id, schema=QS)
    assert where is not None
    assert where.state == "failed"


def test_a_refused_item_leaves_the_callers_transaction_as_it_was(active: sa.Engine) -> None:
    with active.begin() as conn:
        ok = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        held = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        # Its key, claimed only once failed, is another job's: its failure cannot be filed.
        conn.execute(
            sa.text(
                f"UPDATE {QS}.ready_entries SET unique_key = 'k', unique_states = '00000100'"
                " WHERE job_id = :job"
            ),
            {"job": held.job_id},
        )
        conn.execute(sa.text("INSERT INTO awa.job_unique_claims VALUES ('k', 999999)"))
    before = counts(active)
    with active.begin() as conn:
        items = [
            awa_sa.Settlement(ok, awa_sa.Complete()),
            awa_sa.Settlement(held, awa_sa.Fail("no", terminal=True)),
        ]
        with pytest.raises(awa_sa.UniqueConflict):
            awa_sa.settle_attempts(conn, items)
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1  # still usable
    assert counts(active) == before
    with pytest.raises(awa_sa.ValidationError, match=r"settlements\[1\]"):
        awa_sa.settle_attempts(active, [awa_sa.Settlement(ok, awa_sa.Complete()), "no"])  # type: ignore[list-item]


@pytest.mark.parametrize("mode", [None, "force_custom_plan"])
def test_the_callers_plan_cache_mode_is_as_it_was(active: sa.Engine, mode: str | None) -> None:
    """The settle asks for its generic plan for itself alone: the caller's statements after it,
    in the same transaction and the next, plan as the caller set them to."""
    with active.begin() as conn:
        if mode is not None:
            conn.execute(sa.text("SELECT set_config('plan_cache_mode', :m, true)"), {"m": mode})
        before = conn.execute(sa.text("SHOW plan_cache_mode")).scalar_one()
        attempt = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        assert isinstance(awa_sa.settle(conn, attempt, awa_sa.Complete()), awa_sa.Completed)
        assert conn.execute(sa.text("SHOW plan_cache_mode")).scalar_one() == before
    with active.connect() as conn:
        assert conn.execute(sa.text("SHOW plan_cache_mode")).scalar_one() == "auto"
        attempt_again = queue_storage_attempt(conn, schema=QS, kind="mail", queue="mail")
        awa_sa.settle(conn, attempt_again, awa_sa.Complete())
        assert conn.execute(sa.text("SHOW plan_cache_mode")).scalar_one() == "auto"
        conn.rollback()
