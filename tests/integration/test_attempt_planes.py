"""Two planes, one ``(id, run_lease)``: each handler's job resolves to its own attempt.

Beside real awa-pg 0.6.9 runtimes, through a real storage transition driven by the real CLI:

* a canonical attempt A, claimed while the cluster was ``prepared`` by an ``auto`` runtime, is
  still running in ``awa.jobs_hot`` (id 1, run_lease 1) when the cluster enters
  ``mixed_transition``; a queue-storage attempt B of the same kind on the same queue is then
  enqueued and claimed by a ``queue_storage_target`` runtime: ``awa_qs.lease_claims`` job 1,
  run_lease 1. Neither id sequence is touched: ``awa.jobs_id_seq`` and ``awa_qs.job_id_seq``
  both hand out 1. Each handler resolves the very ``Job`` it received with ``attempt_of``
  (async, through ``run_sync``) and gets its own plane's attempt; ``running_attempts`` lists
  both under the shared pair, each with its plane.
* a fresh ``awa migrate`` cluster whose first ``auto`` runtime auto-finalizes it to queue
  storage in schema ``awa``: ``attempt_of`` finds each handler's receipt, whether row-local (a
  queue with a deadline), compact (a queue without one) or materialised into ``leases`` by
  ``register_callback``, and once the runtime has closed them (completion, retry) nothing is
  listed any more.

Every expectation is read back from the rows themselves. Handlers are synchronised with events
and the runtimes' own row writes, never with sleeps.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import _janitor, database_url, run_awa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from awa_sa import (
    CANONICAL,
    AttemptNotFound,
    RunningAttempt,
    ValidationError,
    attempt_of,
    running_attempts,
)
from awa_sa.testing.server import EmbeddedPostgres

WAIT_SECS = 60.0


@dataclass
class Mail:
    who: str


@dataclass
class Ping:
    n: int


@dataclass
class Calls:
    n: int


@dataclass
class Flaky:
    n: int


def pg_url(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


def copy_of(job: Any) -> SimpleNamespace:
    """The attributes ``attempt_of`` reads, copied out of a runtime's ``Job`` in its loop."""
    return SimpleNamespace(
        id=job.id, attempt=job.attempt, kind=job.kind, queue=job.queue, created_at=job.created_at
    )


class Holder:
    """A handler that resolves its job with ``attempt_of``, then holds until released.

    ``go`` gates the lookup, so that several handlers can be made to run at once first. Beside
    ``attempt_of`` it also runs the old README recipe's lookup, ``running_attempts`` by the
    job's id and attempt, so a test can show what that recipe would have picked. ``calls``
    counts the runs: a runtime that retried the job would run it again.
    """

    def __init__(self, engine: AsyncEngine, go: asyncio.Event, release: asyncio.Event) -> None:
        self.engine = engine
        self.go = go
        self.release = release
        self.holding = asyncio.Event()
        self.resolved = asyncio.Event()
        self.calls = 0
        self.job: SimpleNamespace | None = None
        self.mine: RunningAttempt | None = None
        self.recipe: list[RunningAttempt] = []
        self.then: Callable[[Any], Awaitable[Any]] | None = None

    async def __call__(self, job: Any) -> Any:
        self.calls += 1
        self.job = copy_of(job)
        self.holding.set()
        await self.go.wait()
        async with self.engine.connect() as conn:
            self.mine = await conn.run_sync(attempt_of, job)
            self.recipe = await conn.run_sync(running_attempts, job_id=job.id, attempt=job.attempt)
        self.resolved.set()
        await self.release.wait()
        return None if self.then is None else await self.then(job)


async def within(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT_SECS)


def rows(engine: sa.Engine, sql: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql)).mappings()]


def state(engine: sa.Engine) -> dict[str, Any]:
    [row] = rows(engine, "SELECT state, current_engine, details FROM awa.storage_transition_state")
    return row


# --------------------------------------------------------------------- through a transition


@dataclass
class Collided:
    a: Holder
    b: Holder
    listed: list[RunningAttempt]
    listed_on_conn: list[RunningAttempt]
    sync_a: RunningAttempt
    sync_b: RunningAttempt
    hot: list[dict[str, Any]]
    receipts: list[dict[str, Any]]
    ready: list[dict[str, Any]]
    phase: dict[str, Any]


