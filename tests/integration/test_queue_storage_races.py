"""awa-sa and the real runtime settling the same queue-storage attempt: exactly one wins.

Beside a real awa-pg 0.6.9 runtime on a cluster its first start auto-finalized to queue storage
in schema ``awa`` (a clone of the ``awa migrate`` template, never touched by a runtime):

* **a forced race.** A handler holds a claimed job; a side transaction takes the receipt's own
  advisory lock, ``pg_advisory_xact_lock(hashtextextended('awa.receipt.complete:<job_id>:
  <run_lease>', 0))``, the lock every settle of the attempt takes first (the runtime's
  completions, failures and rescues, and awa-sa's). Then both contenders are made to wait on
  it, in a chosen order: awa-sa's ``settle`` (in a thread) and the runtime's own completion of
  the attempt (the handler returns). Each wait is read from ``pg_stat_activity`` and
  ``pg_locks``: wait event ``Lock``/``advisory``, on the very key the side transaction holds.
  PostgreSQL grants a released lock to its waiters in the order they queued, so the first to
  wait wins, and the test knows which one that is before it lets go. The second finds the
  receipt closed under the lock and writes nothing: exactly one closure names the receipt,
  exactly one terminal record names the job, the queue's terminal count (the runtime's exact
  formula) counts it once, and awa-sa's outcome says who won (its ending, or ``Stale``). Both
  orders; awa-sa completing, cancelling and failing terminally against the runtime's
  completion; a bare job (the runtime's compact completion) and one with tags (its
  ``done_entries`` row). The runtime then runs another job as usual: the race did not break it.
* **no rescue after awa-sa's settle.** On a queue with a 1.5 s deadline and a leader whose
  deadline rescue runs every 100 ms, awa-sa completes an attempt S while its handler holds, and
  the handler keeps holding past the deadline. A control attempt C, claimed after S (so its
  deadline is later), is not settled: once the leader's maintenance has rescued C, a rescue
  pass has run after S's deadline too. S stays completed: one closure (awa-sa's), one terminal
  record, counted once, never re-claimed, its handler run once; C is retried and completes.

Every wait is on an event, a lock the server reports, or a row the runtime writes; none on a
sleep. No ring rotates during a test (:data:`STILL_RINGS`): the prune of a sealed slot drops
its closures and terminal history, which the checks read afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from racing import DEFAULT_TIMEOUT, HeldTransaction, backend_pid, in_thread, wait_until_blocked
from runtimes import STILL, STILL_RINGS, pg_url, rows

import awa_sa
from awa_sa import (
    Cancel,
    Cancelled,
    Complete,
    Completed,
    Ending,
    Fail,
    Failed,
    Result,
    RunningAttempt,
    Stale,
    attempt_of,
)

pytestmark = pytest.mark.slow  # real awa-pg runtimes

QS = "awa"
"""Where the first ``auto`` runtime's auto-finalize puts queue storage."""

WAIT_SECS = 60.0


@dataclass
class Race:
    n: int


@dataclass
class Later:
    n: int


def copy_of(job: Any) -> SimpleNamespace:
    """What ``attempt_of`` reads, copied from the runtime's ``Job`` inside its loop."""
    return SimpleNamespace(
        id=job.id, attempt=job.attempt, kind=job.kind, queue=job.queue, created_at=job.created_at
    )


async def within(event: asyncio.Event, what: str = "event") -> None:
    try:
        await asyncio.wait_for(event.wait(), WAIT_SECS)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


