"""Cancelling an available job on queue storage: awa-pg 0.6.9's rows but the cursor, a real
worker that never runs it and runs every job behind it, and a cancel racing a claim.

Twin clusters built by ``awa migrate``, each auto-finalized to queue storage in schema ``awa``
by a first real awa-pg runtime, then given the same available jobs in the same order on three
lanes, no worker serving them, a maintenance-leader lock held (nothing promotes or rescues).
Each cancel is done by awa-pg's ``AsyncClient`` on one twin and by awa-sa in a caller's
transaction that also commits a business row on the other: every table of schema ``awa``
compared, and every sequence but one: after its commit awa-pg moves the lane's claim cursor
past a cancelled head, which awa-sa leaves to the claim (docs/contract.md#cancel). awa-pg's own
``queue_stats`` then differs by exactly the tombstones at a lane's head.

A real awa-pg worker then drains both twins' queues: it runs every job but the cancelled ones
(a lane's head, middle and tail; one lane and two), and awa-pg's counts end the same on both.
Last, a cancel racing the worker's claim of the same job, both orders forced with held locks:
the job runs and is cancelled as running, or never runs; never both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import Twin, change, pg_call, same_job, snapshot, twin_pair
from racing import Waiter, backend_pid, in_thread, wait_until_blocked
from runtimes import pg_url, rows, until_idle

import awa_sa
from awa_sa import QueueStorageJobs
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

LANES = (("avail_q", 2), ("multi_q", 1), ("multi_q", 3))
JOBS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    # (queue, priority, options), ids 1.. in this order, none claimed.
    ("avail_q", 2, {}),  # 1: head
    ("avail_q", 2, {"tags": ["t"], "metadata": {"m": 1}}),  # 2
    ("avail_q", 2, {"unique_opts": {"by_args": True}}),  # 3: middle, keyed
    ("avail_q", 2, {"unique_opts": {"by_args": True}}),  # 4: by key
    ("avail_q", 2, {}),  # 5
    ("avail_q", 2, {"tags": ["x"]}),  # 6: tail
    ("multi_q", 1, {}),  # 7: head of lane 1
    ("multi_q", 1, {}),  # 8
    ("multi_q", 3, {}),  # 9
    ("multi_q", 3, {}),  # 10: middle of lane 3
    ("multi_q", 3, {}),  # 11: tail of lane 3
)
CANCELLED = (1, 3, 4, 6, 7, 10, 11)
HEADS = {1, 7}
CHANNELS = ("awa:avail_q", "awa:multi_q", "awa:cancel")


async def _finalize_then_enqueue(side: Twin) -> None:
    client = awa.AsyncClient(pg_url(side.url))
    client.task(dict, kind="boot", queue="boot_q")(_noop)
    await client.start([("boot_q", 1)], promote_interval_ms=600_000)
    try:
        for _ in range(1200):
            schema = rows(side.engine, "SELECT awa.active_queue_storage_schema() AS s")[0]["s"]
            if schema == "awa":
                break
            await asyncio.sleep(0.05)  # the runtime's own pace: its finalize
        else:
            raise AssertionError("the runtime did not finalize queue storage within 60 s")
    finally:
        await client.shutdown()
        await client.close()
    client = awa.AsyncClient(pg_url(side.url))
    try:
        for n, (queue, priority, options) in enumerate(JOBS, 1):
            await client.insert({"n": n}, kind="work", queue=queue, priority=priority, **options)
    finally:
        await client.close()


async def _noop(job: Any) -> None:
    return None


@pytest.fixture(scope="module")
def sides(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[tuple[Twin, Twin]]:
    yield from twin_pair(pg, awa_databases, real_template, _finalize_then_enqueue)


def _claim_cursors(engine: sa.Engine) -> dict[tuple[str, int], int]:
    found = rows(
        engine,
        "SELECT queue, priority, awa.sequence_next_value(seq_name) AS seq"
        " FROM awa.queue_claim_heads",
    )
    return {(r["queue"], r["priority"]): int(r["seq"]) for r in found}


def _stats(url: str) -> dict[str, tuple[int, ...]]:
    stats = pg_call(url, lambda c: c.queue_stats())
    return {
        s.queue: (s.available, s.scheduled, s.running, s.failed, s.total_queued)
        for s in stats
        if s.queue in ("avail_q", "multi_q")
    }


def _cancel(job_id: int) -> tuple[Any, Any]:
    if job_id == 4:
        return (
            lambda c: c.cancel_by_unique_key("work", args={"n": 4}),
            lambda conn: awa_sa.cancel_by_unique_key(conn, "work", args={"n": 4}),
        )
    return (lambda c: c.cancel(job_id), lambda conn: awa_sa.cancel_job(conn, job_id))


def test_a_cancelled_available_job_is_written_as_awa_pg_writes_it_but_the_cursor(
    sides: tuple[Twin, Twin],
) -> None:
    pg_side, sa_side = sides
    urls = (pg_side.url, sa_side.url)
    for job_id in CANCELLED:
        cursors = _claim_cursors(pg_side.engine), _claim_cursors(sa_side.engine)
        before = snapshot(pg_side.engine), snapshot(sa_side.engine)
        on_pg, on_sa = _cancel(job_id)
        got_pg = pg_call(urls[0], on_pg)
        with sa_side.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO public.business VALUES ('cancelled')"))
            got_sa = on_sa(conn)
        pg_change = change(before[0], snapshot(pg_side.engine))
        sa_change = change(before[1], snapshot(sa_side.engine))
        moved = pg_change.pop("sequences", None)
        assert "sequences" not in sa_change, job_id
        assert sa_change == pg_change, job_id
        assert {"awa.done_entries", "awa.ready_tombstones"} <= set(sa_change), job_id
        assert _claim_cursors(sa_side.engine) == cursors[1], job_id
        # awa-pg moved its lane's cursor past a head, and only past a head.
        lane = next((q, p) for n, (q, p, _) in enumerate(JOBS, 1) if n == job_id)
        pg_moved = {k: v for k, v in _claim_cursors(pg_side.engine).items() if v != cursors[0][k]}
        assert pg_moved == ({lane: cursors[0][lane] + 1} if job_id in HEADS else {}), job_id
        assert bool(moved) == (job_id in HEADS), job_id
        same_job(got_sa, got_pg)
        assert (got_sa.state, got_sa.storage, got_sa.attempt) == ("cancelled", "awa", 0)
    # awa-pg's queue_stats leave tombstones out: exact on both twins. The lanes' cursor
    # difference (the depth Awa's maintenance leader reports) counts a tombstone the cursor has
    # not passed: on awa-sa's twin one more per cancelled head than on awa-pg's.
    exact = {"avail_q": (2, 0, 0, 0, 2), "multi_q": (2, 0, 0, 0, 2)}
    assert _stats(urls[0]) == _stats(urls[1]) == exact
    assert _depths(pg_side.engine) == {"avail_q": 5, "multi_q": 4}
    assert _depths(sa_side.engine) == {"avail_q": 6, "multi_q": 5}


def _depths(engine: sa.Engine) -> dict[str, int]:
    found = rows(
        engine,
        "SELECT e.queue, sum(GREATEST(awa.sequence_next_value(e.seq_name)"
        " - awa.sequence_next_value(c.seq_name), 0))::int AS depth"
        " FROM awa.queue_enqueue_heads e JOIN awa.queue_claim_heads c"
        " USING (queue, priority, enqueue_shard) GROUP BY e.queue",
    )
    return {r["queue"]: r["depth"] for r in found if r["queue"] in ("avail_q", "multi_q")}


def test_a_cancelled_job_is_refused_again_and_a_rollback_leaves_the_job_available(
    sides: tuple[Twin, Twin],
) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        assert awa_sa.cancel_job(conn, 2) is not None
        conn.rollback()
    assert snapshot(sa_side.engine) == before  # not a sequence moved
    with sa_side.engine.begin() as conn, pytest.raises(QueueStorageJobs, match="terminal"):
        awa_sa.cancel_job(conn, 1)
    with sa_side.engine.begin() as conn:
        assert awa_sa.cancel_by_unique_key(conn, "work", args={"n": 4}) is None
    assert snapshot(sa_side.engine) == before


async def _drain(side: Twin) -> list[int]:
    """A real worker on every lane until it ran every job left and its claims passed every
    tombstone (the lanes' cursor difference back to zero); the ids it ran, in order."""
    client = awa.AsyncClient(pg_url(side.url))
    ran: list[int] = []
    left = len(JOBS) - len(CANCELLED)
    done = asyncio.Event()

    async def work(job: Any) -> None:
        ran.append(job.id)
        if len(ran) >= left:
            done.set()

    client.task(dict, kind="work", queue="avail_q")(work)
    client.task(dict, kind="work", queue="multi_q")(work)
    await client.start([("avail_q", 1), ("multi_q", 1)], promote_interval_ms=600_000)
    try:
        await asyncio.wait_for(done.wait(), 60)
        for _ in range(6000):
            if not any(_depths(side.engine).values()):
                break
            await asyncio.sleep(0.01)  # the runtime's poll
        else:
            raise AssertionError(f"a lane's cursor stayed short: {_depths(side.engine)}")
    finally:
        await client.shutdown()
        await client.close()
    return ran


def test_a_real_worker_never_runs_a_cancelled_job_and_runs_every_job_behind_it(
    sides: tuple[Twin, Twin],
) -> None:
    pg_side, sa_side = sides
    expected = [n for n in range(1, len(JOBS) + 1) if n not in CANCELLED]
    for side in (sa_side, pg_side):
        ran = asyncio.run(_drain(side))
        assert sorted(ran) == expected, ran
        states = rows(
            side.engine,
            "SELECT id, state::text AS s FROM awa.jobs WHERE id <= :n ORDER BY id",
            n=len(JOBS),
        )
        assert {r["id"]: r["s"] for r in states} == {
            n: "cancelled" if n in CANCELLED else "completed" for n in range(1, len(JOBS) + 1)
        }
    zero = (0, 0, 0, 0, 0)
    assert _stats(sa_side.url) == _stats(pg_side.url) == {"avail_q": zero, "multi_q": zero}
    assert _depths(sa_side.engine) == _depths(pg_side.engine) == {"avail_q": 0, "multi_q": 0}


CLAIM = ".claim_ready_runtime("
"""A text of the queue-storage claim statement."""


async def _race(side: Twin) -> dict[str, Any]:
    """On a lane a live worker serves: a cancel that locks first (the worker's claims, caught
    twice behind a lock, take nothing until the cancel commits), then a claim that locks first
    (caught before it writes its receipt, behind a lock on ``claim_ring_state``, which the
    cancel does not read, with the cancel waiting behind the claim)."""
    client = awa.AsyncClient(pg_url(side.url))
    ran: list[int] = []
    answered = asyncio.Event()  # the held job's handler runs on until the cancel has answered

    async def race(job: Any) -> None:
        ran.append(job.id)
        if job.args["n"] == 3:
            await answered.wait()  # else its completion could end it before the cancel reads

    client.task(dict, kind="race", queue="race_q")(race)
    first = await client.insert({"n": 1}, kind="race", queue="race_q")
    found: dict[str, Any] = {"first": first.id}
    cancelling = side.engine.connect()  # the cancel, its transaction open before any claim
    found["first_answer"] = awa_sa.cancel_job(cancelling, first.id)
    await client.start([("race_q", 1)], poll_interval_ms=50)
    try:
        found["caught"] = await asyncio.to_thread(_claims_meanwhile, side)
        cancelling.commit()
        cancelling.close()
        behind = await client.insert({"n": 2}, kind="race", queue="race_q")
        for _ in range(6000):
            if behind.id in ran:
                break
            await asyncio.sleep(0.01)  # the worker's pace
        found["behind"] = behind.id
        holder = side.engine.connect()
        try:
            holder.execute(sa.text("LOCK TABLE awa.claim_ring_state IN ACCESS EXCLUSIVE MODE"))
            held = await client.insert({"n": 3}, kind="race", queue="race_q")
            found["held"] = held.id
            claimer = await asyncio.to_thread(_blocked_claim, side.engine, backend_pid(holder))
            cancel = in_thread(lambda: _sa_cancel(side, held.id))
            await asyncio.to_thread(wait_until_blocked, side.engine, claimer.pid, pending=[cancel])
            holder.rollback()
        finally:
            holder.close()
        found["held_answer"] = await asyncio.wrap_future(cancel)
        answered.set()
        for _ in range(6000):
            if held.id in ran:
                break
            await asyncio.sleep(0.01)  # the worker's pace
        await until_idle(client)  # its completion of the cancelled attempt handed over
    finally:
        await client.shutdown()
        await client.close()
    found["ran"] = ran
    return found


def _blocked_claim(engine: sa.Engine, holder_pid: int) -> Waiter:
    """The worker's claim, once it waits behind *holder_pid* (other readers of the table the
    runtime's bookkeeping sends may wait there first: waited past)."""
    for count in range(1, 20):
        waiters = wait_until_blocked(engine, holder_pid, count=count)
        claims = [w for w in waiters if CLAIM in w.query]
        if claims:
            return claims[0]
    raise AssertionError("the worker's claim never waited behind the lock")


def _claims_meanwhile(side: Twin) -> int:
    """The worker's claims caught behind a lock on ``awa.queue_meta``, twice: a whole claim ran
    in between."""
    caught: list[str] = []
    for _ in range(20):
        with side.engine.connect() as holder:
            holder.execute(sa.text("LOCK TABLE awa.queue_meta IN ACCESS EXCLUSIVE MODE"))
            waiters = wait_until_blocked(side.engine, backend_pid(holder))
            caught.extend(w.query for w in waiters if CLAIM in w.query)
            holder.rollback()
        if len(caught) >= 2:
            break
    return len(caught)


def _sa_cancel(side: Twin, job_id: int) -> awa_sa.JobRow | None:
    with side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('raced')"))
        return awa_sa.cancel_job(conn, job_id)


def test_a_cancel_racing_the_claim_of_the_same_job_either_wins_or_cancels_it_running(
    sides: tuple[Twin, Twin],
) -> None:
    _, sa_side = sides
    found = asyncio.run(_race(sa_side))
    first, behind, held = found["first"], found["behind"], found["held"]
    # The cancel locked first: claims ran meanwhile and took nothing; it never ran, and the
    # job behind it did.
    assert found["caught"] >= 2
    assert (found["first_answer"].state, found["first_answer"].attempt) == ("cancelled", 0)
    # The claim locked first: the cancel waited, saw the claim, and cancelled the running
    # attempt as awa-pg's cancel of a running job answers (its attempt 1). The handler ran
    # once (told or not, as its start fell before or after the NOTIFY); its completion changed
    # nothing.
    assert (found["held_answer"].state, found["held_answer"].attempt) == ("cancelled", 1)
    assert found["ran"] == [behind, held]
    states = rows(
        sa_side.engine,
        "SELECT id, state::text AS s FROM awa.jobs WHERE id = ANY(:ids) ORDER BY id",
        ids=[first, behind, held],
    )
    assert [r["s"] for r in states] == ["cancelled", "completed", "cancelled"]
    written = rows(
        sa_side.engine,
        "SELECT job_id, state::text AS s, attempt FROM awa.done_entries"
        " WHERE job_id = ANY(:ids) ORDER BY job_id",
        ids=[first, held],
    )
    assert [(r["job_id"], r["s"], r["attempt"]) for r in written] == [
        (first, "cancelled", 0),
        (held, "cancelled", 1),
    ]
    tombstoned = rows(
        sa_side.engine, "SELECT job_id FROM awa.ready_tombstones WHERE queue = 'race_q'"
    )
    assert tombstoned == [{"job_id": first}]
