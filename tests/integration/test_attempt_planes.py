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
* the same pair, settled (docs/contract.md#bare-pair): while both handlers hold, every
  documented call that names B by the bare pair (sync and async; Engine, Connection and
  Session; single and batch) is refused with ``QueueStorageAttempt`` and leaves every row of
  both planes as it was. ``settle`` with A's attempt moves A alone into
  ``awa_qs.deferred_jobs``; ``settle`` with B's (``attempt_of`` a copy of B's job) completes B
  while B's runtime still holds it. Then A's runtime completes A and B's runtime completes B:
  each finds nothing and writes nothing. The old README recipe, ``running_attempts`` by the
  job's id and attempt, lists both attempts, and each settles only on its own plane.
* a fresh ``awa migrate`` cluster whose first ``auto`` runtime auto-finalizes it to queue
  storage in schema ``awa``: ``attempt_of`` finds each handler's receipt, whether row-local (a
  queue with a deadline), compact (a queue without one) or materialised into ``leases`` by
  ``register_callback``, and once the runtime has closed them (completion, retry) nothing is
  listed any more.

Every expectation is read back from the rows themselves. Handlers are synchronised with events
and the runtimes' own row writes, never with sleeps; a completion is waited for by shutting its
runtime down, which drains its in-flight jobs.
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
from jobs import RUNTIME_CLOCK, plane_tables, sequences
from runtimes import STILL, hold_leadership, pg_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import (
    CANONICAL,
    Attempt,
    AttemptNotFound,
    Complete,
    Completed,
    Migrated,
    QueueStorageAttempt,
    RunningAttempt,
    Snooze,
    Stale,
    ValidationError,
    attempt_of,
    running_attempts,
)
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

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
        self.returned = False
        self.done = asyncio.Event()
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
        try:
            return None if self.then is None else await self.then(job)
        finally:
            self.returned = True
            self.done.set()


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
async def held_pair(
    pg: EmbeddedPostgres, dbname: str, url: str, engine: sa.Engine
) -> AsyncIterator[Held]:
    """A canonical attempt A and a queue-storage attempt B, both job 1 lease 1, running at once.

    Each handler holds on its own event (``Holder.release``), so a test can let one return
    while the other still runs; on exit both are released and every runtime still running is
    shut down. No runtime leads (:func:`hold_leadership`): when the first leader stopped, the
    other would take over and rotate, roll up or promote between two snapshots.
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
    leader = await asyncio.to_thread(hold_leadership, engine)
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
        leader.close()


def collide(pg: EmbeddedPostgres, dbname: str, url: str, engine: sa.Engine) -> Collided:
    """Both attempts held, as :func:`held_pair` leaves them, read from the rows."""

    async def run() -> Collided:
        async with held_pair(pg, dbname, url, engine) as held:
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


# ------------------------------------------- settling beside the runtimes, the pair colliding

SNOOZE = Snooze(3600)
COMPLETE = Complete()
"""Long enough that the target runtime never promotes A's successor during a scenario."""

Snapshot = dict[str, list[Any]]