@dataclass
class Holder:
    """A handler that records each run, then holds until released, then returns."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    returned: asyncio.Event = field(default_factory=asyncio.Event)
    runs: list[SimpleNamespace] = field(default_factory=list)
    hold: bool = True

    async def __call__(self, job: Any) -> None:
        self.runs.append(copy_of(job))
        self.holding.set()
        if self.hold:
            await self.release.wait()
        self.returned.set()


@asynccontextmanager
async def runtime(
    url: str, handlers: dict[type, tuple[str, Holder]], queues: list[dict[str, Any]], **start: Any
) -> AsyncIterator[awa.AsyncClient]:
    """A started awa-pg runtime; shut down (which drains its in-flight jobs) on exit."""
    client = awa.AsyncClient(pg_url(url))
    for args_type, (queue, handler) in handlers.items():
        client.task(args_type, queue=queue)(handler)
    start = {"heartbeat_interval_ms": 600_000, **STILL_RINGS, **start}
    await client.start(queues, **start)
    try:
        yield client
    finally:
        for _, handler in handlers.values():
            handler.release.set()
        await client.shutdown()
        await client.close()


def phase(engine: sa.Engine) -> tuple[str, str, dict[str, Any]]:
    [row] = rows(engine, "SELECT state, current_engine, details FROM awa.storage_transition_state")
    return row["state"], row["current_engine"], row["details"]


# ------------------------------------------------------------------------------ what is there

COUNTED = f"""
    SELECT COALESCE((SELECT sum(live_terminal_count) FROM {QS}.queue_terminal_live_counts
                     WHERE queue = :queue), 0)
         + COALESCE((SELECT sum(terminal_delta) FROM {QS}.queue_terminal_count_deltas
                     WHERE queue = :queue), 0)
         + COALESCE((SELECT sum(completed_count) FROM {QS}.receipt_completion_batches
                     WHERE queue = :queue), 0)
         - (SELECT count(*) FROM {QS}.receipt_completion_tombstones WHERE queue = :queue)
"""
"""A queue's terminal count as the runtime's exact read adds it up (``queue_counts_exact``):
folded counters, unrolled deltas of ``done_entries`` rows, and compact completions counted
from their batches. Each terminal record must be counted once, whichever way it was written."""


@dataclass(frozen=True)
class Ledger:
    """Everything that records how one attempt ``(job_id, run_lease)`` ended."""

    closures: list[tuple[str, str]]
    """``(where, outcome)``: a ``lease_claim_closures`` row, or a closure batch's range."""
    done: list[str]
    """States of ``done_entries`` rows under the pair."""
    compact: int
    """Positions naming the pair in ``receipt_completion_batches``."""
    terminal: list[tuple[int, str]]
    """``(run_lease, state)`` of every ``terminal_jobs`` row of the job, any lease."""
    deferred: int
    """``deferred_jobs`` rows of the job, any lease."""
    receipts: int
    """``lease_claims`` rows of the job, any lease: one per claim."""
    counted: int
    """The queue's terminal count (:data:`COUNTED`)."""
    queue_terminal: int
    """``terminal_jobs`` rows of the queue."""


def ledger(engine: sa.Engine, attempt: RunningAttempt) -> Ledger:
    pair = {"job": attempt.job_id, "lease": attempt.run_lease}
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # one snapshot

        def all_(sql: str, **params: Any) -> list[Any]:
            return list(conn.execute(sa.text(sql), {**pair, **params}).all())

        closures = [
            ("row", r.outcome)
            for r in all_(
                f"SELECT outcome FROM {QS}.lease_claim_closures"
                " WHERE job_id = :job AND run_lease = :lease"
            )
        ] + [
            ("batch", r.outcome)
            for r in all_(
                f"SELECT outcome FROM {QS}.lease_claim_closure_batches"
                " WHERE receipt_ranges @> CAST(:receipt AS bigint)",
                receipt=attempt.receipt_id,
            )
        ]
        done = [
            r.state
            for r in all_(
                f"SELECT state::text FROM {QS}.done_entries WHERE job_id = :job"
                " AND run_lease = :lease"
            )
        ]
        [compact] = all_(
            f"SELECT count(*) FROM {QS}.receipt_completion_batches AS b,"
            " unnest(b.job_ids, b.run_leases) AS i(job_id, run_lease)"
            " WHERE i.job_id = :job AND i.run_lease = :lease"
        )
        terminal = [
            (r.run_lease, r.state)
            for r in all_(
                f"SELECT run_lease, state::text FROM {QS}.terminal_jobs WHERE job_id = :job"
                " ORDER BY run_lease"
            )
        ]
        [deferred] = all_(f"SELECT count(*) FROM {QS}.deferred_jobs WHERE job_id = :job")
        [receipts] = all_(f"SELECT count(*) FROM {QS}.lease_claims WHERE job_id = :job")
        [counted] = all_(COUNTED, queue=attempt.queue)
        [queue_terminal] = all_(
            f"SELECT count(*) FROM {QS}.terminal_jobs WHERE queue = :queue", queue=attempt.queue
        )
    return Ledger(
        closures=closures,
        done=done,
        compact=int(compact[0]),
        terminal=terminal,
        deferred=int(deferred[0]),
        receipts=int(receipts[0]),
        counted=int(counted[0]),
        queue_terminal=int(queue_terminal[0]),
    )


