"""A real awa-pg 0.6.9 worker claims and completes the jobs awa-sa enqueued, on both planes.

awa-sa enqueues in the caller's transaction and commits; the published runtime then claims
each job (canonical ``jobs_hot``, or the routing schema's ready entries once queue storage is
active), hands its handler the arguments awa-sa wrote (a dataclass back as that dataclass),
and completes it.

One more worker run per plane (the module's ``ran``) serves the other proofs:

* jobs awa-sa enqueued with a ``run_at`` about a second ahead, once the worker is claiming,
  reach their handler no earlier than ``run_at`` and end completed (Awa's promotion, not
  awa-sa, makes them available);
* a handler that, in one transaction of its own, finds its attempt (``attempt_of``), settles
  it ``Complete`` and enqueues its follow-up job with awa-sa: the follow-up is claimed and
  completed, and the first job ends completed once, the runtime's own completion finding
  nothing left to do. The same handler raising after the enqueue rolls both back: no
  follow-up, and the runtime fails the job it still holds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import Cluster, cloned
from runtimes import STILL, pg_url, until_idle
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa
import awa_sa.asyncio as awa_sa_asyncio
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

WAIT_SECS = 60


@dataclass
class Greet:
    name: str
    times: int


@pytest.fixture
def cluster(real_plane: Cluster) -> Cluster:
    return real_plane


def test_a_real_worker_claims_and_completes_what_awa_sa_enqueued(cluster: Cluster) -> None:
    with cluster.engine.connect() as conn:
        jobs = awa_sa.enqueue_many(
            conn,
            [
                awa_sa.NewJob(Greet("ada", 2), queue="q"),
                awa_sa.NewJob({"n": 1}, kind="raw", queue="q", tags=["t"], unique_opts={}),
                awa_sa.NewJob({"n": 2}, kind="raw", queue="q", priority=1, ordering_key="k"),
            ],
        )
        conn.commit()
    routing = _scalar(cluster.engine, "SELECT awa.active_queue_storage_schema()")
    seen: dict[int, Any] = {}
    done = asyncio.Event()

    async def handle(job: Any) -> None:
        seen[job.id] = job.args
        if len(seen) == len(jobs):
            done.set()

    async def run() -> None:
        client = awa.AsyncClient(pg_url(cluster.url))
        client.task(Greet, queue="q")(handle)
        client.task(dict, kind="raw", queue="q")(handle)
        await client.start(
            [("q", 2)],
            poll_interval_ms=20,
            heartbeat_interval_ms=600_000,
            queue_storage_schema=routing,
        )
        try:
            await asyncio.wait_for(done.wait(), WAIT_SECS)
            await until_idle(client, WAIT_SECS)
        finally:
            await client.shutdown()
            await client.close()

    asyncio.run(run())
    assert seen == {
        jobs[0].id: Greet("ada", 2),
        jobs[1].id: {"n": 1},
        jobs[2].id: {"n": 2},
    }
    states = _states(cluster.engine)
    assert states == {job.id: "completed" for job in jobs}


def _scalar(engine: sa.Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql)).scalar()


def _states(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, state::text FROM awa.jobs"))
        return {int(job_id): state for job_id, state in rows}


# ---------------------------------------------- scheduled jobs, and a handler's own follow-up


@dataclass
class Due:
    n: int


@dataclass
class Settles:
    fail: bool


@dataclass
class FollowUp:
    parent: int


class Boom(Exception):
    """Raised by a handler after its enqueue, so that its transaction rolls back."""


@dataclass
class Ran:
    """One worker run on one plane: what awa-sa enqueued, what the handlers saw and did."""

    cluster: Cluster
    routing: str | None
    settles: dict[bool, awa_sa.EnqueuedJob]
    """The two ``Settles`` jobs, by their ``fail``."""
    due: list[awa_sa.EnqueuedJob] = field(default_factory=list)
    calls: Counter[int] = field(default_factory=Counter)
    due_seen_at: dict[int, datetime] = field(default_factory=dict)
    """Each ``Due`` job's id, and the handler's clock when it was handed the job."""
    attempts: dict[int, awa_sa.RunningAttempt] = field(default_factory=dict)
    settled: dict[int, awa_sa.Ending] = field(default_factory=dict)
    follow_up_of: dict[int, int] = field(default_factory=dict)
    """A ``Settles`` job's id, and the id awa-sa's enqueue in its handler answered."""
    followed: dict[int, FollowUp] = field(default_factory=dict)
    """A follow-up's id, and the args its handler was given."""
    errors: list[BaseException] = field(default_factory=list)


