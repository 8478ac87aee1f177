"""``settle`` of a running attempt whose handler registered a callback, against the real runtime.

Twin clusters built by ``awa migrate`` (:func:`administering.twin`: the maintenance leadership
held, so nothing promotes or rescues behind a comparison), on each plane: ``active`` (the
worker starts first and auto-finalizes the cluster to queue storage in ``awa``, where
``register_callback`` materialises the attempt's receipt into a running ``leases`` row),
``mixed_transition`` (the real CLI flips the cluster to queue storage in ``awa_qs``; a
``queue_storage_target`` worker, warmed up by one job as :mod:`callback_waits` says) and
``canonical`` (the jobs enqueued before the worker starts: a running ``awa.jobs_hot`` row with
its callback columns set). On each twin a real awa-pg 0.6.9 worker runs the same jobs, one per
result; each handler registers a callback and does not park. On the first twin it returns the
result (return None, ``Cancel``, raise ``TerminalError``, raise with attempts left and on the
final attempt, ``RetryAfter``, ``Snooze``), and the runtime ends the attempt; on the second it
settles the job by awa-sa in a transaction that also commits a business row, then returns
None, and the runtime's completion finds the attempt settled. Every row of every table of
schema ``awa`` and every sequence changed alike, clocks and callback ids masked.

Then on one active cluster, beside a live handler that registered a callback and holds its
attempt: a rolled back settle leaves every row as it was; and awa-pg's ``complete_external`` of
the handler's callback raced with awa-sa's settle in both orders (held locks), and so are the
runtime's own statements that delete a lease (its heartbeat rescue of a running one, its
callback-timeout rescue of a parked one): the job ends once, the loser writes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import Twin, business, change, differing, pg_call, snapshot, twin
from callback_waits import flip, until_claimed
from racing import held, in_thread, wait_until_blocked
from rescues import CALLBACK_TIMEOUT_RESCUE, LEASE_HEARTBEAT_RESCUE, statement
from runtimes import STILL_RINGS, pg_url, rows, until_idle

import awa_sa
from awa_sa.settle.statements.receipt_settles import receipt_lock_key
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

SCHEMAS = ("awa",)
PLANE_SCHEMAS = {"active": ("awa",), "mixed_transition": ("awa", "awa_qs"), "canonical": ("awa",)}
ROUTED = {"active": "awa", "mixed_transition": "awa_qs", "canonical": None}
QUEUE = "mq"
DELAY = 3600
REASON = "cancelled by handler"
PROGRESS = {"percent": 40, "message": "flushed"}
OUTCOMES: dict[str, dict[str, Any]] = {
    # Each result is a kind of its own, with the insert options of its job.
    "complete": {"unique_opts": {"by_args": True}, "tags": ["t"]},
    "cancel": {"unique_opts": {"by_args": True}, "metadata": {"m": 1}},
    "terminal": {"progress": True},
    "retry": {"progress": True, "tags": ["r"]},
    "final": {"max_attempts": 1},
    "retry_after": {"unique_opts": {"by_args": True}},
    "snooze": {"progress": True},
}
RESULTS: dict[str, awa_sa.Result] = {
    "complete": awa_sa.Complete(),
    "cancel": awa_sa.Cancel(REASON),
    "retry_after": awa_sa.RetryAfter(DELAY),
    "snooze": awa_sa.Snooze(DELAY),
}
ENDED: dict[str, type] = {
    "complete": awa_sa.Completed,
    "cancel": awa_sa.Cancelled,
    "terminal": awa_sa.Failed,
    "retry": awa_sa.Rescheduled,
    "final": awa_sa.Failed,
    "retry_after": awa_sa.Rescheduled,
    "snooze": awa_sa.Rescheduled,
}


class Transient(Exception):
    """A plain exception: retried, or the job failed on its final attempt."""


def answer(kind: str) -> Any:
    """The handler's own result: one function on both twins, so that both tracebacks (the
    runtime's error entry, awa-sa's ``Fail.of``) have the same frames."""
    if kind == "cancel":
        return awa.Cancel(REASON)
    if kind == "terminal":
        raise awa.TerminalError("terminal (handler)")
    if kind in ("retry", "final"):
        raise Transient("transient (handler)")
    if kind == "retry_after":
        return awa.RetryAfter(DELAY)
    if kind == "snooze":
        return awa.Snooze(DELAY)
    return None


def settled_with_row(
    engine: sa.Engine, job: Any, result: awa_sa.Result, progress: Any = None
) -> awa_sa.Ending:
    """The handler's transaction: its business row and the job's end, together."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('settled')"))
        return awa_sa.settle(conn, job, result, progress=progress)