# ----------------------------------------------------------------------------- the held lock

LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(format('awa.receipt.complete:%s:%s', :job, :lease), 0))"  # noqa: E501
"""The runtime's own spelling of the receipt's lock (``lock_receipt_attempts_tx``)."""

WAITS = """
    SELECT a.pid, a.application_name, a.wait_event_type, a.wait_event, a.query,
           l.locktype, l.classid, l.objid, l.objsubid, l.mode
    FROM pg_stat_activity AS a
    JOIN pg_locks AS l ON l.pid = a.pid AND NOT l.granted
    WHERE a.datname = current_database() AND :holder = ANY (pg_blocking_pids(a.pid))
    ORDER BY a.pid
"""

HELD = """
    SELECT locktype, classid, objid, objsubid, mode FROM pg_locks
    WHERE pid = :holder AND locktype = 'advisory' AND granted
"""


@dataclass(frozen=True)
class Waiting:
    pid: int
    who: str
    """``awa-sa`` (the settle's backend) or ``runtime`` (any other)."""
    wait_event_type: str
    wait_event: str
    lock: tuple[Any, ...]
    """``(locktype, classid, objid, objsubid, mode)`` of the lock it waits for."""
    query: str


def waiting(engine: sa.Engine, holder: int, awa_sa_pid: int) -> list[Waiting]:
    return [
        Waiting(
            pid=r["pid"],
            who="awa-sa" if r["pid"] == awa_sa_pid else "runtime",
            wait_event_type=r["wait_event_type"],
            wait_event=r["wait_event"],
            lock=(r["locktype"], r["classid"], r["objid"], r["objsubid"], r["mode"]),
            query=r["query"],
        )
        for r in rows(engine, WAITS, holder=holder)
    ]


def held_lock(engine: sa.Engine, holder: int) -> tuple[Any, ...]:
    [r] = rows(engine, HELD, holder=holder)
    return (r["locktype"], r["classid"], r["objid"], r["objsubid"], r["mode"])


def settle_then_commit(conn: sa.Connection, attempt: RunningAttempt, result: Result) -> Ending:
    """awa-sa's settle in the caller's transaction, committed: what a service's handler does."""
    try:
        outcome = awa_sa.settle(conn, attempt, result)
        conn.commit()
        return outcome
    finally:
        conn.close()


# --------------------------------------------------------------------------------- the races


@dataclass(frozen=True)
class Case:
    result: Result
    tags: list[str] | None
    """None: a bare job (the runtime completes it compactly); else a ``done_entries`` row."""
    won: Callable[[int], Ending]
    """awa-sa's outcome when it wins, from the job id."""
    state: str
    closure: str


CASES = {
    "complete-bare": Case(Complete(), None, Completed, "completed", "completed"),
    "complete-tagged": Case(Complete(), ["race"], Completed, "completed", "completed"),
    "cancel-bare": Case(Cancel("raced"), None, Cancelled, "cancelled", "cancelled"),
    "fail-tagged": Case(
        Fail("raced", terminal=True),
        ["race"],
        lambda job_id: Failed(job_id, terminal=True),
        "failed",
        "failed",
    ),
}