def planes(engine: sa.Engine) -> Snapshot:
    """Every row of every table of both planes, and every sequence, as of one snapshot."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        tables = plane_tables(conn, ("awa", "awa_qs"), RUNTIME_CLOCK)
        out: Snapshot = {
            t: list(conn.execute(sa.text(f"SELECT t::text FROM {t} AS t ORDER BY 1")).scalars())
            for t in tables
        }
        out["sequences"] = [tuple(r) for r in sequences(conn, ("awa", "awa_qs"))]
    return out


CLOSING = frozenset(
    {
        "awa_qs.lease_claim_closures",
        "awa_qs.lease_claim_closure_batches",
        "awa_qs.receipt_completion_batches",
        "awa_qs.receipt_completion_tombstones",
        "awa_qs.done_entries",
        "awa_qs.queue_terminal_count_deltas",
        "sequences",
    }
)
"""Where a runtime may record a completed receipt (awa-pg 0.6.9 writes closure and completion
batches; a runtime on the slow path writes per-row closures and done entries instead)."""


def changed(before: Snapshot, after: Snapshot) -> set[str]:
    """The tables (and ``sequences``) whose rows differ between two snapshots."""
    return {t for t in before.keys() | after.keys() if before.get(t) != after.get(t)}


def result_of(call: Callable[[], object]) -> object:
    """What *call* returned, or the exception it raised: every call is made, then judged."""
    try:
        return call()
    except Exception as exc:
        return exc


async def async_result_of(call: Callable[[], Awaitable[object]]) -> object:
    try:
        return await call()
    except Exception as exc:
        return exc


def sync_calls_for_b(engine: sa.Engine, b: Holder) -> dict[str, object]:
    """Every documented sync call that names B by its bare pair (which is A's too), each in a
    transaction of its own."""
    mine = b.mine
    assert mine is not None
    job_id, lease = mine.job_id, mine.run_lease
    batch = [Attempt(job_id, lease, SNOOZE)]

    def on_conn(fn: Callable[[sa.Connection], object]) -> object:
        with engine.begin() as conn:
            return fn(conn)

    def in_session(fn: Callable[[Session], object]) -> object:
        with Session(engine) as session, session.begin():
            return fn(session)

    calls: dict[str, Callable[[], object]] = {
        "bare, Engine": lambda: awa_sa.reschedule_canonical_attempt(engine, job_id, lease, SNOOZE),
        "bare, Connection": lambda: on_conn(
            lambda c: awa_sa.reschedule_canonical_attempt(c, job_id, lease, SNOOZE)
        ),
        "bare, Session": lambda: in_session(
            lambda s: awa_sa.reschedule_canonical_attempt(s, job_id, lease, SNOOZE)
        ),
        "batch, Engine": lambda: awa_sa.reschedule_canonical_attempts(engine, batch),
        "batch, Connection": lambda: on_conn(
            lambda c: awa_sa.reschedule_canonical_attempts(c, batch)
        ),
    }
    return {name: result_of(call) for name, call in calls.items()}


async def async_calls_for_b(engine: AsyncEngine, b: Holder) -> dict[str, object]:
    """The async face of :func:`sync_calls_for_b`: AsyncEngine, AsyncConnection, AsyncSession."""
    mine = b.mine
    assert mine is not None
    job_id, lease = mine.job_id, mine.run_lease
    batch = [Attempt(job_id, lease, SNOOZE)]

    async def on_conn(fn: Callable[[AsyncConnection], Awaitable[object]]) -> object:
        async with engine.begin() as conn:
            return await fn(conn)

    async def in_session(fn: Callable[[AsyncSession], Awaitable[object]]) -> object:
        async with AsyncSession(engine) as session, session.begin():
            return await fn(session)

    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "async bare, AsyncEngine": lambda: awa_async.reschedule_canonical_attempt(
            engine, job_id, lease, SNOOZE
        ),
        "async bare, AsyncConnection": lambda: on_conn(
            lambda c: awa_async.reschedule_canonical_attempt(c, job_id, lease, SNOOZE)
        ),
        "async bare, AsyncSession": lambda: in_session(
            lambda s: awa_async.reschedule_canonical_attempt(s, job_id, lease, SNOOZE)
        ),
        "async batch, AsyncEngine": lambda: awa_async.reschedule_canonical_attempts(engine, batch),
        "async batch, AsyncConnection": lambda: on_conn(
            lambda c: awa_async.reschedule_canonical_attempts(c, batch)
        ),
    }
    return {name: await async_result_of(call) for name, call in calls.items()}


@dataclass
class Settled:
    """The rows of one scenario, read at each step (docs/contract.md#bare-pair)."""

    a: Holder
    b: Holder
    hot: list[dict[str, Any]]
    receipts: list[dict[str, Any]]
    start: Snapshot
    refused: dict[str, object]
    untouched: Snapshot
    moved: object
    after_move: Snapshot
    deferred: list[dict[str, Any]]
    running_after_move: list[RunningAttempt]
    stale_recipe: object
    after_stale: Snapshot
    b_settled: object
    after_b_settled: Snapshot
    stale_b: object
    after_a_completed: Snapshot
    end: Snapshot
    running_at_end: list[RunningAttempt]
    closures: list[dict[str, Any]]
    closure_batches: list[dict[str, Any]]


def settle_beside(pg: EmbeddedPostgres, dbname: str, url: str, engine: sa.Engine) -> Settled:
    """Refuse B's bare pair, settle A, settle B while its runtime holds it, then let A's
    runtime and B's finish, in that order.

    A's runtime is stopped (which waits for its completion of A) while B is still held, so
    whatever that completion wrote is read before B's runtime tries to complete B.
    """

    async def run() -> Settled:
        async with held_pair(pg, dbname, url, engine) as held:
            a, b = held.a, held.b
            mine_a = a.mine
            assert mine_a is not None
            (recipe_a,) = [x for x in b.recipe if not x.on_queue_storage]

            def first() -> tuple[list[dict[str, Any]], list[dict[str, Any]], Snapshot]:
                return (
                    rows(engine, "SELECT * FROM awa.jobs_hot"),
                    rows(engine, "SELECT * FROM awa_qs.lease_claims"),
                    planes(engine),
                )

            hot, receipts, start = await asyncio.to_thread(first)
            refused = await asyncio.to_thread(sync_calls_for_b, engine, b)
            refused |= await async_calls_for_b(held.engine, b)
            untouched = await asyncio.to_thread(planes, engine)
            moved = await asyncio.to_thread(
                result_of, lambda: awa_sa.settle(engine, mine_a, SNOOZE)
            )

            def after_move() -> tuple[Snapshot, list[dict[str, Any]], list[RunningAttempt]]:
                return (
                    planes(engine),
                    rows(engine, "SELECT * FROM awa_qs.deferred_jobs"),
                    running_attempts(engine),
                )

            after, deferred, running_after = await asyncio.to_thread(after_move)
            stale = await asyncio.to_thread(
                result_of, lambda: awa_sa.settle(engine, recipe_a, SNOOZE)
            )
            after_stale = await asyncio.to_thread(planes, engine)
            job_b = b.job
            (listed_b,) = [x for x in b.recipe if x.on_queue_storage]
            b_settled = await asyncio.to_thread(
                result_of, lambda: awa_sa.settle(engine, attempt_of(engine, job_b), COMPLETE)
            )
            after_b_settled = await asyncio.to_thread(planes, engine)
            stale_b = await asyncio.to_thread(
                result_of, lambda: awa_sa.settle(engine, listed_b, SNOOZE)
            )
            a.release.set()
            await held.stop(held.canonical)  # waits for its completion of A
            after_a = await asyncio.to_thread(planes, engine)
            b.release.set()
            await held.stop(held.target)  # waits for its completion of B

            def last() -> tuple[Snapshot, list[RunningAttempt], list[Any], list[Any]]:
                return (
                    planes(engine),
                    running_attempts(engine),
                    rows(engine, "SELECT * FROM awa_qs.lease_claim_closures"),
                    rows(engine, "SELECT * FROM awa_qs.lease_claim_closure_batches"),
                )

            end, running_end, closures, closure_batches = await asyncio.to_thread(last)
            return Settled(
                a=a,
                b=b,
                hot=hot,
                receipts=receipts,
                start=start,
                refused=refused,
                untouched=untouched,
                moved=moved,
                after_move=after,
                deferred=deferred,
                running_after_move=running_after,
                stale_recipe=stale,
                after_stale=after_stale,
                b_settled=b_settled,
                after_b_settled=after_b_settled,
                stale_b=stale_b,
                after_a_completed=after_a,
                end=end,
                running_at_end=running_end,
                closures=closures,
                closure_batches=closure_batches,
            )

    return asyncio.run(run())


@pytest.fixture(scope="module")
def settled(pg: EmbeddedPostgres, real_template: str) -> Iterator[Settled]:
    """One cluster for the whole scenario: its steps are read by the tests below."""
    name = f"settle_{uuid.uuid4().hex[:12]}"
    janitor = _janitor(pg, name, template=real_template)
    janitor.init()
    url = database_url(pg, name)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        yield settle_beside(pg, name, url, engine)
    finally:
        engine.dispose()
        janitor.drop()


def test_every_bare_call_for_the_queue_storage_attempt_is_refused_and_writes_nothing(
    settled: Settled,
) -> None:
    """While both handlers hold, B's pair is A's too: no bare call for B may move A."""
    [hot] = settled.hot
    [receipt] = settled.receipts
    # The collision is real and no sequence was set: both planes' first job, first lease.
    assert (hot["id"], hot["run_lease"], hot["state"]) == (1, 1, "running")
    assert hot["args"] == {"who": "canonical A"}
    assert (receipt["job_id"], receipt["run_lease"], receipt["closed_at"]) == (1, 1, None)
    first = dict(settled.start["sequences"])
    assert (first["awa.jobs_id_seq"], first["awa_qs.job_id_seq"]) == (1, 1)
    b = settled.b.mine
    assert b is not None
    assert (b.storage, b.job_id, b.run_lease, b.receipt_id) == (
        "awa_qs",
        1,
        1,
        receipt["receipt_id"],
    )

    assert len(settled.refused) == 10  # bare and batch, sync and async, every form
    for name, result in settled.refused.items():
        assert isinstance(result, QueueStorageAttempt), (name, result)
        assert (result.job_id, result.run_lease, result.schema) == (1, 1, "awa_qs"), name
        assert result.canonical_too, name  # the bare pair names A too
    assert changed(settled.start, settled.untouched) == set()


def test_settle_with_as_attempt_moves_a_alone(settled: Settled) -> None:
    """``settle`` given A's attempt, as ``attempt_of`` resolved A's job, moves A and only A."""
    a, b = settled.a.mine, settled.b.mine
    assert a is not None
    assert b is not None
    [hot] = settled.hot
    moved = settled.moved
    assert isinstance(moved, Migrated), moved
    # A fresh id from awa_qs.job_id_seq, which B's enqueue had taken to 1.
    assert moved.job_id == dict(settled.after_move["sequences"])["awa_qs.job_id_seq"] == 2
    assert moved.attempt == a.attempt - 1 == 0
    [successor] = settled.deferred
    assert successor["job_id"] == moved.job_id
    assert successor["args"] == {"who": "canonical A"}
    assert (successor["kind"], successor["queue"], successor["state"]) == (
        "mail",
        "mail",
        "scheduled",
    )
    assert (successor["run_at"], successor["attempt"]) == (moved.run_at, 0)
    assert successor["created_at"] == hot["created_at"]
    # Exactly the tables a migration writes (docs/contract.md#queue-storage): A's row leaves
    # jobs_hot, its successor enters deferred_jobs, the dirty marks and the id sequence move.
    # Every receipt table of awa_qs, B's open claim among them, is as it was.
    assert changed(settled.untouched, settled.after_move) == {
        "awa.jobs_hot",
        "awa.admin_dirty_queue_marks",
        "awa.admin_dirty_kind_marks",
        "awa_qs.deferred_jobs",
        "sequences",
    }
    assert settled.after_move["awa.jobs_hot"] == []
    [still] = settled.running_after_move
    assert (still.storage, still.job_id, still.run_lease, still.receipt_id) == (
        "awa_qs",
        1,
        1,
        b.receipt_id,
    )
    assert still.args == {"who": "queue storage B"}


def test_b_settled_beside_its_runtime_and_each_runtime_then_finishes(settled: Settled) -> None:
    """awa-sa completes B while B's runtime holds it; A's runtime then completes A after
    awa-sa moved it, and B's runtime completes B: both find nothing and write nothing."""
    a, b = settled.a, settled.b
    assert b.mine is not None
    assert settled.b_settled == Completed(1)
    # awa-sa seals B's receipt (lease_claims.closed_at) where the runtime's fast path does not:
    # a deadline rescue honours that column alone (docs/contract.md#sealed-receipts).
    assert changed(settled.after_stale, settled.after_b_settled) <= CLOSING | {
        "awa_qs.attempt_state",
        "awa_qs.lease_claims",
    }
    assert isinstance(settled.stale_b, Stale)  # settled once: the recipe's B is Stale now
    # A's runtime was stopped after A's handler returned, while B's still held: its
    # completion of A found nothing to complete, and wrote nothing anywhere; it ran A once.
    assert (a.calls, a.returned) == (1, True)
    assert changed(settled.after_b_settled, settled.after_a_completed) == set()
    # Then B's runtime completed B, which awa-sa had closed: nothing written, B run once.
    assert (b.calls, b.returned) == (1, True)
    assert changed(settled.after_a_completed, settled.end) == set()
    assert settled.running_at_end == []
    closed = [(c["job_id"], c["run_lease"], c["outcome"]) for c in settled.closures] + [
        (1, 1, c["outcome"])
        for c in settled.closure_batches
        if b.mine.receipt_id in c["receipt_ids"]
    ]
    assert closed == [(1, 1, "completed")]
    assert len(settled.closure_batches) + len(settled.closures) == 1  # nothing closed for A
    # A stays where awa-sa put it: not retried, not completed, not back in jobs_hot.
    for table in ("awa.jobs_hot", "awa_qs.deferred_jobs", "awa_qs.ready_entries"):
        assert settled.end[table] == settled.after_move[table], table


def test_the_old_recipe_lists_both_and_each_settles_on_its_own_plane(settled: Settled) -> None:
    """``running_attempts(conn, job_id=job.id, attempt=job.attempt)`` in B's handler, which
    once returned A's row alone, lists both attempts, each naming its plane."""
    a, b = settled.a.mine, settled.b.mine
    assert a is not None
    assert b is not None
    for holder in (settled.a, settled.b):
        listed = holder.recipe
        assert [(x.storage, x.job_id, x.run_lease) for x in listed] == [
            (CANONICAL, 1, 1),
            ("awa_qs", 1, 1),
        ]
        assert _same_claim(listed[0], a)
        assert _same_claim(listed[1], b)
        assert [x.args["who"] for x in listed] == ["canonical A", "queue storage B"]
    # The recipe's A, once A has moved, is Stale: its own plane has nothing left under the
    # pair, and B's open claim under the same pair is not looked at, nor written.
    assert isinstance(settled.stale_recipe, Stale)
    assert changed(settled.after_move, settled.after_stale) == set()


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
    statements: dict[str, int]
    """How many statements ``attempt_of`` sent for each holder's job, while it was running."""


def statements_of(engine: sa.Engine, job: Any) -> int:
    sent: list[str] = []

    def count(*args: Any) -> None:
        sent.append(args[2])

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        attempt_of(engine, job)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    return len(sent)


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
        # empty cluster finalizes it to queue storage in schema awa, leader or not. No runtime
        # leads: a promotion (the failed attempt's backoff is 2-2.5 s) or a ring's prune would
        # take the rows read below before a loaded shutdown is over.
        leader = await asyncio.to_thread(hold_leadership, engine)
        await client.start(queues, heartbeat_interval_ms=STILL)
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
                list[RunningAttempt],
                dict[str, Any],
                list[Any],
                list[Any],
                list[Any],
                dict[str, int],
            ]:
                return (
                    running_attempts(engine),
                    state(engine),
                    rows(engine, "SELECT * FROM awa.lease_claims ORDER BY job_id"),
                    rows(engine, "SELECT * FROM awa.lease_claim_batches"),
                    rows(engine, "SELECT * FROM awa.leases"),
                    {name: statements_of(engine, h.job) for name, h in holders.items()},
                )

            listed, phase, receipts, batches, leases_, sent = await asyncio.to_thread(read)
            # Every handler has returned before the shutdown starts: a handler still held when
            # it does is the shutdown's to end, not the runtime's ending under test.
            release.set()
            for holder in holders.values():
                await within(holder.done)
        finally:
            go.set()
            release.set()
            await client.shutdown()
            await client.close()
            await async_engine.dispose()
            leader.close()

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
            holders, listed, phase, receipts, batches, leases_, after, ended, stale_job, stale, sent
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

    # A lease_claims receipt in the default schema in one statement (routing, the canonical row
    # and the receipt); a compact or materialised one read on by the listing.
    assert fresh.statements == {"row": 1, "flaky": 1, "compact": 2, "cb": 2}, fresh.statements

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
    assert {"job_id": flaky.job_id, "run_lease": 1} in fresh.ended["deferred_jobs"], (
        fresh.ended,
        fresh.holders["flaky"].calls,
    )
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
