"""Soak: a thousand and more queue-storage attempts settled by awa-sa inside real awa-pg handlers.

Three real awa-pg 0.6.9 runtimes share a cluster that the first one's start auto-finalized to
queue storage in schema ``awa``. They serve two queues, ``receipts`` (the default deadline) and
``second`` (a deadline of two minutes), each claim a ``lease_claims`` row: awa-sa refuses to
settle the compact receipt of a queue without a deadline (docs/contract.md#compact-receipts).
Every handler settles its own attempt with awa-sa, in the
handler, in a transaction of its own (``attempt_of`` then ``settle``): a third of them through
the sync API in a thread (``asyncio.to_thread``), the rest through ``awa_sa.asyncio``. Then the
handler returns, and its runtime completes an attempt awa-sa already closed.

Each job follows a plan fixed by its index (no randomness): complete (bare, or with tags and
metadata), cancel, terminal failure, a retryable failure on the final attempt, and
re-schedules that bring the job back -- Snooze and RetryAfter with short delays, a retryable
failure and RetryBackoff with Awa's own backoff -- before it completes. Once every job is
terminal and nothing is running or deferred, the runtimes are shut down and the rows read:

* nothing lost: every job has exactly one terminal record (``terminal_jobs``), in the state
  its plan ends in;
* nothing duplicated: every receipt ever claimed (each ``lease_claims`` row, and no compact
  one) is closed exactly once, with the outcome awa-sa wrote for
  that run; no deadline or heartbeat rescue closed any;
* each handler ran once per step of its plan (a re-scheduled job runs again, no other does),
  every awa-sa call answered the outcome its result implies (never ``Stale``: the attempt was
  the handler's own and still open), and each run was a claim of its own;
* the terminal count of each queue, as the runtime's exact read adds it up, equals its
  terminal rows, and the awa-pg SDK's ``queue_stats()`` agrees with the rows: completed and
  failed as the plans say, nothing queued, available, scheduled, retryable or running.

No ring rotates during the run (the rotation intervals are set past its end): a sealed slot's
prune drops its closures and terminal history, which the checks read afterwards. A second,
shorter run has every ring rotating every 250 ms, and checks what the prune leaves instead.
Timings and figures are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from runtimes import STILL, pg_url, rows
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import (
    Cancel,
    Cancelled,
    Complete,
    Completed,
    Ending,
    Fail,
    Failed,
    Rescheduled,
    Result,
    RetryAfter,
    RetryBackoff,
    Snooze,
    attempt_of,
    running_attempts,
)

pytestmark = pytest.mark.slow  # three real awa-pg runtimes, 40-70 s on 2 busy cores

QS = "awa"
SMALL = 300
"""The suite's size: every plan, queue, receipt shape and face dozens of times, in a fifth of
the proof's jobs (``AWA_SA_QS_SOAK_JOBS=1600``: 2,000 attempts or more)."""
JOBS = int(os.environ.get("AWA_SA_QS_SOAK_JOBS", str(SMALL)))
"""Jobs enqueued; their plans make about 1.31 attempts each (2,096 for 1,600)."""
ATTEMPTS = 2000 if JOBS >= 1600 else JOBS
"""At least this many attempts settled by awa-sa: 2,000 at the proof's size, else one a job."""
RUNTIMES = 3
WORKERS = 4
"""Handlers per queue per runtime."""
WAIT_SECS = 300.0
"""Upper bound for the whole run to settle: a hang fails instead of stalling the suite. The wait
ends once all is settled; 75 s was overrun by a CI run on 2 cores loaded twenty deep."""


@dataclass
class Soak:
    n: int
    plan: str


@dataclass(frozen=True)
class Plan:
    steps: tuple[str, ...]
    """The result of each run, in order."""
    share: int
    """Jobs of the plan per 100."""
    tagged: bool = False
    max_attempts: int = 25

    @property
    def ends(self) -> str:
        last = self.steps[-1]
        return {"complete": "completed", "cancel": "cancelled"}.get(last, "failed")


