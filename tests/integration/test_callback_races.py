"""Callback calls racing everything else that ends a wait, forced with held locks, beside a live
awa-pg 0.6.9 worker; and the worker going on correctly after each.

One cluster built by ``awa migrate`` and auto-finalized to queue storage (schema ``awa``) by
its live worker, whose handlers park jobs on callbacks. A side session holds the
maintenance-leader lock until the rescue race, so no callback-timeout rescue runs before it.
Every race is ordered by PostgreSQL's lock manager: one side holds a row (or its transaction)
open, the other is seen blocked in ``pg_stat_activity``, then the first lets go. Each awa-sa
call runs in a caller's transaction that also writes a business row, and a caller answered
``None`` rolls back: the job ends once, and only the winner's business row stays.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import pg_call
from callback_waits import on_pg
from conftest import cloned
from racing import held, in_thread, wait_for, wait_until_blocked
from runtimes import hold_leadership, pg_url, rows

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # a live awa-pg runtime

QUEUE = "race_q"
TIMEOUT = 120.0


class Lost(Exception):
    """The caller's answer was None: its business row must not commit."""


@dataclass
class Worker:
    """A live awa-pg worker on a loop of its own thread; its handlers record what they did."""

    url: str
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    runs: Counter[int] = field(default_factory=Counter)
    received: dict[int, Any] = field(default_factory=dict)
    registered: dict[int, threading.Event] = field(default_factory=dict)
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    client: Any = None

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def start(self) -> None:
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self._start())

    async def _start(self) -> None:
        self.client = awa.AsyncClient(pg_url(self.url))
        self.client.task(dict, kind="waits", queue=QUEUE)(self.waits)
        self.client.task(dict, kind="holds", queue=QUEUE)(self.holds)
        self.client.task(dict, kind="resumes", queue=QUEUE)(self.resumes)
        self.client.task(dict, kind="sentinel", queue=QUEUE)(self.sentinel)
        await self.client.start(
            [{"name": QUEUE, "max_workers": 8}],
            leader_election_interval_ms=100,
            callback_rescue_interval_ms=100,
            promote_interval_ms=100,
            heartbeat_interval_ms=600_000,
        )

    def stop(self) -> None:
        async def stop() -> None:
            await self.client.shutdown()
            await self.client.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def waits(self, job: Any) -> Any:
        """Parks on a callback the first time (after a flushed progress when asked); any later
        run (a retried wait) completes."""
        self.runs[job.id] += 1
        if self.runs[job.id] > 1:
            return None
        if job.args.get("progress"):
            job.set_progress(50, "half way")
            await job.flush_progress()
        token = await job.register_callback(timeout_seconds=3600)
        return awa.WaitForCallback(token)

    async def holds(self, job: Any) -> Any:
        """Registers a callback, then holds its attempt ``running`` until the test opens its
        gate, then parks: a callback can arrive before the handler returns."""
        self.runs[job.id] += 1
        gate = self.gates.setdefault(job.id, asyncio.Event())
        token = await job.register_callback(timeout_seconds=3600)
        self.registered.setdefault(job.id, threading.Event()).set()
        await gate.wait()
        return awa.WaitForCallback(token)

    async def resumes(self, job: Any) -> Any:
        """Registers a callback and waits in the handler for its payload (sequential)."""
        self.runs[job.id] += 1
        token = await job.register_callback(timeout_seconds=3600)
        self.received[job.id] = await job.wait_for_callback(token)

    async def sentinel(self, job: Any) -> Any:
        self.runs[job.id] += 1

    def open_gate(self, job_id: int) -> None:
        gate = self.gates.setdefault(job_id, asyncio.Event())
        self.loop.call_soon_threadsafe(gate.set)

    def insert(self, kind: str, args: dict[str, Any] | None = None, **options: Any) -> int:
        async def insert() -> int:
            given = args or {"k": kind}
            job = await self.client.insert(given, kind=kind, queue=QUEUE, **options)
            return int(job.id)

        return int(self.call(insert()))


@dataclass
class Cluster:
    url: str
    engine: sa.Engine
    worker: Worker
    leader: sa.Connection | None