@dataclass
class Raced:
    attempt: RunningAttempt
    outcome: object
    first: list[Waiting]
    both: list[Waiting]
    held: tuple[Any, ...]
    ledger: Ledger
    runs: int
    phase: tuple[str, str, dict[str, Any]]
    later_done: bool


def race(url: str, engine: sa.Engine, case: Case, *, awa_sa_first: bool) -> Raced:
    """Hold the receipt's lock, queue both settles behind it in the chosen order, let go."""

    async def run() -> Raced:
        holder_ = Holder()
        later = Holder(hold=False)
        handlers: dict[type, tuple[str, Holder]] = {
            Race: ("race", holder_),
            Later: ("later", later),
        }
        queues = [{"name": "race", "max_workers": 1}, {"name": "later", "max_workers": 1}]
        async with runtime(url, handlers, queues) as client:
            await client.insert(Race(n=1), queue="race", tags=case.tags)
            await within(holder_.holding, "the claim")
            [job] = holder_.runs
            attempt = await asyncio.to_thread(attempt_of, engine, job)
            assert attempt.storage == QS
            assert attempt.receipt_id is not None

            sa_conn = engine.connect()
            sa_pid = backend_pid(sa_conn)
            sa_conn.commit()
            with HeldTransaction(engine) as held:  # rolled back if the test fails first
                held.execute(LOCK, {"job": attempt.job_id, "lease": attempt.run_lease})
                lock = await asyncio.to_thread(held_lock, engine, held.pid)

                def start_settle() -> Future[Ending]:
                    return in_thread(
                        lambda: settle_then_commit(sa_conn, attempt, case.result), "awa-sa"
                    )

                def blocked(count: int, pending: list[Future[Ending]]) -> list[Waiting]:
                    wait_until_blocked(engine, held.pid, count=count, pending=pending)
                    return waiting(engine, held.pid, sa_pid)

                if awa_sa_first:
                    settling = start_settle()
                    first = await asyncio.to_thread(blocked, 1, [settling])
                    holder_.release.set()  # the handler returns: the runtime completes
                    both = await asyncio.to_thread(blocked, 2, [settling])
                else:
                    holder_.release.set()
                    first = await asyncio.to_thread(blocked, 1, [])
                    settling = start_settle()
                    both = await asyncio.to_thread(blocked, 2, [settling])
                await within(holder_.returned, "the handler's return")
                held.commit()  # let go: the first waiter takes the lock
            outcome = await _result(settling)
            # The runtime still works after the race: a new job runs and completes.
            await client.insert(Later(n=1), queue="later")
            await within(later.returned, "the next job")
        # Shut down: the runtime's completion of the raced attempt has been written, or not.
        found = await asyncio.to_thread(ledger, engine, attempt)
        later_done = bool(
            await asyncio.to_thread(
                rows, engine, f"SELECT 1 FROM {QS}.terminal_jobs WHERE queue = 'later'"
            )
        )
        return Raced(
            attempt=attempt,
            outcome=outcome,
            first=first,
            both=both,
            held=lock,
            ledger=found,
            runs=len(holder_.runs),
            phase=await asyncio.to_thread(phase, engine),
            later_done=later_done,
        )

    return asyncio.run(run())


async def _result(fut: Future[Ending]) -> object:
    """What the settle returned, or what it raised."""
    try:
        return await asyncio.wrap_future(fut)
    except Exception as exc:
        return exc