class Worker:
    """The handlers of :class:`Ran`'s run, each setting an event the test waits on."""

    def __init__(self, ran: Ran, engine: AsyncEngine) -> None:
        self.ran = ran
        self.engine = engine
        self.claiming = asyncio.Event()
        self.settles_done = {True: asyncio.Event(), False: asyncio.Event()}
        self.followed = asyncio.Event()
        self.all_due = asyncio.Event()
        self.client = awa.AsyncClient(pg_url(ran.cluster.url))
        self.client.task(Settles, queue="q")(self.settles)
        self.client.task(FollowUp, queue="q")(self.follow_up)
        self.client.task(Due, queue="q")(self.due)

    async def settles(self, job: Any) -> None:
        """The handler's one transaction: attempt, settle, follow-up; or all of it undone."""
        self.ran.calls[job.id] += 1
        self.claiming.set()
        try:
            async with self.engine.begin() as conn:
                mine = await awa_sa_asyncio.attempt_of(conn, job)
                self.ran.attempts[job.id] = mine
                self.ran.settled[job.id] = await awa_sa_asyncio.settle(
                    conn, mine, awa_sa.Complete()
                )
                follow_up = await awa_sa_asyncio.enqueue(conn, FollowUp(job.id), queue="q")
                self.ran.follow_up_of[job.id] = follow_up.id
                if job.args.fail:
                    raise Boom(job.id)
        except Boom:
            raise
        except BaseException as exc:  # reported by the test, not only by the runtime's log
            self.ran.errors.append(exc)
            raise
        finally:
            self.settles_done[job.args.fail].set()

    async def follow_up(self, job: Any) -> None:
        self.ran.calls[job.id] += 1
        self.ran.followed[job.id] = job.args
        self.followed.set()

    async def due(self, job: Any) -> None:
        self.ran.due_seen_at[job.id] = datetime.now(UTC)
        self.ran.calls[job.id] += 1
        self.due_check()

    def due_check(self) -> None:
        """Every Due job handled: checked by the handler and once the enqueue has answered,
        since on a busy machine the jobs can come due, and run, before it has."""
        if self.ran.due and set(self.ran.due_seen_at) >= {job.id for job in self.ran.due}:
            self.all_due.set()


async def within(event: asyncio.Event, ran: Ran, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), WAIT_SECS)
    except TimeoutError:
        raise AssertionError(f"{what} within {WAIT_SECS} s; handler errors: {ran.errors}") from None


async def work(ran: Ran) -> None:
    """Run the worker until every handler has run and every completion is flushed.

    The ``Due`` jobs are enqueued once the worker is claiming (a ``Settles`` handler has been
    called), so that the worker is polling, and promoting, before their ``run_at`` comes.
    """
    engine = create_async_engine(ran.cluster.url)
    worker = Worker(ran, engine)
    client = worker.client
    await client.start(
        [("q", 4)],
        poll_interval_ms=20,
        heartbeat_interval_ms=600_000,
        leader_election_interval_ms=100,
        promote_interval_ms=50,
        queue_storage_schema=ran.routing,
        # No ring rotates, so none is pruned: the closures are read afterwards.
        queue_storage_queue_rotate_interval_ms=STILL,
        queue_storage_lease_rotate_interval_ms=STILL,
        queue_storage_claim_rotate_interval_ms=STILL,
    )
    try:
        await within(worker.claiming, ran, "no Settles job was claimed")
        run_at = datetime.now(UTC) + timedelta(seconds=1)
        # A list of args under one set of keywords (one ``shared`` statement), as the
        # Settles jobs below: a real worker runs those as it runs NewJobs.
        ran.due = await awa_sa_asyncio.enqueue_many(
            engine, [Due(n) for n in range(2)], queue="q", run_at=run_at
        )
        worker.due_check()
        for fail, event in worker.settles_done.items():
            await within(event, ran, f"the Settles(fail={fail}) handler did not run")
        assert not ran.errors, ran.errors  # else no follow-up is coming: stop here
        await within(worker.followed, ran, "the follow-up was not handled")
        await within(worker.all_due, ran, "the Due jobs were not handled")
        await until_idle(client, WAIT_SECS)
    finally:
        await client.shutdown()
        await client.close()
        await engine.dispose()