async def _ran(side: Twin, plane: str, by_awa_sa: bool) -> dict[str, Any]:
    """Every outcome's job run by a real worker on *side*: the change, awa-sa's answers."""
    client = awa.AsyncClient(pg_url(side.url))
    entered: list[str] = []
    answers: dict[str, Any] = {}

    async def handle(job: Any) -> Any:
        progress = PROGRESS if job.args.get("progress") else None
        if progress is not None:
            job.set_progress(progress["percent"], progress["message"])
            await job.flush_progress()
        await job.register_callback(timeout_seconds=3600)
        entered.append(job.kind)
        try:
            reply = answer(job.kind)
        except Exception as exc:
            if not by_awa_sa:
                raise
            result: awa_sa.Result = awa_sa.Fail.of(exc, terminal=isinstance(exc, awa.TerminalError))
        else:
            if not by_awa_sa:
                return reply
            result = RESULTS[job.kind]
        # The handler's progress, as the runtime's ending writes its own (on canonical the
        # caller's progress is the one written; on queue storage the flushed one is kept).
        answers[job.kind] = await asyncio.to_thread(
            settled_with_row, side.engine, job, result, progress
        )
        return None

    async def warm(job: Any) -> None:
        """The first claim of a ``queue_storage_target`` runtime cannot register a callback."""

    for kind in OUTCOMES:
        client.task(dict, kind=kind, queue=QUEUE)(handle)
    client.task(dict, kind="warm", queue=QUEUE)(warm)
    start: dict[str, Any] = {"promote_interval_ms": 600_000, "heartbeat_interval_ms": 600_000}
    start |= STILL_RINGS
    schemas = PLANE_SCHEMAS[plane]
    if plane == "mixed_transition":
        start |= {
            "queue_storage_schema": "awa_qs",
            "storage_transition_role": "queue_storage_target",
        }

    async def insert(kind: str) -> None:
        options = dict(OUTCOMES[kind])
        progress = options.pop("progress", False)
        await client.insert({"k": kind, "progress": progress}, kind=kind, queue=QUEUE, **options)

    running = {
        "active": "SELECT count(*) AS n FROM awa.leases",
        "mixed_transition": "SELECT count(*) AS n FROM awa_qs.leases",
        "canonical": "SELECT count(*) AS n FROM awa.jobs_hot WHERE state = 'running'",
    }[plane]

    async def until_ended() -> None:
        """Until no attempt runs: the runtime's ending lands after its in-flight count drops
        (its pace, so polled; seen late on a loaded machine)."""
        for _ in range(1200):
            if (await asyncio.to_thread(rows, side.engine, running)) == [{"n": 0}]:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("an attempt was still running after 60 s")

    async def until_entered(count: int) -> None:
        for _ in range(1200):
            if len(entered) >= count:
                return
            await asyncio.sleep(0.05)  # the worker's own pace
        raise AssertionError(f"{count} handlers did not run within 60 s")

    if plane == "mixed_transition":  # the warm-up claim first, outside the comparison
        await client.insert({"w": 0}, kind="warm", queue=QUEUE)
        await client.start([{"name": QUEUE, "max_workers": 1}], **start)
        await until_claimed(side.engine, "awa_qs")
        await until_idle(client)
    before = await asyncio.to_thread(snapshot, side.engine, schemas)
    paid = await asyncio.to_thread(business, side.engine)
    try:
        if plane == "canonical":  # enqueued first: the worker does not finalize the cluster
            for kind in OUTCOMES:
                await insert(kind)
            await client.start([{"name": QUEUE, "max_workers": 1}], **start)
            await until_entered(len(OUTCOMES))
            await until_idle(client)
            await until_ended()
        else:
            if plane == "active":
                await client.start([{"name": QUEUE, "max_workers": 1}], **start)
            for n, kind in enumerate(OUTCOMES, start=1):
                await insert(kind)
                await until_entered(n)
                await until_idle(client)
                await until_ended()
    finally:
        await client.shutdown()
        await client.close()
    after = await asyncio.to_thread(snapshot, side.engine, schemas)
    routed = await asyncio.to_thread(
        rows, side.engine, "SELECT awa.active_queue_storage_schema() AS s"
    )
    paid_now = await asyncio.to_thread(business, side.engine)
    return {
        "change": change(before, after),
        "answers": answers,
        "entered": entered,
        "routing": routed[0]["s"],
        "paid": paid_now - paid,
    }