PLANS = {
    "complete": Plan(("complete",), 44),
    "complete_tagged": Plan(("complete",), 14, tagged=True),
    "cancel": Plan(("cancel",), 8),
    "fail_terminal": Plan(("fail_terminal",), 8, tagged=True),
    "fail_final": Plan(("fail",), 3, max_attempts=1),
    "snooze": Plan(("snooze", "snooze", "complete"), 8),
    "retry_after": Plan(("retry_after", "complete"), 7, tagged=True),
    "fail_then_complete": Plan(("fail", "complete"), 4),
    "backoff": Plan(("backoff", "complete"), 4),
}
assert sum(p.share for p in PLANS.values()) == 100

RESULTS: dict[str, Result] = {
    "complete": Complete(),
    "cancel": Cancel("soak"),
    "fail_terminal": Fail("soak: terminal", terminal=True),
    "fail": Fail("soak: transient"),
    "snooze": Snooze(0.2),
    "retry_after": RetryAfter(0.3),
    "backoff": RetryBackoff(),
}

CLOSED_AS = {
    "complete": "completed",
    "cancel": "cancelled",
    "fail_terminal": "failed",
    "snooze": "scheduled",
    "retry_after": "retryable",
    "backoff": "retryable",
}


def closed_as(plan: Plan, step: int) -> str:
    """The closure outcome of run *step*: a retryable failure is ``failed`` on the final one."""
    name = plan.steps[step]
    if name == "fail":
        return "failed" if plan.max_attempts == 1 else "retryable"
    return CLOSED_AS[name]


def outcome_fits(plan: Plan, step: int, outcome: object, job_id: int) -> bool:
    name = plan.steps[step]
    expected: dict[str, object] = {
        "complete": Completed(job_id),
        "cancel": Cancelled(job_id),
        "fail_terminal": Failed(job_id, terminal=True),
    }
    if name in expected:
        return outcome == expected[name]
    if name == "fail" and plan.max_attempts == 1:
        return outcome == Failed(job_id, terminal=False)
    return isinstance(outcome, Rescheduled) and outcome.job_id == job_id


def plan_problems(jobs: dict[int, tuple[str, str]], runs: dict[int, list[Run]]) -> list[str]:
    """What went against each job's plan: a job that did not run once per step, or a run that
    awa-sa did not settle as its step's result implies."""
    problems: list[str] = []
    for job_id, (name, _) in jobs.items():
        plan = PLANS[name]
        mine = runs.get(job_id, [])
        if len(mine) != len(plan.steps):
            problems.append(f"job {job_id} ({name}) ran {len(mine)} times")
            continue
        problems += [
            f"job {job_id} ({name}) run {run.step}: {run.outcome!r}"
            for run in mine
            if not outcome_fits(plan, run.step, run.outcome, job_id)
        ]
    return problems


QUEUES = [
    {"name": "receipts", "max_workers": WORKERS},
    {"name": "second", "max_workers": WORKERS, "deadline_duration_ms": 120_000},
]
"""The two queues, each with a deadline (so ``lease_claims`` receipts): the default, and two
minutes."""


def plan_of(i: int) -> str:
    """The plan of job *i*: by its place in each hundred, so every run has the same mix."""
    k = i % 100
    for name, plan in PLANS.items():
        if k < plan.share:
            return name
        k -= plan.share
    raise AssertionError(i)


def queue_of(i: int) -> str:
    return "second" if i % 3 == 2 else "receipts"


@dataclass
class Run:
    job_id: int
    attempt: int
    step: int
    runtime: int
    form: str
    outcome: object
    run_lease: int | None
    receipt_id: int | None
    t0: float = 0.0
    t1: float = 0.0