@pytest.fixture(scope="module", params=["canonical", "active"])
def ran(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[Ran]:
    """One worker run on a fresh ``awa migrate`` clone of each plane, shared by the tests."""
    with cloned(pg, awa_databases, real_template) as url:
        yield from _ran(request.param, pg, url)


def _ran(phase: str, pg: EmbeddedPostgres, url: str) -> Iterator[Ran]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        cluster = Cluster("real", pg, url, engine)
        cluster.set_phase(phase, "awa_qs")
        routing = _scalar(engine, "SELECT awa.active_queue_storage_schema()")
        with engine.connect() as conn:
            settles = awa_sa.enqueue_many(
                conn, [Settles(fail) for fail in (False, True)], queue="q", max_attempts=1
            )
            conn.commit()
        found = Ran(cluster, routing, {job.args["fail"]: job for job in settles})
        asyncio.run(work(found))
        yield found
    finally:
        engine.dispose()


def _rows(engine: sa.Engine) -> dict[int, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, kind, state::text AS state, attempt, run_at, attempted_at, args"
                " FROM awa.jobs"
            )
        ).mappings()
        return {int(row["id"]): dict(row) for row in rows}


def test_scheduled_jobs_are_claimed_once_due_and_completed(ran: Ran) -> None:
    assert [job.state for job in ran.due] == ["scheduled", "scheduled"]
    rows = _rows(ran.cluster.engine)
    for job in ran.due:
        assert ran.calls[job.id] == 1
        assert ran.due_seen_at[job.id] >= job.run_at  # not handed out before its run_at
        row = rows[job.id]
        assert (row["kind"], row["state"], row["attempt"]) == ("due", "completed", 1)
        assert row["attempted_at"] >= job.run_at  # claimed, on the database's clock, once due


def test_a_handler_settles_and_enqueues_its_follow_up_in_one_transaction(ran: Ran) -> None:
    first = ran.settles[False]
    assert not ran.errors
    assert ran.calls[first.id] == 1
    assert ran.settled[first.id] == awa_sa.Completed(first.id)
    follow_up = ran.follow_up_of[first.id]
    assert ran.followed == {follow_up: FollowUp(first.id)}
    assert ran.calls[follow_up] == 1
    rows = _rows(ran.cluster.engine)
    assert (rows[first.id]["state"], rows[first.id]["attempt"]) == ("completed", 1)
    assert (rows[follow_up]["kind"], rows[follow_up]["state"]) == ("follow_up", "completed")
    # Completed once: the runtime's own completion, after the handler returned, closed nothing.
    attempt = ran.attempts[first.id]
    if ran.routing is not None:
        assert _closures(ran.cluster.engine, ran.routing, attempt) == 1


def test_a_handler_whose_transaction_rolls_back_leaves_no_follow_up(ran: Ran) -> None:
    failing = ran.settles[True]
    assert ran.calls[failing.id] == 1
    assert ran.settled[failing.id] == awa_sa.Completed(failing.id)  # then rolled back
    rows = _rows(ran.cluster.engine)
    assert ran.follow_up_of[failing.id] not in rows
    assert [row["args"] for row in rows.values() if row["kind"] == "follow_up"] == [
        {"parent": ran.settles[False].id}
    ]
    # The settle was undone with it: the runtime found its attempt running, and failed it.
    assert (rows[failing.id]["state"], rows[failing.id]["attempt"]) == ("failed", 1)


def _closures(engine: sa.Engine, schema: str, attempt: awa_sa.RunningAttempt) -> int:
    """How many times the queue-storage receipt of *attempt* was closed."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    f"SELECT (SELECT count(*) FROM {schema}.lease_claim_closures"
                    "         WHERE job_id = :job AND run_lease = :lease)"
                    f"     + (SELECT count(*) FROM {schema}.lease_claim_closure_batches"
                    "         WHERE CAST(:receipt AS bigint) = ANY(receipt_ids))"
                ),
                {"job": attempt.job_id, "lease": attempt.run_lease, "receipt": attempt.receipt_id},
            ).scalar_one()
        )