@pytest.mark.parametrize("plane", ["active", "mixed_transition", "canonical"])
def test_a_callback_registered_attempt_settles_as_the_runtime_ends_it(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str, plane: str
) -> None:
    with ExitStack() as stack:
        sides = [twin(stack, pg, awa_databases, real_template) for _ in range(2)]
        if plane == "mixed_transition":
            for side in sides:
                flip(pg, side.url)
        runtime = asyncio.run(_ran(sides[0], plane, by_awa_sa=False))
        by_awa_sa = asyncio.run(_ran(sides[1], plane, by_awa_sa=True))
    assert runtime["routing"] == by_awa_sa["routing"] == ROUTED[plane]
    assert runtime["entered"] == by_awa_sa["entered"] == list(OUTCOMES)
    assert runtime["paid"] == 0
    assert by_awa_sa["paid"] == len(OUTCOMES)
    assert {k: type(v) for k, v in by_awa_sa["answers"].items()} == ENDED
    assert by_awa_sa["change"] == runtime["change"], differing(
        by_awa_sa["change"], runtime["change"]
    )
    written = by_awa_sa["change"]
    if plane != "canonical":
        qs = ROUTED[plane]
        # Every lease register_callback made, and its attempt_state row, is gone again.
        assert f"{qs}.leases" not in written
        assert f"{qs}.attempt_state" not in written
        materialised = [row for row in written[f"{qs}.lease_claims"][1] if ",CLOCK,CLOCK)" in row]
        assert len(materialised) == len(OUTCOMES)  # materialized_at and closed_at set
        closures = written[f"{qs}.lease_claim_closures"][1]
        assert sum(",completed," in row for row in closures) == 1
        assert sum(",rescue," in row for row in closures) == len(OUTCOMES) - 1
        assert f"{qs}.receipt_completion_batches" not in written
    else:
        ended = written["awa.jobs_hot"][1] + written["awa.scheduled_jobs"][1]
        assert len(ended) == len(OUTCOMES)
        assert all(",UUID," in row for row in ended)  # the callback columns kept, as awa-pg


# ------------------------------------------------------------------------------------------
# Beside a live handler: a rollback, and complete_external raced


class Live:
    """A worker whose handler registers a callback and holds its attempt until released."""

    def __init__(self, side: Twin) -> None:
        self.side = side
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.job: Any = None
        self.callback = ""

    async def run(self, act: Callable[[Live], Any]) -> Any:
        client = awa.AsyncClient(pg_url(self.side.url))

        async def holds(job: Any) -> None:
            await job.register_callback(timeout_seconds=3600)
            self.job = job
            self.callback = await asyncio.to_thread(_callback_of, self.side.engine, job.id)
            self.holding.set()
            await self.release.wait()

        client.task(dict, kind="holds", queue=QUEUE)(holds)
        start: dict[str, Any] = {"promote_interval_ms": 600_000, "heartbeat_interval_ms": 600_000}
        await client.start([{"name": QUEUE, "max_workers": 1}], **start | STILL_RINGS)
        try:
            await client.insert({"h": 1}, kind="holds", queue=QUEUE)
            await asyncio.wait_for(self.holding.wait(), 60)
            got = await asyncio.to_thread(act, self)
            self.release.set()
            await until_idle(client)
            return got
        finally:
            self.release.set()
            await client.shutdown()
            await client.close()