@dataclass
class Held:
    """Both handlers running and resolved, and what runs them."""

    a: Holder
    b: Holder
    canonical: awa.AsyncClient
    target: awa.AsyncClient
    engine: AsyncEngine
    running: list[awa.AsyncClient]

    async def stop(self, client: awa.AsyncClient) -> None:
        """Shut *client* down, which waits for its in-flight jobs to be completed."""
        self.running.remove(client)
        await client.shutdown()


@asynccontextmanager
async def held_pair(pg: EmbeddedPostgres, dbname: str, url: str) -> AsyncIterator[Held]:
    """A canonical attempt A and a queue-storage attempt B, both job 1 lease 1, running at once.

    Each handler holds on its own event (``Holder.release``), so a test can let one return
    while the other still runs; on exit both are released and every runtime still running is
    shut down.
    """

    def awa_cli(*args: str) -> str:
        return run_awa(pg, dbname, *args)

    async_engine = create_async_engine(url, poolclass=sa.NullPool)
    go = asyncio.Event()
    a = Holder(async_engine, go, asyncio.Event())
    b = Holder(async_engine, go, asyncio.Event())
    details = json.dumps({"schema": "awa_qs"})
    await asyncio.to_thread(
        awa_cli, "storage", "prepare", "--engine", "queue_storage", "--details", details
    )
    canonical = awa.AsyncClient(pg_url(url))
    canonical.task(Mail, queue="mail")(a)
    target = awa.AsyncClient(pg_url(url))
    target.task(Mail, queue="mail")(b)
    held = Held(a, b, canonical, target, async_engine, [])
    try:
        await canonical.insert(Mail(who="canonical A"), queue="mail")
        await canonical.start(
            [("mail", 1)], heartbeat_interval_ms=600_000, queue_storage_schema="awa_qs"
        )
        held.running.append(canonical)
        await within(a.holding)  # A is claimed by a runtime whose executor is canonical
        await target.start(
            [("mail", 1)],
            heartbeat_interval_ms=600_000,
            queue_storage_schema="awa_qs",
            storage_transition_role="queue_storage_target",
        )
        held.running.append(target)
        await asyncio.to_thread(awa_cli, "storage", "enter-mixed-transition")
        await target.insert(Mail(who="queue storage B"), queue="mail")
        await within(b.holding)
        go.set()  # both handlers are running: now each resolves its own job
        await within(a.resolved)
        await within(b.resolved)
        yield held
    finally:
        go.set()
        a.release.set()
        b.release.set()
        for client in reversed(held.running):
            await client.shutdown()
        await canonical.close()
        await target.close()
        await async_engine.dispose()


def collide(pg: EmbeddedPostgres, dbname: str, url: str, engine: sa.Engine) -> Collided:
    """Both attempts held, as :func:`held_pair` leaves them, read from the rows."""

    async def run() -> Collided:
        async with held_pair(pg, dbname, url) as held:
            a, b = held.a, held.b

            def read() -> Collided:
                assert a.job is not None
                assert b.job is not None
                with engine.connect() as conn:
                    on_conn = running_attempts(conn, job_id=1, attempt=1)
                return Collided(
                    a=a,
                    b=b,
                    listed=running_attempts(engine, job_id=1, attempt=1),
                    listed_on_conn=on_conn,
                    sync_a=attempt_of(engine, a.job),
                    sync_b=attempt_of(engine, b.job),
                    hot=rows(engine, "SELECT * FROM awa.jobs_hot WHERE state = 'running'"),
                    receipts=rows(engine, "SELECT * FROM awa_qs.lease_claims"),
                    ready=rows(engine, "SELECT * FROM awa_qs.ready_entries"),
                    phase=state(engine),
                )

            return await asyncio.to_thread(read)

    return asyncio.run(run())


@pytest.fixture
def collided(pg: EmbeddedPostgres, real_engine: sa.Engine, real_db_url: str) -> Collided:
    dbname = sa.make_url(real_db_url).database or ""
    return collide(pg, dbname, real_db_url, real_engine)