class Handlers:
    """The handler of every runtime: look the attempt up, settle it with awa-sa, return."""

    def __init__(self, engine: sa.Engine, async_engine: AsyncEngine) -> None:
        self.engine = engine
        self.async_engine = async_engine
        self.runs: dict[int, list[Run]] = defaultdict(list)
        self.calls = 0

    def for_runtime(self, runtime: int) -> Any:
        async def handle(job: Any) -> None:
            await self.handle(runtime, job)

        return handle

    async def handle(self, runtime: int, job: Any) -> None:
        self.calls += 1
        plan = PLANS[job.args.plan]
        step = len(self.runs[job.id])
        seen = SimpleNamespace(
            id=job.id,
            attempt=job.attempt,
            kind=job.kind,
            queue=job.queue,
            created_at=job.created_at,
        )
        run = Run(job.id, job.attempt, step, runtime, "", None, None, None)
        self.runs[job.id].append(run)  # before any await: a second run would see this one
        if step >= len(plan.steps):
            run.outcome = AssertionError(f"run {step + 1} of a plan of {len(plan.steps)}")
            return
        result = RESULTS[plan.steps[step]]
        run.form = "sync" if job.id % 3 == 0 else "async"
        run.t0 = time.monotonic()
        try:
            if run.form == "sync":
                found, run.outcome = await asyncio.to_thread(self.sync_settle, seen, result)
            else:
                found, run.outcome = await self.async_settle(seen, result)
            run.run_lease, run.receipt_id = found.run_lease, found.receipt_id
        except Exception as exc:
            run.outcome = exc
        run.t1 = time.monotonic()

    def sync_settle(self, job: Any, result: Result) -> tuple[Any, Ending]:
        with self.engine.begin() as conn:
            found = attempt_of(conn, job)
            return found, awa_sa.settle(conn, found, result)

    async def async_settle(self, job: Any, result: Result) -> tuple[Any, Ending]:
        async with self.async_engine.begin() as conn:
            found = await conn.run_sync(attempt_of, job)
            return found, await awa_async.settle(conn, found, result)


SETTLED = f"""
    SELECT (SELECT count(*) FROM {QS}.terminal_jobs) AS terminal,
           (SELECT count(*) FROM {QS}.deferred_jobs) AS deferred,
           (SELECT count(*) FROM {QS}.ready_entries AS r
            JOIN {QS}.queue_claim_heads AS h USING (queue, priority, enqueue_shard)
            WHERE r.lane_seq >= {QS}.sequence_next_value(h.seq_name)) AS available
"""


def quiet(engine: sa.Engine) -> bool:
    """Every job terminal, nothing deferred or claimable, and no receipt open (listed only
    once the rest holds: the poll stays cheap beside the runtimes)."""
    [row] = rows(engine, SETTLED)
    if (row["terminal"], row["deferred"], row["available"]) != (JOBS, 0, 0):
        return False
    return not running_attempts(engine)


RECEIPTS = f"""
    WITH receipts AS (
        SELECT 'row' AS shape, claim_slot, job_id, run_lease, receipt_id, queue, closed_at
        FROM {QS}.lease_claims
        UNION ALL
        SELECT 'batch', b.claim_slot, i.job_id, i.run_lease, i.receipt_id, b.queue, NULL
        FROM {QS}.lease_claim_batches AS b,
             unnest(b.job_ids, b.run_leases, b.receipt_ids) AS i(job_id, run_lease, receipt_id)
    )
    SELECT r.shape, r.job_id, r.run_lease, r.receipt_id, r.queue, r.closed_at IS NOT NULL AS marked,
        ARRAY(
            SELECT 'row:' || c.outcome FROM {QS}.lease_claim_closures AS c
            WHERE c.claim_slot = r.claim_slot AND c.job_id = r.job_id
              AND c.run_lease = r.run_lease
            UNION ALL
            SELECT 'batch:' || b.outcome FROM {QS}.lease_claim_closure_batches AS b
            WHERE b.claim_slot = r.claim_slot AND b.receipt_ranges @> r.receipt_id
        ) AS closures
    FROM receipts AS r
"""
"""Every receipt ever claimed, with every piece of closure evidence that names it."""