def _callback_of(engine: sa.Engine, job_id: int) -> str:
    sql = "SELECT callback_id::text AS c FROM awa.leases WHERE job_id = :i"
    (found,) = rows(engine, sql, i=job_id)
    return str(found["c"])


def _terminal(engine: sa.Engine, job_id: int) -> list[str]:
    found = rows(
        engine, "SELECT state::text AS s FROM awa.done_entries WHERE job_id = :i", i=job_id
    )
    return [row["s"] for row in found]


@pytest.fixture(scope="module")
def live_side(pg: EmbeddedPostgres, awa_databases: Databases, real_template: str) -> Iterator[Twin]:
    with ExitStack() as stack:
        yield twin(stack, pg, awa_databases, real_template)


def test_a_rolled_back_settle_leaves_the_running_lease_as_it_was(live_side: Twin) -> None:
    """``attempt_of`` and ``running_attempts`` find the attempt; a settle of it, or of the job,
    rolled back leaves every row as it was; released, the handler returns and the runtime
    completes the attempt itself."""

    def act(live: Live) -> Any:
        engine = live.side.engine
        job_id = live.job.id
        lease = rows(engine, "SELECT state::text AS s FROM awa.leases WHERE job_id = :i", i=job_id)
        assert lease == [{"s": "running"}]
        # Listed and found as the running attempt it is, under its lease_claims receipt.
        found = awa_sa.attempt_of(engine, live.job)
        assert (found.storage, found.job_id, found.run_lease) == ("awa", job_id, 1)
        assert found.claim_slot is not None
        assert found.claim_batch_id is None

        def receipt(a: awa_sa.RunningAttempt) -> tuple[Any, ...]:
            return (a.storage, a.job_id, a.run_lease, a.claim_slot, a.receipt_id)

        listed = awa_sa.running_attempts(engine, job_id=job_id)
        assert [receipt(a) for a in listed] == [receipt(found)]
        before = snapshot(engine, SCHEMAS)
        for named in (found, live.job):  # the attempt read, and the job itself
            with engine.connect() as conn, conn.begin() as tx:
                conn.execute(sa.text("INSERT INTO public.business VALUES ('rolled back')"))
                assert awa_sa.settle(conn, named, awa_sa.Complete()) == awa_sa.Completed(job_id)
                tx.rollback()
        assert snapshot(engine, SCHEMAS) == before
        return live.job.id

    job_id = asyncio.run(Live(live_side).run(act))
    # Released, the handler returned None: the runtime completed its attempt itself.
    assert _terminal(live_side.engine, job_id) == ["completed"]
    assert business(live_side.engine) == 0