@pytest.fixture(scope="module")
def cluster(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[Cluster]:
    with cloned(pg, awa_databases, real_template) as url:
        engine = sa.create_engine(url, pool_size=10)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE public.business (note text)"))
        leader = hold_leadership(engine)
        worker = Worker(url)
        worker.start()
        try:
            yield Cluster(url, engine, worker, leader)
        finally:
            worker.stop()
            if not leader.closed:
                leader.close()
            engine.dispose()


def lease(cluster: Cluster, job_id: int) -> dict[str, Any] | None:
    found = rows(
        cluster.engine,
        "SELECT state::text AS state, callback_id::text AS callback_id, run_lease"
        " FROM awa.leases WHERE job_id = :i",
        i=job_id,
    )
    return found[0] if found else None


def parked(cluster: Cluster, kind: str = "waits", **options: Any) -> tuple[int, str]:
    """A job the live worker parked on a callback: its id and callback id."""
    job_id = cluster.worker.insert(kind, **options)
    wait_for(
        lambda: (lease(cluster, job_id) or {}).get("state") == "waiting_external",
        what=f"job {job_id} parked",
    )
    found = lease(cluster, job_id)
    assert found is not None
    return job_id, found["callback_id"]


def ended(cluster: Cluster, job_id: int) -> list[str]:
    """Every row the job has left, as its state: one terminal row once it ended once."""
    sql = (
        "SELECT state::text AS s FROM awa.done_entries WHERE job_id = :i"
        " UNION ALL SELECT state::text FROM awa.leases WHERE job_id = :i"
        " UNION ALL SELECT state::text FROM awa.deferred_jobs WHERE job_id = :i"
    )
    return [row["s"] for row in rows(cluster.engine, sql, i=job_id)]


def notes(cluster: Cluster, note: str) -> int:
    sql = "SELECT count(*) AS n FROM public.business WHERE note = :n"
    return int(rows(cluster.engine, sql, n=note)[0]["n"])


def receiving(cluster: Cluster, note: str, call: Callable[[sa.Connection], Any]) -> Any:
    """*call* in a caller's transaction with its business row *note*; rolled back on None."""
    try:
        with cluster.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO public.business VALUES (:n)"), {"n": note})
            got = call(conn)
            if got is None:
                raise Lost(note)
            return got
    except Lost:
        return None


def complete(callback: str) -> Callable[[sa.Connection], Any]:
    return lambda conn: awa_sa.complete_external(conn, callback, {"paid": True})


def still_never_rerun(cluster: Cluster, *job_ids: int) -> None:
    """The worker claims a job enqueued after them, so it would have run any of them again:
    each ran once."""
    sentinel = cluster.worker.insert("sentinel")
    wait_for(lambda: cluster.worker.runs[sentinel] == 1, what="the sentinel's run")
    assert [cluster.worker.runs[i] for i in job_ids] == [1] * len(job_ids)


def test_two_receivers_complete_one_callback_once(cluster: Cluster) -> None:
    """awa-sa holding the wait, a second awa-sa receiver and awa-pg's ``complete_external``
    wait, then find it gone: None (its row rolled back) and "callback not found". The other
    order: awa-pg's completion queued first behind a side lock, awa-sa's behind it: None."""
    job_id, callback = parked(cluster)
    with held(cluster.engine) as tx:
        tx.execute("INSERT INTO public.business VALUES ('first')")
        assert awa_sa.complete_external(tx.conn, callback) is not None
        by_pg = in_thread(
            lambda: pg_call(cluster.url, on_pg(lambda c: c.complete_external(callback)))
        )
        (first,) = wait_until_blocked(cluster.engine, tx.pid, pending=[by_pg])
        # The first waiter holds the row's tuple lock: the second queues behind it.
        second = in_thread(lambda: receiving(cluster, "second", complete(callback)))
        wait_until_blocked(cluster.engine, first.pid, pending=[by_pg, second])
        tx.commit()
    assert second.result(TIMEOUT) is None
    assert by_pg.result(TIMEOUT) is None
    assert (ended(cluster, job_id), notes(cluster, "first"), notes(cluster, "second")) == (
        ["completed"],
        1,
        0,
    )

    job_id, callback = parked(cluster)
    with held(cluster.engine) as tx:
        tx.execute("SELECT 1 FROM awa.leases WHERE job_id = :i FOR UPDATE", {"i": job_id})
        by_pg = in_thread(lambda: pg_call(cluster.url, lambda c: c.complete_external(callback)))
        (first,) = wait_until_blocked(cluster.engine, tx.pid, pending=[by_pg])
        late = in_thread(lambda: receiving(cluster, "late", complete(callback)))
        wait_until_blocked(cluster.engine, first.pid, pending=[by_pg, late])
        tx.rollback()
    assert by_pg.result(TIMEOUT).id == job_id
    assert late.result(TIMEOUT) is None
    assert (ended(cluster, job_id), notes(cluster, "late")) == (["completed"], 0)
    still_never_rerun(cluster, job_id)


def test_a_callback_racing_cancel_job_ends_the_wait_once(cluster: Cluster) -> None:
    """awa-sa's completion holding the wait makes awa-pg's cancel wait, then find a completed
    job; awa-pg's cancel queued first behind a side lock makes awa-sa's completion find none."""
    job_id, callback = parked(cluster)
    with held(cluster.engine) as tx:
        assert awa_sa.fail_external(tx.conn, callback, "declined") is not None
        cancelling = in_thread(lambda: pg_call(cluster.url, lambda c: c.cancel(job_id)))
        wait_until_blocked(cluster.engine, tx.pid, pending=[cancelling])
        tx.commit()
    with pytest.raises(awa.AwaError, match="job not found"):  # awa-pg finds a failed job
        cancelling.result(TIMEOUT)
    assert ended(cluster, job_id) == ["failed"]

    job_id, callback = parked(cluster)
    with held(cluster.engine) as tx:
        tx.execute("SELECT 1 FROM awa.leases WHERE job_id = :i FOR UPDATE", {"i": job_id})
        cancelling = in_thread(lambda: pg_call(cluster.url, lambda c: c.cancel(job_id)))
        (first,) = wait_until_blocked(cluster.engine, tx.pid, pending=[cancelling])
        late = in_thread(lambda: receiving(cluster, "after cancel", complete(callback)))
        wait_until_blocked(cluster.engine, first.pid, pending=[cancelling, late])
        tx.rollback()
    assert cancelling.result(TIMEOUT).id == job_id
    assert late.result(TIMEOUT) is None
    assert (ended(cluster, job_id), notes(cluster, "after cancel")) == (["cancelled"], 0)
    still_never_rerun(cluster, job_id)


def _held_running(cluster: Cluster) -> tuple[int, str]:
    """A ``holds`` job whose handler registered its callback and is still running."""
    job_id = cluster.worker.insert("holds")
    wait_for(lambda: job_id in cluster.worker.registered, what=f"job {job_id} registered")
    cluster.worker.registered[job_id].wait(TIMEOUT)
    found = lease(cluster, job_id)
    assert found is not None
    assert found["state"] == "running"
    return job_id, found["callback_id"]


def test_a_callback_before_the_handler_parks_ends_the_wait_once(cluster: Cluster) -> None:
    """The callback arrives while the handler still runs (``running``): awa-sa's completion
    holding the lease makes the runtime's park wait, then find nothing to park; the park queued
    first behind a side lock goes first, and awa-sa's completion then ends the parked wait."""
    job_id, callback = _held_running(cluster)
    with held(cluster.engine) as tx:
        tx.execute("INSERT INTO public.business VALUES ('early')")
        got = awa_sa.complete_external(tx.conn, callback, {"early": True})
        assert got is not None
        assert got.state == "completed"
        cluster.worker.open_gate(job_id)
        wait_until_blocked(cluster.engine, tx.pid)  # the runtime's park, on the lease
        tx.commit()
    wait_for(lambda: ended(cluster, job_id) == ["completed"], what="the park to give up")
    assert notes(cluster, "early") == 1

    job_id, callback = _held_running(cluster)
    with held(cluster.engine) as tx:
        tx.execute("SELECT 1 FROM awa.leases WHERE job_id = :i FOR UPDATE", {"i": job_id})
        cluster.worker.open_gate(job_id)
        (park,) = wait_until_blocked(cluster.engine, tx.pid)
        late = in_thread(lambda: receiving(cluster, "after park", complete(callback)))
        wait_until_blocked(cluster.engine, park.pid, pending=[late])
        tx.rollback()
    assert late.result(TIMEOUT).state == "completed"
    assert (ended(cluster, job_id), notes(cluster, "after park")) == (["completed"], 1)
    still_never_rerun(cluster, job_id)


def test_a_retried_wait_runs_again_and_a_resumed_handler_gets_the_payload(
    cluster: Cluster,
) -> None:
    job_id, callback = parked(cluster)
    assert receiving(cluster, "retry", lambda conn: awa_sa.retry_external(conn, callback))
    wait_for(lambda: cluster.worker.runs[job_id] == 2, what="the retried run")
    wait_for(lambda: ended(cluster, job_id) == [], what="its completion")  # a receipt's

    job_id = cluster.worker.insert("resumes")
    wait_for(lambda: (lease(cluster, job_id) or {}).get("callback_id") is not None, what="a wait")
    found = lease(cluster, job_id)
    assert found is not None
    payload = {"status": "confirmed", "amount": [12, "EUR"]}
    got = receiving(
        cluster, "resume", lambda conn: awa_sa.resume_external(conn, found["callback_id"], payload)
    )
    assert got.state == "running"
    wait_for(lambda: job_id in cluster.worker.received, what="the handler's payload")
    assert cluster.worker.received[job_id] == payload
    wait_for(lambda: lease(cluster, job_id) is None, what="the handler's completion")
    assert ended(cluster, job_id) in ([], ["completed"])
    still_never_rerun(cluster, job_id)


def test_a_callback_racing_the_timeout_rescue_ends_the_wait_once(cluster: Cluster) -> None:
    """Last: the leadership is let go, so the runtime rescues timed-out waits. Three waits,
    their timeouts moved to now by a heartbeat while no rescue runs: awa-sa's failure holds the
    first, so the rescue skips it (``SKIP LOCKED``); a side lock on the second's
    ``attempt_state`` row stops the rescue after it deleted that lease, and awa-sa's completion
    of the second then waits for the rescue and finds nothing; the third is rescued as a
    witness that the pass ran while the first was held."""
    held_first, first_cb = parked(cluster, max_attempts=1)
    rescued, rescued_cb = parked(cluster, args={"progress": True}, max_attempts=1)
    witness, witness_cb = parked(cluster, max_attempts=1)
    for callback in (first_cb, rescued_cb, witness_cb):  # timed out now, no rescue running
        with cluster.engine.begin() as conn:
            assert awa_sa.heartbeat_callback(conn, callback, 0) is not None
    with held(cluster.engine) as winner, held(cluster.engine) as side:
        assert awa_sa.fail_external(winner.conn, first_cb, "declined") is not None
        side.execute("SELECT 1 FROM awa.attempt_state WHERE job_id = :i FOR UPDATE", {"i": rescued})
        assert cluster.leader is not None
        cluster.leader.invalidate()  # its session ends: the runtime becomes leader at its pace
        cluster.leader.close()
        # The rescue's DELETE ran (it waits to delete the second's attempt_state) while the
        # first's lease was held: the pass skipped it.
        (rescue,) = wait_until_blocked(cluster.engine, side.pid)
        late = in_thread(lambda: receiving(cluster, "too late", complete(rescued_cb)))
        wait_until_blocked(cluster.engine, rescue.pid, pending=[late])
        winner.commit()
        side.rollback()
    assert late.result(TIMEOUT) is None
    wait_for(lambda: ended(cluster, witness) == ["failed"], what="the witness's rescue")
    assert ended(cluster, held_first) == ["failed"]
    assert ended(cluster, rescued) == ["failed"]
    last_error = (
        "SELECT payload->'errors'->-1->>'error' AS e FROM awa.done_entries WHERE job_id = :i"
    )
    assert [rows(cluster.engine, last_error, i=i) for i in (held_first, rescued, witness)] == [
        [{"e": "declined"}],
        [{"e": "callback timed out"}],
        [{"e": "callback timed out"}],
    ]
    assert notes(cluster, "too late") == 0
    still_never_rerun(cluster, held_first, rescued, witness)