def test_each_handlers_job_resolves_to_its_own_plane(collided: Collided) -> None:
    [hot] = collided.hot
    [receipt] = collided.receipts
    [ready] = collided.ready
    assert collided.phase["state"] == "mixed_transition"
    # The collision is real, and no sequence was set: both planes' first job, first lease.
    assert (hot["id"], hot["run_lease"], hot["attempt"]) == (1, 1, 1)
    assert (receipt["job_id"], receipt["run_lease"], receipt["attempt"]) == (1, 1, 1)
    assert hot["args"] == {"who": "canonical A"}
    assert ready["args"] == {"who": "queue storage B"}
    assert (hot["kind"], hot["queue"]) == (ready["kind"], ready["queue"]) == ("mail", "mail")
    a, b = collided.a, collided.b
    assert a.job is not None
    assert b.job is not None
    assert (a.job.id, a.job.attempt, b.job.id, b.job.attempt) == (1, 1, 1, 1)

    mine_a, mine_b = a.mine, b.mine
    assert mine_a is not None
    assert mine_b is not None
    assert (mine_a.storage, mine_a.job_id, mine_a.run_lease) == (CANONICAL, 1, hot["run_lease"])
    assert mine_a.args == {"who": "canonical A"}
    assert mine_a.created_at == hot["created_at"]
    assert (mine_a.claim_slot, mine_a.receipt_id) == (None, None)
    assert not mine_a.on_queue_storage
    assert (mine_b.storage, mine_b.job_id, mine_b.run_lease) == ("awa_qs", 1, 1)
    assert mine_b.args == {"who": "queue storage B"}
    assert mine_b.created_at == ready["created_at"]
    assert (mine_b.claim_slot, mine_b.receipt_id) == (receipt["claim_slot"], receipt["receipt_id"])
    assert (mine_b.claim_batch_id, mine_b.claim_batch_index) == (None, None)
    assert mine_b.attempted_at == receipt["claimed_at"]
    assert mine_b.deadline_at == receipt["deadline_at"]
    assert mine_b.on_queue_storage
    # The sync face, given copies of the same attributes, finds the same claims.
    assert _same_claim(collided.sync_a, mine_a)
    assert _same_claim(collided.sync_b, mine_b)


def _same_claim(x: RunningAttempt, y: RunningAttempt) -> bool:
    """Equal but for ``running_for``, which is read at each call."""
    keep = ("storage", "job_id", "run_lease", "attempt", "created_at", "receipt_id")
    return all(getattr(x, k) == getattr(y, k) for k in keep)


def test_the_shared_pair_lists_both_attempts_each_with_its_plane(collided: Collided) -> None:
    for listed in (collided.listed, collided.listed_on_conn):
        assert sorted((x.storage, x.job_id, x.run_lease, x.args["who"]) for x in listed) == [
            ("awa_qs", 1, 1, "queue storage B"),
            (CANONICAL, 1, 1, "canonical A"),
        ]
        # Oldest claim first: A was claimed before the flip, B after it.
        assert [x.storage for x in listed] == [CANONICAL, "awa_qs"]


# ------------------------------------------------------------ a fresh, auto-finalized cluster


@pytest.fixture
def fresh_url(pg: EmbeddedPostgres) -> Iterator[str]:
    """A database built by ``awa migrate`` alone, never touched by a runtime."""
    name = f"fresh_{uuid.uuid4().hex[:12]}"
    janitor = _janitor(pg, name)
    janitor.init()
    try:
        run_awa(pg, name, "migrate")
        yield database_url(pg, name)
    finally:
        janitor.drop()


@dataclass
class Fresh:
    holders: dict[str, Holder]
    listed: list[RunningAttempt]
    phase: dict[str, Any]
    receipts: list[dict[str, Any]]
    batches: list[dict[str, Any]]
    leases: list[dict[str, Any]]
    after: list[RunningAttempt]
    ended: dict[str, list[dict[str, Any]]]
    stale_job: SimpleNamespace
    stale: Exception | None