@pytest.mark.parametrize("order", ["awa_sa_first", "runtime_first"])
@pytest.mark.parametrize("name", list(CASES))
def test_one_winner_when_awa_sa_and_the_runtime_settle_the_same_attempt(
    real_db_url: str, real_engine: sa.Engine, name: str, order: str
) -> None:
    case = CASES[name]
    awa_sa_first = order == "awa_sa_first"
    raced = race(real_db_url, real_engine, case, awa_sa_first=awa_sa_first)
    assert raced.phase == ("active", "queue_storage", {"schema": QS, "auto_finalized": True})
    attempt = raced.attempt

    # The race was real: first one contender waited on the receipt's lock, then both, each
    # on the key the side transaction holds, as the server reports it.
    assert (raced.held[0], raced.held[4]) == ("advisory", "ExclusiveLock")
    [first] = raced.first
    assert first.who == ("awa-sa" if awa_sa_first else "runtime")
    assert sorted(w.who for w in raced.both) == ["awa-sa", "runtime"]
    for w in raced.both:
        assert (w.wait_event_type, w.wait_event) == ("Lock", "advisory"), w
        assert w.lock == raced.held, w
        assert "awa.receipt.complete" in w.query, w

    # Exactly one winner, and awa-sa's outcome says which.
    ledger = raced.ledger
    if awa_sa_first:
        assert raced.outcome == case.won(attempt.job_id)
        state, closure = case.state, case.closure
    else:
        assert isinstance(raced.outcome, Stale), raced.outcome
        state, closure = "completed", "completed"
    assert [outcome for _, outcome in ledger.closures] == [closure], ledger
    assert ledger.terminal == [(attempt.run_lease, state)], ledger
    assert len(ledger.done) + ledger.compact == 1, ledger
    assert ledger.done in ([state], []), ledger
    # Counted once, whichever way the winner recorded it.
    assert ledger.counted == ledger.queue_terminal == 1, ledger
    # Neither retried nor re-claimed; the handler ran once; the runtime ran the next job.
    assert (ledger.deferred, ledger.receipts, raced.runs) == (0, 1, 1), ledger
    assert raced.later_done


# ---------------------------------------------------------------------------------- rescue

DEADLINE_MS = 1500


@dataclass
class Rescue:
    settled: RunningAttempt
    control: RunningAttempt
    outcome: object
    deadlines: dict[int, Any]
    control_closures: list[tuple[int, str]]
    control_runs: int
    settled_runs: int
    settled_returned_after_rescue: bool
    ledger: Ledger
    control_terminal: list[tuple[int, str]]
    counted: int