def test_complete_external_raced_with_the_settle_ends_the_job_once(live_side: Twin) -> None:
    """awa-sa first: its settle, uncommitted, holds the deleted lease, so awa-pg's
    ``complete_external`` waits on it, then finds no callback. awa-pg first: a side session
    holds the receipt's advisory lock, ``complete_external`` takes the lease and queues on that
    lock, the settle queues behind it; released, the completion commits and the settle,
    reading after it, is Stale (a handler then raises, rolling its rows back)."""
    url, engine = live_side.url, live_side.engine

    def settle_first(live: Live) -> int:
        callback = live.callback
        with held(engine) as tx:
            tx.execute("INSERT INTO public.business VALUES ('settle first')")
            outcome = awa_sa.settle(tx.conn, live.job, awa_sa.Fail("no", terminal=True))
            assert outcome == awa_sa.Failed(live.job.id, terminal=True)
            completing = in_thread(lambda: pg_call(url, lambda c: c.complete_external(callback)))
            wait_until_blocked(engine, tx.pid, pending=[completing])
            tx.commit()
        with pytest.raises(awa.AwaError):
            completing.result(timeout=60)
        return int(live.job.id)

    first = asyncio.run(Live(live_side).run(settle_first))
    assert _terminal(engine, first) == ["failed"]

    def complete_first(live: Live) -> int:
        callback, job = live.callback, live.job
        paid = business(engine)
        key = sa.select(receipt_lock_key(sa.literal(job.id), sa.literal(1)))
        with held(engine) as tx:
            tx.conn.execute(sa.select(sa.func.pg_advisory_xact_lock(key.scalar_subquery())))
            completing = in_thread(lambda: pg_call(url, lambda c: c.complete_external(callback)))
            wait_until_blocked(engine, tx.pid, pending=[completing])

            def settling() -> awa_sa.Ending:
                return settled_with_row(engine, job, awa_sa.Complete())

            racing = in_thread(settling)
            wait_until_blocked(engine, tx.pid, count=2, pending=[completing, racing])
            tx.rollback()
        assert completing.result(timeout=60).id == job.id
        assert racing.result(timeout=60) == awa_sa.Stale()
        assert business(engine) == paid + 1  # a Stale settle still commits the caller's row
        return int(job.id)

    second = asyncio.run(Live(live_side).run(complete_first))
    assert _terminal(engine, second) == ["completed"]
    leases = rows(engine, "SELECT count(*) AS n FROM awa.leases WHERE job_id = :i", i=second)
    assert leases == [{"n": 0}]


def test_the_runtimes_lease_rescues_and_the_settle_end_the_job_once(live_side: Twin) -> None:
    """The settle first, uncommitted: the heartbeat rescue's ``SKIP LOCKED`` passes the lease
    by, and after the commit it is gone; the callback-timeout rescue takes a parked lease only,
    so even timed out a running one is never its. The heartbeat rescue first, uncommitted: the
    settle waits on the lease, then finds it gone and is Stale."""
    engine = live_side.engine
    stale = {"p1": "infinity"}  # every running lease's heartbeat is older than that
    heartbeat_rescue = statement(LEASE_HEARTBEAT_RESCUE, "awa")
    timeout_rescue = statement(CALLBACK_TIMEOUT_RESCUE, "awa")

    def settle_first(live: Live) -> int:
        job = live.job
        with engine.begin() as conn:  # the callback timed out while the handler runs
            conn.execute(
                sa.text("UPDATE awa.leases SET callback_timeout_at = now() WHERE job_id = :i"),
                {"i": job.id},
            )
        with held(engine) as tx:
            assert awa_sa.settle(tx.conn, job, awa_sa.Complete()) == awa_sa.Completed(job.id)
            with engine.begin() as conn:
                assert conn.execute(heartbeat_rescue, stale).all() == []
                assert conn.execute(timeout_rescue).all() == []
            tx.commit()
        with engine.begin() as conn:
            assert conn.execute(heartbeat_rescue, stale).all() == []
            assert conn.execute(timeout_rescue).all() == []
        return int(job.id)

    first = asyncio.run(Live(live_side).run(settle_first))
    assert _terminal(engine, first) == ["completed"]

    def rescue_first(live: Live) -> int:
        job = live.job
        before = snapshot(engine, SCHEMAS)
        with held(engine) as tx:
            assert [tuple(r) for r in tx.conn.execute(heartbeat_rescue, stale)] == [(job.id, 1)]
            racing = in_thread(lambda: settled_with_row(engine, job, awa_sa.Complete()))
            wait_until_blocked(engine, tx.pid, pending=[racing])
            tx.commit()  # the rescue's first statement alone: the lease gone
        assert racing.result(timeout=60) == awa_sa.Stale()
        changed = change(before, snapshot(engine, SCHEMAS))
        assert set(changed) == {"awa.leases"}  # the rescue's delete, and nothing of the settle
        return int(job.id)

    second = asyncio.run(Live(live_side).run(rescue_first))
    assert _terminal(engine, second) == []