def run_fresh(url: str, engine: sa.Engine) -> Fresh:
    async def fails(job: Any) -> None:
        raise RuntimeError("smtp down")

    async def run() -> Fresh:
        async_engine = create_async_engine(url, poolclass=sa.NullPool)
        go, release = asyncio.Event(), asyncio.Event()
        holders = {name: Holder(async_engine, go, release) for name in ("row", "compact", "cb")}
        flaky = Holder(async_engine, go, release)
        flaky.then = fails
        holders["flaky"] = flaky

        async def registers(job: Any) -> Any:
            await job.register_callback(timeout_seconds=600)
            return await holders["cb"](job)

        client = awa.AsyncClient(pg_url(url))
        client.task(Mail, queue="mail")(holders["row"])
        client.task(Ping, queue="nodeadline")(holders["compact"])
        client.task(Calls, queue="mail")(registers)
        client.task(Flaky, queue="mail")(flaky)
        queues = [
            {"name": "mail", "max_workers": 4},
            {"name": "nodeadline", "max_workers": 4, "deadline_duration_ms": 0},
        ]
        # The usual order: migrate, start the worker, enqueue. The first auto runtime on an
        # empty cluster finalizes it to queue storage in schema awa.
        await client.start(queues, heartbeat_interval_ms=600_000)
        try:
            await client.insert(Mail(who="row"), queue="mail")
            await client.insert(Ping(n=1), queue="nodeadline")
            await client.insert(Calls(n=1), queue="mail", max_attempts=3)
            await client.insert(Flaky(n=1), queue="mail", max_attempts=3)
            for holder in holders.values():
                await within(holder.holding)
            go.set()
            for holder in holders.values():
                await within(holder.resolved)

            def read() -> tuple[
                list[RunningAttempt], dict[str, Any], list[Any], list[Any], list[Any]
            ]:
                return (
                    running_attempts(engine),
                    state(engine),
                    rows(engine, "SELECT * FROM awa.lease_claims ORDER BY job_id"),
                    rows(engine, "SELECT * FROM awa.lease_claim_batches"),
                    rows(engine, "SELECT * FROM awa.leases"),
                )

            listed, phase, receipts, batches, leases_ = await asyncio.to_thread(read)
        finally:
            go.set()
            release.set()
            await client.shutdown()
            await client.close()
            await async_engine.dispose()

        def read_after() -> tuple[list[RunningAttempt], dict[str, list[dict[str, Any]]]]:
            ended = {
                table: rows(engine, f"SELECT job_id, run_lease FROM awa.{table} ORDER BY 1")
                for table in ("deferred_jobs", "lease_claim_closures", "done_entries")
            }
            ended["closure_batches"] = rows(
                engine, "SELECT receipt_ids, outcome FROM awa.lease_claim_closure_batches"
            )
            return running_attempts(engine), ended

        def stale_lookup(job: SimpleNamespace) -> Exception | None:
            try:
                attempt_of(engine, job)
            except AttemptNotFound as exc:
                return exc
            return None

        after, ended = await asyncio.to_thread(read_after)
        stale_job = holders["row"].job
        assert stale_job is not None
        stale = await asyncio.to_thread(stale_lookup, stale_job)
        return Fresh(
            holders, listed, phase, receipts, batches, leases_, after, ended, stale_job, stale
        )

    return asyncio.run(run())


@pytest.fixture
def fresh(fresh_url: str) -> Iterator[Fresh]:
    engine = sa.create_engine(fresh_url, poolclass=sa.NullPool)
    try:
        yield run_fresh(fresh_url, engine)
    finally:
        engine.dispose()


def test_a_fresh_cluster_auto_finalizes_and_attempt_of_finds_each_receipt(fresh: Fresh) -> None:
    assert fresh.phase["state"] == "active"
    assert fresh.phase["current_engine"] == "queue_storage"
    assert fresh.phase["details"] == {"schema": "awa", "auto_finalized": True}
    mine = {name: holder.mine for name, holder in fresh.holders.items()}
    assert all(m is not None and m.storage == "awa" for m in mine.values()), mine
    by_job = {r["job_id"]: r for r in fresh.receipts}

    row = mine["row"]
    assert row is not None
    assert row.args == {"who": "row"}
    receipt = by_job[row.job_id]
    assert (row.claim_slot, row.receipt_id) == (receipt["claim_slot"], receipt["receipt_id"])
    assert (row.run_lease, row.attempt, row.max_attempts) == (1, 1, 25)
    assert row.attempted_at == row.heartbeat_at == receipt["claimed_at"]  # no heartbeat yet
    assert row.deadline_at == receipt["deadline_at"] is not None

    compact = mine["compact"]
    [batch] = fresh.batches
    assert compact is not None
    assert compact.job_id not in by_job
    assert batch["job_ids"] == [compact.job_id]
    assert (compact.claim_batch_id, compact.claim_batch_index) == (batch["batch_id"], 1)
    assert (compact.claim_slot, compact.receipt_id) == (
        batch["claim_slot"],
        batch["receipt_ids"][0],
    )
    assert compact.attempted_at == batch["claimed_at"]
    assert compact.deadline_at is None

    called = mine["cb"]
    [lease] = fresh.leases
    assert called is not None
    assert lease["job_id"] == called.job_id
    assert lease["state"] == "running"
    assert lease["callback_id"] is not None
    assert by_job[called.job_id]["materialized_at"] is not None  # the receipt stays open
    assert called.receipt_id == by_job[called.job_id]["receipt_id"]
    assert called.max_attempts == 3

    # The whole listing: each running attempt once, whichever table holds its receipt.
    assert sorted((a.kind, a.job_id) for a in fresh.listed) == sorted(
        (m.kind, m.job_id) for m in mine.values() if m is not None
    )