CLOSURES = f"""
    SELECT (SELECT count(*) FROM {QS}.lease_claim_closures) AS rows,
           (SELECT coalesce(sum(closed_count), 0) FROM {QS}.lease_claim_closure_batches)
               AS batched
"""

COUNTED = f"""
    SELECT q.queue,
           COALESCE((SELECT sum(live_terminal_count) FROM {QS}.queue_terminal_live_counts AS c
                     WHERE c.queue = q.queue), 0)
         + COALESCE((SELECT sum(terminal_delta) FROM {QS}.queue_terminal_count_deltas AS d
                     WHERE d.queue = q.queue), 0)
         + COALESCE((SELECT sum(completed_count) FROM {QS}.receipt_completion_batches AS b
                     WHERE b.queue = q.queue), 0)
         - (SELECT count(*) FROM {QS}.receipt_completion_tombstones AS t
            WHERE t.queue = q.queue) AS counted,
           (SELECT count(*) FROM {QS}.terminal_jobs AS j WHERE j.queue = q.queue) AS rows
    FROM (VALUES ('receipts'), ('second')) AS q(queue)
"""
"""Each queue's terminal count as the runtime's exact read adds it up, beside its rows."""


@dataclass
class Soaked:
    jobs: dict[int, tuple[str, str]]
    """job id -> (plan, queue)."""
    runs: dict[int, list[Run]]
    calls: int
    phase: dict[str, Any]
    terminal: list[dict[str, Any]]
    receipts: list[dict[str, Any]]
    closures: dict[str, Any]
    counted: list[dict[str, Any]]
    stats: dict[str, Any]
    left: dict[str, Any]
    seconds: dict[str, float]


def soak(url: str, engine: sa.Engine) -> Soaked:
    async def run() -> Soaked:
        t0 = time.monotonic()
        async_engine = create_async_engine(url, pool_size=20, max_overflow=10)
        handlers = Handlers(engine, async_engine)
        clients = []
        for r in range(RUNTIMES):
            client = awa.AsyncClient(pg_url(url))
            # One kind on both queues: the runtime dispatches by kind whatever the queue.
            client.task(Soak, queue="receipts")(handlers.for_runtime(r))
            clients.append(client)
        jobs: dict[int, tuple[str, str]] = {}
        started: list[awa.AsyncClient] = []
        seconds: dict[str, float] = {}
        try:
            for client in clients:
                await client.start(
                    QUEUES,
                    promote_interval_ms=100,
                    queue_storage_queue_rotate_interval_ms=STILL,
                    queue_storage_lease_rotate_interval_ms=STILL,
                    queue_storage_claim_rotate_interval_ms=STILL,
                )
                started.append(client)
            # Enqueued once the runtimes run (the first one's start auto-finalized the
            # cluster), in groups of one plan and queue, a batch each.
            groups: dict[tuple[str, str], list[int]] = defaultdict(list)
            for i in range(JOBS):
                groups[(plan_of(i), queue_of(i))].append(i)
            for (name, queue), members in sorted(groups.items()):
                plan = PLANS[name]
                inserted = await clients[len(jobs) % RUNTIMES].insert_many_copy(
                    [Soak(n=i, plan=name) for i in members],
                    queue=queue,
                    max_attempts=plan.max_attempts,
                    tags=["soak", name] if plan.tagged else None,
                    metadata={"plan": name} if plan.tagged else None,
                )
                jobs.update({job.id: (name, queue) for job in inserted})
            seconds["enqueued"] = time.monotonic() - t0
            deadline = time.monotonic() + WAIT_SECS
            while not await asyncio.to_thread(quiet, engine):
                if time.monotonic() > deadline:
                    pytest.fail(f"not settled in {WAIT_SECS}s: {rows(engine, SETTLED)}")
                await asyncio.sleep(0.5)
            seconds["settled"] = time.monotonic() - t0
            stats = {s.queue: s for s in await clients[0].queue_stats()}
        finally:
            for client in started:
                await client.shutdown()
            for client in clients:
                await client.close()
            await async_engine.dispose()
        seconds["shut down"] = time.monotonic() - t0

        def read() -> dict[str, Any]:
            [phase] = rows(
                engine, "SELECT state, current_engine, details FROM awa.storage_transition_state"
            )
            [left] = rows(
                engine,
                f"SELECT (SELECT count(*) FROM {QS}.deferred_jobs) AS deferred,"
                f" (SELECT count(*) FROM {QS}.leases) AS leases,"
                f" (SELECT count(*) FROM {QS}.dlq_entries) AS dlq",
            )
            [closures] = rows(engine, CLOSURES)
            return {
                "phase": phase,
                "left": left,
                "closures": closures,
                "terminal": rows(
                    engine,
                    f"SELECT job_id, run_lease, state::text AS state, queue"
                    f" FROM {QS}.terminal_jobs",
                ),
                "receipts": rows(engine, RECEIPTS),
                "counted": rows(engine, COUNTED),
            }

        read_back = await asyncio.to_thread(read)
        return Soaked(
            jobs=jobs,
            runs=dict(handlers.runs),
            calls=handlers.calls,
            stats={
                q: {
                    k: getattr(s, k)
                    for k in (
                        "total_queued",
                        "scheduled",
                        "available",
                        "retryable",
                        "running",
                        "failed",
                        "waiting_external",
                        "completed_last_hour",
                    )
                }
                for q, s in stats.items()
            },
            seconds=seconds,
            **read_back,
        )

    return asyncio.run(run())