def rescue(url: str, engine: sa.Engine) -> Rescue:
    async def run() -> Rescue:
        s = Holder()
        c = Holder()
        c_again = asyncio.Event()

        async def control(job: Any) -> None:
            if c.runs:  # the retry after the rescue: returns at once
                c.runs.append(copy_of(job))
                c_again.set()
                return
            await c(job)

        client = awa.AsyncClient(pg_url(url))
        client.task(Race, queue="short")(s)
        client.task(Later, queue="short")(control)
        await client.start(
            [{"name": "short", "max_workers": 4, "deadline_duration_ms": DEADLINE_MS}],
            heartbeat_interval_ms=200,
            leader_election_interval_ms=100,
            deadline_rescue_interval_ms=100,
            promote_interval_ms=100,
            queue_storage_queue_rotate_interval_ms=STILL,
            queue_storage_lease_rotate_interval_ms=STILL,
            queue_storage_claim_rotate_interval_ms=STILL,
        )
        try:
            await client.insert(Race(n=1), queue="short")
            await within(s.holding, "S's claim")
            # Settled while S's handler holds, and first: it has to commit within S's
            # deadline, which a loaded machine could let pass while C was being claimed.
            settled = await asyncio.to_thread(attempt_of, engine, s.runs[0])
            outcome = await asyncio.to_thread(lambda: awa_sa.settle(engine, settled, Complete()))
            # C is enqueued after S is claimed: its claim, and so its deadline, are later.
            await client.insert(Later(n=1), queue="short", max_attempts=2)
            await within(c.holding, "C's claim")
            control_attempt = await asyncio.to_thread(attempt_of, engine, c.runs[0])
            # Hold both handlers until the leader's maintenance has rescued C.
            deadline = time.monotonic() + DEFAULT_TIMEOUT + DEADLINE_MS / 1000
            while True:
                closures = await asyncio.to_thread(
                    rows,
                    engine,
                    f"SELECT run_lease, outcome FROM {QS}.lease_claim_closures"
                    " WHERE job_id = :job ORDER BY run_lease",
                    job=control_attempt.job_id,
                )
                if any(r["outcome"] == "deadline_expired" for r in closures):
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"C was never rescued: {closures}")
                await asyncio.sleep(0.05)
            returned_early = s.returned.is_set()
            s.release.set()  # S's handler returns, past its deadline: the runtime completes it
            c.release.set()
            await within(c_again, "C's retry")
            await within(s.returned, "S's return")
        finally:
            s.release.set()
            c.release.set()
            await client.shutdown()
            await client.close()

        def read() -> tuple[dict[int, Any], list[Any], Ledger, list[Any], int]:
            deadlines = {
                r["job_id"]: r["deadline_at"]
                for r in rows(
                    engine,
                    f"SELECT job_id, deadline_at FROM {QS}.lease_claims WHERE run_lease = 1",
                )
            }
            control_closures = rows(
                engine,
                f"SELECT run_lease, outcome FROM {QS}.lease_claim_closures WHERE job_id = :job"
                " ORDER BY run_lease",
                job=control_attempt.job_id,
            ) + rows(
                engine,
                f"SELECT 0 AS run_lease, outcome FROM {QS}.lease_claim_closure_batches AS b"
                f" JOIN {QS}.lease_claims AS c ON b.receipt_ranges @> c.receipt_id"
                " WHERE c.job_id = :job",
                job=control_attempt.job_id,
            )
            control_terminal = rows(
                engine,
                f"SELECT run_lease, state::text AS state FROM {QS}.terminal_jobs"
                " WHERE job_id = :job",
                job=control_attempt.job_id,
            )
            [counted] = rows(engine, COUNTED + " AS n", queue="short")
            return (
                deadlines,
                [(r["run_lease"], r["outcome"]) for r in control_closures],
                ledger(engine, settled),
                [(r["run_lease"], r["state"]) for r in control_terminal],
                int(counted["n"]),
            )

        deadlines, control_closures, found, control_terminal, counted = await asyncio.to_thread(
            read
        )
        return Rescue(
            settled=settled,
            control=control_attempt,
            outcome=outcome,
            deadlines=deadlines,
            control_closures=control_closures,
            control_runs=len(c.runs),
            settled_runs=len(s.runs),
            settled_returned_after_rescue=not returned_early,
            ledger=found,
            control_terminal=control_terminal,
            counted=counted,
        )

    return asyncio.run(run())


def test_an_attempt_awa_sa_settled_is_not_rescued_at_its_deadline(
    real_db_url: str, real_engine: sa.Engine
) -> None:
    r = rescue(real_db_url, real_engine)
    s, c = r.settled, r.control
    assert r.outcome == Completed(s.job_id)
    # Both receipts had the short deadline, S's the earlier: the pass that rescued C ran after
    # S's deadline had passed too, and S's handler was still holding then.
    assert s.deadline_at is not None
    assert c.deadline_at is not None
    assert r.deadlines[s.job_id] == s.deadline_at < c.deadline_at == r.deadlines[c.job_id]
    assert r.settled_returned_after_rescue
    # C: rescued at its deadline, retried under a new lease, completed.
    assert (1, "deadline_expired") in r.control_closures, r.control_closures
    assert r.control_terminal == [(2, "completed")], r.control_terminal
    assert r.control_runs == 2
    # S: awa-sa's closure alone, one terminal record, never retried nor re-claimed.
    ledger = r.ledger
    assert [outcome for _, outcome in ledger.closures] == ["completed"], ledger
    assert ledger.terminal == [(s.run_lease, "completed")], ledger
    assert (ledger.deferred, ledger.receipts, r.settled_runs) == (0, 1, 1), ledger
    # The queue counts S and C once each.
    assert r.counted == ledger.queue_terminal == 2, (r.counted, ledger)