def test_receipts_the_runtime_closed_are_no_longer_running(fresh: Fresh) -> None:
    assert fresh.after == []
    flaky = fresh.holders["flaky"].mine
    assert flaky is not None
    # The failed attempt went back to deferred_jobs under the same id and lease, its receipt
    # closed; the others completed (fast-path closure batches or done_entries).
    assert {"job_id": flaky.job_id, "run_lease": 1} in fresh.ended["deferred_jobs"]
    assert {"job_id": flaky.job_id, "run_lease": 1} in fresh.ended["lease_claim_closures"]
    by_receipt = {r for b in fresh.ended["closure_batches"] for r in b["receipt_ids"]}
    by_lease = fresh.ended["done_entries"] + fresh.ended["lease_claim_closures"]
    for name in ("row", "compact", "cb"):
        done = fresh.holders[name].mine
        assert done is not None
        key = {"job_id": done.job_id, "run_lease": done.run_lease}
        assert done.receipt_id in by_receipt or key in by_lease, name
    assert isinstance(fresh.stale, AttemptNotFound)  # the handler's job, once settled
    assert (fresh.stale.job_id, fresh.stale.attempt) == (fresh.stale_job.id, 1)


def test_attempt_of_refuses_a_job_without_its_attributes() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    job = SimpleNamespace(id=1, attempt=1, kind="mail", queue="mail", created_at="yesterday")
    with pytest.raises(ValidationError, match="RFC 3339"):
        attempt_of(engine, job)
    with pytest.raises(ValidationError, match=r"job\.attempt"):
        attempt_of(engine, SimpleNamespace(id=1, kind="mail", queue="mail"))


BEATS = """
    SELECT s.job_id, s.heartbeat_at, c.claimed_at
    FROM awa.attempt_state AS s
    JOIN awa.lease_claims AS c USING (job_id, run_lease)
"""
"""A receipt's heartbeats, beside its claim time."""


def test_a_receipts_heartbeat_is_the_runtimes_latest(fresh_url: str) -> None:
    """awa-pg 0.6.9 heartbeats a receipt into attempt_state; the listing reports that beat."""
    engine = sa.create_engine(fresh_url, poolclass=sa.NullPool)

    def beaten() -> tuple[list[RunningAttempt], list[dict[str, Any]]] | None:
        with engine.connect() as conn:  # one snapshot for the listing and the rows
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            beats = [dict(r) for r in conn.execute(sa.text(BEATS)).mappings()]
            if not beats:
                return None
            return running_attempts(conn), beats

    async def run() -> tuple[list[RunningAttempt], list[dict[str, Any]]]:
        release, holding = asyncio.Event(), asyncio.Event()

        async def holds(job: Any) -> None:
            holding.set()
            await release.wait()

        client = awa.AsyncClient(pg_url(fresh_url))
        client.task(Mail, queue="mail")(holds)
        await client.start([("mail", 1)], heartbeat_interval_ms=100)
        try:
            await client.insert(Mail(who="beats"), queue="mail")
            await within(holding)
            deadline = asyncio.get_running_loop().time() + WAIT_SECS
            while asyncio.get_running_loop().time() < deadline:  # wait for the beat's row
                found = await asyncio.to_thread(beaten)
                if found is not None:
                    return found
                await asyncio.sleep(0.05)
            pytest.fail("the runtime never heartbeat its receipt")
        finally:
            release.set()
            await client.shutdown()
            await client.close()

    try:
        [attempt], [beat] = asyncio.run(run())
    finally:
        engine.dispose()
    assert (attempt.storage, attempt.job_id) == ("awa", beat["job_id"])
    assert attempt.heartbeat_at == beat["heartbeat_at"] > beat["claimed_at"]
    assert attempt.attempted_at == beat["claimed_at"]