def test_queue_storage_attempts_settled_by_awa_sa_beside_three_runtimes(
    real_db_url: str, real_engine: sa.Engine
) -> None:
    soaked = soak(real_db_url, real_engine)
    jobs, runs = soaked.jobs, soaked.runs
    print("\n  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in soaked.seconds.items()))
    assert soaked.phase["state"] == "active"
    assert soaked.phase["details"] == {"schema": QS, "auto_finalized": True}
    assert len(jobs) == JOBS

    # Every handler run: the step its plan says, settled by awa-sa as the result implies.
    problems = plan_problems(jobs, runs)
    assert not problems, "\n".join(problems[:30])
    assert set(runs) == set(jobs)
    all_runs = [run for mine in runs.values() for run in mine]
    assert soaked.calls == len(all_runs) == sum(len(PLANS[n].steps) for n, _ in jobs.values())
    assert len(all_runs) >= ATTEMPTS

    # Nothing lost, nothing duplicated: one terminal record per job, in its plan's state.
    terminal = Counter(row["job_id"] for row in soaked.terminal)
    assert set(terminal) == set(jobs)
    assert max(terminal.values()) == 1
    for row in soaked.terminal:
        name, queue = jobs[row["job_id"]]
        assert (row["state"], row["queue"]) == (PLANS[name].ends, queue), row
        assert row["run_lease"] == runs[row["job_id"]][-1].run_lease, row
    assert soaked.left == {"deferred": 0, "leases": 0, "dlq": 0}

    # Every receipt ever claimed was claimed by one run and closed exactly once, as awa-sa
    # closed it; no receipt was closed without a claim, none rescued.
    by_receipt = {(r["job_id"], r["run_lease"]): r for r in soaked.receipts}
    assert len(by_receipt) == len(soaked.receipts) == len(all_runs)
    for run in all_runs:
        receipt = by_receipt[(run.job_id, run.run_lease)]
        name, queue = jobs[run.job_id]
        assert receipt["receipt_id"] == run.receipt_id
        assert receipt["queue"] == queue
        assert receipt["shape"] == "row", receipt
        [closure] = receipt["closures"]
        assert closure.split(":")[1] == closed_as(PLANS[name], run.step), (receipt, run)
        if receipt["shape"] == "row" and closure.startswith("row:"):
            assert receipt["marked"], receipt  # closed_at set beside its closure row
    closures = soaked.closures
    assert closures["rows"] + closures["batched"] == len(all_runs), closures

    # The terminal counts, and the SDK's statistics, agree with the rows.
    ends = Counter((queue, PLANS[name].ends) for name, queue in jobs.values())
    for row in soaked.counted:
        assert (
            row["counted"]
            == row["rows"]
            == sum(n for (queue, _), n in ends.items() if queue == row["queue"])
        ), row
    for queue in ("receipts", "second"):
        assert soaked.stats[queue] == {
            "total_queued": 0,
            "scheduled": 0,
            "available": 0,
            "retryable": 0,
            "running": 0,
            "failed": ends[(queue, "failed")],
            "waiting_external": 0,
            "completed_last_hour": ends[(queue, "completed")],
        }, queue

    forms = Counter(run.form for run in all_runs)
    by_runtime = Counter(run.runtime for run in all_runs)
    assert set(by_runtime) == set(range(RUNTIMES)), by_runtime  # all three ran handlers
    print()
    print(
        f"queue-storage soak: {len(jobs)} jobs, {len(all_runs)} attempts settled by awa-sa "
        f"({dict(forms)}) beside {RUNTIMES} runtimes (attempts each: {dict(by_runtime)})"
    )
    print(f"  plans: {dict(Counter(name for name, _ in jobs.values()))}")
    print(f"  ends: {dict(ends)}")
    took = sorted(run.t1 - run.t0 for run in all_runs)
    print(
        f"  lookup and settle in the handler: median {took[len(took) // 2] * 1000:.0f} ms, "
        f"p90 {took[len(took) * 9 // 10] * 1000:.0f} ms"
    )


PRUNED = f"""
    SELECT (SELECT count(*) FROM {QS}.terminal_jobs) AS terminal,
           (SELECT count(*) FROM {QS}.lease_claims)
         + (SELECT count(*) FROM {QS}.lease_claim_closures)
         + (SELECT count(*) FROM {QS}.lease_claim_batches)
         + (SELECT count(*) FROM {QS}.lease_claim_closure_batches)
         + (SELECT count(*) FROM {QS}.attempt_state) AS claims
"""
"""What the prune leaves: terminal rows, and the claim ring's receipts and closures."""

ROTATE_MS = 250
"""Each ring's rotation interval (ms) in the rotating run: a ring of 16 slots turns in 4 s."""
ROTATING_JOBS = 100
"""One hundred: every plan, each on both queues (plans go by the place in each hundred), and
what the prune keeps (the failed rows) on both; more jobs only cost CI's CPU (issue 39)."""


def test_rings_rotate_and_prune_around_attempts_awa_sa_settled(
    real_db_url: str, real_engine: sa.Engine
) -> None:
    """The runtime's maintenance beside awa-sa's settles: with every ring rotating, the leader
    seals and prunes the slots that hold awa-sa's closures and terminal rows. Each job still
    runs once per step of its plan, nothing is left open or claimable, the claim ring's receipts
    and closures and the completed and cancelled history are pruned with their slots (the
    failed rows stay: the prune leaves them),
    and the terminal count the runtime keeps for each queue is still its rows' after the prune."""

    async def run() -> tuple[Handlers, dict[int, tuple[str, str]], dict[str, Any], int]:
        async_engine = create_async_engine(real_db_url, pool_size=10, max_overflow=10)
        handlers = Handlers(real_engine, async_engine)
        client = awa.AsyncClient(pg_url(real_db_url))
        client.task(Soak, queue="receipts")(handlers.for_runtime(0))
        jobs: dict[int, tuple[str, str]] = {}
        await client.start(
            QUEUES,
            promote_interval_ms=100,
            queue_storage_queue_rotate_interval_ms=ROTATE_MS,
            queue_storage_lease_rotate_interval_ms=ROTATE_MS,
            queue_storage_claim_rotate_interval_ms=ROTATE_MS,
        )
        try:
            for i in range(ROTATING_JOBS):
                name, queue = plan_of(i), queue_of(i)
                plan = PLANS[name]
                job = await client.insert(
                    Soak(n=i, plan=name),
                    queue=queue,
                    max_attempts=plan.max_attempts,
                    tags=["soak", name] if plan.tagged else None,
                )
                jobs[job.id] = (name, queue)
            deadline = time.monotonic() + WAIT_SECS
            while not await asyncio.to_thread(_ran_every_step, real_engine, handlers, jobs):
                if time.monotonic() > deadline:
                    pytest.fail(f"not settled in {WAIT_SECS}s: {rows(real_engine, SETTLED)}")
                await asyncio.sleep(0.5)
            # Pruned with their slots: the completed and cancelled history (the failed rows
            # stay, as the prune leaves them); the terminal count must not change.
            failed = sum(1 for name, _ in jobs.values() if PLANS[name].ends == "failed")
            left = ROTATING_JOBS
            # The prune's own bound: on a loaded machine settling may take most of the first.
            deadline = time.monotonic() + WAIT_SECS
            while time.monotonic() < deadline:
                [row] = rows(real_engine, PRUNED)
                left = row["terminal"]
                if left == failed and row["claims"] == 0:
                    break
                await asyncio.sleep(0.5)
            pruned = ROTATING_JOBS - left
            stats = {s.queue: s for s in await client.queue_stats()}
            health = await client.health_check()
            assert health.healthy
        finally:
            await client.shutdown()
            await client.close()
            await async_engine.dispose()
        return handlers, jobs, stats, pruned

    handlers, jobs, stats, pruned = asyncio.run(run())
    problems = plan_problems(jobs, handlers.runs)
    assert not problems, "\n".join(problems[:30])
    ends = Counter((queue, PLANS[name].ends) for name, queue in jobs.values())
    kept = sum(n for (_, end), n in ends.items() if end == "failed")
    assert pruned == ROTATING_JOBS - kept, f"{pruned} of {ROTATING_JOBS} terminal rows pruned"
    assert rows(
        real_engine, f"SELECT count(*) AS n FROM {QS}.terminal_jobs WHERE state <> 'failed'"
    ) == [{"n": 0}]
    # The claim ring is pruned too: every receipt and every closure awa-sa wrote, gone.
    assert rows(real_engine, PRUNED)[0]["claims"] == 0
    assert rows(real_engine, f"SELECT count(*) AS n FROM {QS}.deferred_jobs") == [{"n": 0}]
    assert running_attempts(real_engine) == []
    for row in rows(real_engine, COUNTED):  # the count follows the rows the prune left
        kept_here = ends[(row["queue"], "failed")]
        assert row["counted"] == row["rows"] == kept_here, row
    for queue in ("receipts", "second"):
        s = stats[queue]
        assert (s.total_queued, s.available, s.running, s.retryable) == (0, 0, 0, 0), s
        assert s.failed == ends[(queue, "failed")], s


def _ran_every_step(
    engine: sa.Engine, handlers: Handlers, jobs: dict[int, tuple[str, str]]
) -> bool:
    """Every job has run each step of its plan, and nothing is deferred or open."""
    if any(len(handlers.runs.get(j, [])) < len(PLANS[n].steps) for j, (n, _) in jobs.items()):
        return False
    [row] = rows(engine, SETTLED)
    return (row["deferred"], row["available"]) == (0, 0) and not running_attempts(engine)
