"""Administering canonical jobs: awa-sa writes what awa-pg 0.6.9's own Client writes (issue 37).

Twin clusters, each a clone of the ``awa migrate`` template, get the same jobs in the same
order. On each a real awa-pg worker makes the states a verb starts from: a failed job (its
handler raises ``TerminalError``), a cancelled one (it returns ``awa.Cancel``), a retryable one
(it raises with attempts left), a running one (its handler holds the attempt until told it is
cancelled), another running with a callback registered (held the same way), two parked in
``waiting_external`` (their handler registers a callback and returns ``WaitForCallback``);
available and scheduled jobs sit on a queue no worker serves. A side session holds
Awa's maintenance-leader lock throughout, so no promotion, rescue or mark recompute runs.

Then each verb runs on both: awa-pg's ``AsyncClient`` method on one cluster, awa-sa's call on
the other inside a caller's transaction that also commits a business row. Compared, per step:
the rows of ``awa.jobs_hot`` and ``awa.scheduled_jobs`` that changed, each cell named as kept
(the value before the step), ``now`` (the step's transaction time, which the dirty marks carry)
or its value; the unique claims that changed; the dirty marks appended; and every NOTIFY the
step sent, channel and payload. The running attempts are cancelled while the worker is live on
both: each handler is told (``job.is_cancelled()``), returns, and the runtime's completion of
that attempt changes nothing. One cluster pair and one worker run per cluster serve every step.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import awa
import psycopg
import pytest
import sqlalchemy as sa
from conftest import cloned
from runtimes import hold_leadership, pg_url

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

IDLE = "idle_q"
WORK = "work_q"
OTHER = "other_q"
TABLES = ("jobs_hot", "scheduled_jobs")
MARKS = (
    ("admin_dirty_queue_marks", "admin_dirty_queues", "queue"),
    ("admin_dirty_kind_marks", "admin_dirty_kinds", "kind"),
)
"""Appended marks (awa-cli 0.6.8+), or keyed ones (0.6.6, 0.6.7): the trigger names which."""


def mark_tables(conn: sa.Connection) -> list[tuple[str, str]]:
    body = conn.execute(
        sa.text("SELECT prosrc FROM pg_proc WHERE proname = 'mark_dirty_keys_update'")
    ).scalar_one()
    return [(appended if appended in body else keyed, c) for appended, keyed, c in MARKS]


def clear_marks(engine: sa.Engine) -> None:
    """Each step starts with no marks, so what is there after is the step's (keyed marks add
    nothing for a key already marked)."""
    with engine.begin() as conn:
        for table, _ in mark_tables(conn):
            conn.execute(sa.text(f"DELETE FROM awa.{table}"))


MARKER = "awa_sa_test_step"


@dataclass
class Fails:
    n: int


@dataclass
class Cancels:
    n: int


@dataclass
class Retries:
    n: int


@dataclass
class Holds:
    n: int


@dataclass
class Waits:
    n: int


@dataclass
class Calls:
    n: int


class Worker:
    """A real awa-pg worker: each handler answers as its kind says; ``holds`` keeps its attempt
    until the runtime tells it the job was cancelled, then returns (a completion)."""

    def __init__(self, url: str) -> None:
        self.client = awa.AsyncClient(url)
        self.holding = asyncio.Event()
        self.told = asyncio.Event()
        self.calling = asyncio.Event()
        self.told_calling = asyncio.Event()
        self.runs: Counter[str] = Counter()
        self.client.task(Fails, kind="fails", queue=WORK)(self.fails)
        self.client.task(Cancels, kind="cancels", queue=WORK)(self.cancels)
        self.client.task(Retries, kind="retries", queue=WORK)(self.retries)
        self.client.task(Holds, kind="holds", queue=WORK)(self.holds)
        self.client.task(Waits, kind="waits", queue=WORK)(self.waits)
        self.client.task(Calls, kind="calls", queue=WORK)(self.calls)
        self.client.task(Fails, kind="bulk", queue=WORK)(self.fails)
        self.client.task(Fails, kind="junk", queue=WORK)(self.fails)
        self.client.task(Fails, kind="fails", queue=OTHER)(self.fails)

    async def fails(self, job: Any) -> Any:
        self.runs["fails"] += 1
        raise awa.TerminalError("broken for good")

    async def cancels(self, job: Any) -> Any:
        self.runs["cancels"] += 1
        return awa.Cancel("not wanted")

    async def retries(self, job: Any) -> Any:
        self.runs["retries"] += 1
        raise RuntimeError("try again")

    async def holds(self, job: Any) -> Any:
        self.runs["holds"] += 1
        self.holding.set()
        while not job.is_cancelled():  # the handler's own pace, as a real one polls
            await asyncio.sleep(0.01)
        self.told.set()

    async def calls(self, job: Any) -> Any:
        self.runs["calls"] += 1
        await job.register_callback(timeout_seconds=3600)
        self.calling.set()
        while not job.is_cancelled():  # the handler's own pace, as a real one polls
            await asyncio.sleep(0.01)
        self.told_calling.set()

    async def waits(self, job: Any) -> Any:
        self.runs["waits"] += 1
        token = await job.register_callback(timeout_seconds=3600)
        return awa.WaitForCallback(token)


JOBS: list[tuple[Any, dict[str, Any]]] = [
    ({"n": 1}, {"kind": "idle", "queue": IDLE}),
    ({"n": 2}, {"kind": "idle", "queue": IDLE, "run_at": "later"}),
    (Fails(3), {"queue": WORK, "unique_opts": {"by_args": True}}),
    (Cancels(4), {"queue": WORK}),
    (Retries(5), {"queue": WORK, "max_attempts": 5}),
    (Holds(6), {"queue": WORK}),
    (Fails(7), {"kind": "bulk", "queue": WORK}),
    (Fails(8), {"kind": "bulk", "queue": WORK, "tags": ["t"], "metadata": {"m": 1}}),
    (Fails(9), {"kind": "junk", "queue": WORK}),
    (Fails(10), {"kind": "junk", "queue": WORK}),
    (Fails(11), {"queue": OTHER}),
    (Waits(12), {"queue": WORK, "unique_opts": {"by_args": True}}),
    (Waits(13), {"queue": WORK, "unique_opts": {"by_args": True}, "tags": ["w"]}),
    (Calls(14), {"queue": WORK}),
]
"""Ids 1 to 14 on both clusters, each the starting state of one step."""
AVAILABLE, SCHEDULED, FAILED, CANCELLED, RETRYABLE, RUNNING = range(1, 7)
BULK = (7, 8)
JUNK = (9, 10)
ELSEWHERE = 11
WAITING = (12, 13)
"""Parked by their handler on a callback it registered: ``waiting_external``."""
CALLING = 14
"""Running, its handler holding it with a callback registered until told it is cancelled."""
SETTLED = {FAILED: "failed", CANCELLED: "cancelled", RETRYABLE: "retryable", RUNNING: "running"}
SETTLED |= dict.fromkeys((*BULK, *JUNK, ELSEWHERE), "failed")
SETTLED |= dict.fromkeys(WAITING, "waiting_external")
SETTLED[CALLING] = "running"


def states(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, state::text FROM awa.jobs_hot UNION ALL "
                "SELECT id, state::text FROM awa.scheduled_jobs"
            )
        )
        return dict(rows.all())


async def until(engine: sa.Engine, wanted: Callable[[dict[int, str]], bool], what: str) -> None:
    for _ in range(1200):
        if wanted(await asyncio.to_thread(states, engine)):
            return
        await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
    raise AssertionError(f"{what} within 60 s: {await asyncio.to_thread(states, engine)}")


@dataclass
class Side:
    """One cluster: its engine, a live worker, and a listener for every NOTIFY."""

    url: str
    engine: sa.Engine
    listener: psycopg.Connection[Any]
    worker: Worker | None = None

    def notices(self) -> list[tuple[str, str]]:
        """The NOTIFYs since the last call: up to the marker this call sends after them."""
        with self.engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": MARKER})
        got: list[tuple[str, str]] = []
        for note in self.listener.notifies(timeout=30):
            if note.channel == MARKER:
                return got
            got.append((note.channel, note.payload))
        raise AssertionError("the step's marker NOTIFY never arrived")


def snapshot(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        jobs = {}
        for table in TABLES:
            for row in conn.execute(sa.text(f"SELECT * FROM awa.{table}")).mappings():
                jobs[row["id"]] = {"table": table, **row}
        claims = set(conn.execute(sa.text("SELECT * FROM awa.job_unique_claims")).all())
        marks: list[tuple[str, str, dt.datetime]] = []
        for table, column in mark_tables(conn):
            marks += conn.execute(
                sa.text(f"SELECT '{table}', {column}, touched_at FROM awa.{table}")
            )
    return {"jobs": jobs, "claims": claims, "marks": Counter(marks)}


def change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a step did, with every cell named so that two clusters' steps compare."""
    added = after["marks"] - before["marks"]
    stamps = {at for _, _, at in added}
    assert len(stamps) <= 1, stamps  # one transaction: one now()
    now = next(iter(stamps), None)
    jobs: dict[int, dict[str, Any] | None] = {}
    for job_id in before["jobs"].keys() | after["jobs"].keys():
        old, new = before["jobs"].get(job_id), after["jobs"].get(job_id)
        if old == new:
            continue
        if new is None:
            jobs[job_id] = None
            continue
        jobs[job_id] = {
            column: "kept"
            if old is not None and old.get(column) == value
            else "now"
            if value is not None and value == now
            else value
            for column, value in new.items()
        }
    return {
        "jobs": jobs,
        "claims": {
            "gone": sorted(j for _, j in before["claims"] - after["claims"]),
            "taken": sorted(j for _, j in after["claims"] - before["claims"]),
        },
        "marks": Counter((table, value) for table, value, _ in added.elements()),
    }


def job_of_pg(job: Any) -> tuple[Any, ...] | None:
    if job is None:
        return None
    return (
        job.id,
        job.kind,
        job.queue,
        str(job.state).rsplit(".", 1)[-1].lower(),
        job.attempt,
        job.args,
    )


def job_of_sa(job: awa_sa.JobRow | None) -> tuple[Any, ...] | None:
    if job is None:
        return None
    return (job.id, job.kind, job.queue, job.state, job.attempt, job.args)


async def _start(side: Side) -> None:
    """The jobs, then a live worker that leaves each in its state; running stays held."""
    side.worker = worker = Worker(pg_url(side.url))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    for args, given in JOBS:
        options = dict(given)
        if options.pop("run_at", None):
            options["run_at"] = later
        await worker.client.insert(args, **options)
    await worker.client.start(
        [(WORK, 8), (OTHER, 2)], promote_interval_ms=600_000, heartbeat_interval_ms=600_000
    )
    await asyncio.wait_for(worker.holding.wait(), 60)
    await asyncio.wait_for(worker.calling.wait(), 60)
    await until(
        side.engine,
        lambda found: all(found.get(i) == s for i, s in SETTLED.items()),
        "the worker did not leave every job in its state",
    )


@pytest.fixture(scope="module")
def sides(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[tuple[Side, Side]]:
    with ExitStack() as stack:
        made = []
        for _ in range(2):
            url = stack.enter_context(cloned(pg, awa_databases, real_template))
            engine = sa.create_engine(url)
            stack.callback(engine.dispose)
            listener = psycopg.connect(pg_url(url), autocommit=True)
            stack.callback(listener.close)
            for channel in ("awa:cancel", f"awa:{WORK}", f"awa:{IDLE}", MARKER):
                listener.execute(f'LISTEN "{channel}"')
            made.append(Side(url, engine, listener))
        yield made[0], made[1]


def pg_call(url: str, call: Callable[[awa.AsyncClient], Any]) -> Any:
    """*call* on a new awa-pg client; awa-pg's "job not found" read as None."""

    async def run() -> Any:
        client = awa.AsyncClient(pg_url(url))
        try:
            return await call(client)
        except awa.AwaError as exc:
            if str(exc).startswith("job not found"):
                return None
            raise
        finally:
            await client.close()

    return asyncio.run(run())


def sa_call(side: Side, call: Callable[[sa.Connection], Any]) -> Any:
    """*call* in a caller's transaction that also commits a business row."""
    with side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO business (note) VALUES ('paid')"))
        return call(conn)


def twin_step(
    sides: tuple[Side, Side],
    on_pg: Callable[[awa.AsyncClient], Any],
    on_sa: Callable[[sa.Connection], Any],
    *,
    bulk: bool = False,
    notes: list[tuple[str, str]] | None = None,
) -> tuple[Any, Any]:
    """Run a verb on both clusters; assert the two did the same; both results.

    A *bulk* verb's dirty marks are compared as the set of queues and kinds marked: through
    the view awa-pg writes each row in statements of its own, two marks per row; awa-sa's
    one statement writes two per queue and kind (docs/administer.md). The NOTIFYs both sent
    are appended to *notes* when given.
    """
    pg_side, sa_side = sides
    for side in sides:
        clear_marks(side.engine)
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    paid = business(sa_side.engine)
    got_pg = pg_call(pg_side.url, on_pg)
    got_sa = sa_call(sa_side, on_sa)
    assert business(sa_side.engine) == paid + 1
    pg_change = change(before[0], snapshot(pg_side.engine))
    sa_change = change(before[1], snapshot(sa_side.engine))
    if bulk:
        for made in (pg_change, sa_change):
            made["marks"] = set(made["marks"])
    assert sa_change == pg_change
    heard = sa_side.notices()
    assert heard == pg_side.notices()
    if notes is not None:
        notes += heard
    return got_pg, got_sa


def business(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM business")).scalar_one())


@pytest.fixture(scope="module")
def live(sides: tuple[Side, Side]) -> dict[str, Any]:
    """Both clusters' jobs in their states, and the running attempts (one with a callback
    registered) cancelled beside their live worker: by awa-pg's Client on one, by awa-sa in a
    caller's transaction on the other."""
    pg_side, sa_side = sides
    found: dict[str, Any] = {}

    async def run(side: Side, cancel: Callable[[int], Any]) -> None:
        leader = await asyncio.to_thread(hold_leadership, side.engine)
        try:
            await _start(side)
            assert side.worker is not None
            side.notices()
            await asyncio.to_thread(clear_marks, side.engine)
            before = await asyncio.to_thread(snapshot, side.engine)
            found[f"{side is sa_side}:job"] = await cancel(RUNNING)
            await asyncio.wait_for(side.worker.told.wait(), 30)
            found[f"{side is sa_side}:notices"] = await asyncio.to_thread(side.notices)
            after = await asyncio.to_thread(snapshot, side.engine)
            found[f"{side is sa_side}:change"] = change(before, after)
            # The attempt with a callback, in a window of its own (one transaction's marks).
            await asyncio.to_thread(clear_marks, side.engine)
            before = await asyncio.to_thread(snapshot, side.engine)
            found[f"{side is sa_side}:calling"] = await cancel(CALLING)
            await asyncio.wait_for(side.worker.told_calling.wait(), 30)
            found[f"{side is sa_side}:calling_notices"] = await asyncio.to_thread(side.notices)
            await side.worker.client.shutdown()  # the handlers returned: completions land
            after = await asyncio.to_thread(snapshot, side.engine)
            found[f"{side is sa_side}:calling_change"] = change(before, after)
            found[f"{side is sa_side}:runs"] = side.worker.runs
        finally:
            if side.worker is not None:
                await side.worker.client.close()
            await asyncio.to_thread(leader.close)

    for side in sides:
        with side.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE business (note text)"))
    asyncio.run(run(pg_side, lambda job_id: pg_call_async(pg_side.worker, job_id)))
    asyncio.run(
        run(
            sa_side,
            lambda job_id: asyncio.to_thread(
                sa_call, sa_side, lambda c: awa_sa.cancel_job(c, job_id)
            ),
        )
    )
    return found


async def pg_call_async(worker: Worker | None, job_id: int) -> Any:
    assert worker is not None
    return await worker.client.cancel(job_id)


def test_a_running_attempt_cancelled_beside_its_worker_stops_and_ends_once(
    live: dict[str, Any],
) -> None:
    for key in ("job", "calling"):
        assert job_of_sa(live[f"True:{key}"]) == job_of_pg(live[f"False:{key}"])
        assert live[f"True:{key}"].state == "cancelled"
    assert live["True:calling"].callback_id is None
    for key, job_id in (("", RUNNING), ("calling_", CALLING)):
        assert (
            live[f"True:{key}notices"]
            == live[f"False:{key}notices"]
            == [("awa:cancel", f'{{"job_id":{job_id},"run_lease":1}}')]
        )
        assert live[f"True:{key}change"] == live[f"False:{key}change"]
        # The cancelled job alone changed: the completions after it changed nothing.
        assert list(live[f"True:{key}change"]["jobs"]) == [job_id]
        assert live[f"True:{key}change"]["jobs"][job_id]["state"] == "cancelled"
    assert live["True:calling_change"]["jobs"][CALLING]["callback_id"] is None
    # Each handler ran once, was told, and its completion changed nothing.
    for kind in ("holds", "calls"):
        assert live["True:runs"][kind] == live["False:runs"][kind] == 1


def test_a_rollback_leaves_every_job_as_it_was(
    live: dict[str, Any], sides: tuple[Side, Side]
) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        assert awa_sa.cancel_job(conn, AVAILABLE) is not None
        assert awa_sa.retry_job(conn, FAILED) is not None
        assert awa_sa.retry_failed(conn, kind="bulk").matched == len(BULK)
        assert awa_sa.discard_failed(conn, "junk") == len(JUNK)
        conn.rollback()
    assert snapshot(sa_side.engine) == before
    assert sa_side.notices() == []


@pytest.mark.parametrize(
    "job_id", [AVAILABLE, SCHEDULED, RETRYABLE], ids=["available", "scheduled", "retryable"]
)
def test_cancel_writes_what_awa_pg_writes(
    live: dict[str, Any], sides: tuple[Side, Side], job_id: int
) -> None:
    got_pg, got_sa = twin_step(
        sides, lambda c: c.cancel(job_id), lambda conn: awa_sa.cancel_job(conn, job_id)
    )
    assert job_of_sa(got_sa) == job_of_pg(got_pg)
    assert got_sa.state == "cancelled"
    # Terminal now: awa-pg refuses ("job not found"), awa-sa answers None; neither writes.
    again = twin_step(
        sides, lambda c: c.cancel(job_id), lambda conn: awa_sa.cancel_job(conn, job_id)
    )
    assert again == (None, None)


@pytest.mark.parametrize(
    "job_id", [FAILED, CANCELLED, RUNNING], ids=["failed", "cancelled", "cancelled_running"]
)
def test_retry_writes_what_awa_pg_writes(
    live: dict[str, Any], sides: tuple[Side, Side], job_id: int
) -> None:
    got_pg, got_sa = twin_step(
        sides, lambda c: c.retry(job_id), lambda conn: awa_sa.retry_job(conn, job_id)
    )
    assert job_of_sa(got_sa) == job_of_pg(got_pg)
    assert got_sa.state == "available"
    again = twin_step(sides, lambda c: c.retry(job_id), lambda conn: awa_sa.retry_job(conn, job_id))
    assert again == (None, None)


def test_a_callback_wait_is_cancelled_and_retried_as_awa_pg_does(
    live: dict[str, Any], sides: tuple[Side, Side]
) -> None:
    """Parked in ``waiting_external`` by a real handler (``register_callback``, then
    ``WaitForCallback``): the cancel tells the runtime as a running one's does, the retry takes
    the unique claim the wait had given up, and both clear the callback columns."""
    cancelled, retried = WAITING
    parked = snapshot(sides[1].engine)
    for job_id in WAITING:
        assert parked["jobs"][job_id]["callback_id"] is not None, job_id
    assert not {job for _, job in parked["claims"]} & set(WAITING)
    notes: list[tuple[str, str]] = []
    got_pg, got_sa = twin_step(
        sides,
        lambda c: c.cancel(cancelled),
        lambda conn: awa_sa.cancel_job(conn, cancelled),
        notes=notes,
    )
    assert job_of_sa(got_sa) == job_of_pg(got_pg)
    assert (got_sa.state, got_sa.callback_id, got_sa.callback_timeout_at) == (
        "cancelled",
        None,
        None,
    )
    assert notes == [("awa:cancel", f'{{"job_id":{cancelled},"run_lease":1}}')]
    notes.clear()
    got_pg, got_sa = twin_step(
        sides,
        lambda c: c.retry(retried),
        lambda conn: awa_sa.retry_job(conn, retried),
        notes=notes,
    )
    assert job_of_sa(got_sa) == job_of_pg(got_pg)
    assert (got_sa.state, got_sa.attempt, got_sa.callback_id) == ("available", 0, None)
    assert [channel for channel, _ in notes] == [f"awa:{WORK}"]
    assert retried in {job for _, job in snapshot(sides[1].engine)["claims"]}


def test_nothing_matched_is_none_where_awa_pg_says_not_found(
    live: dict[str, Any], sides: tuple[Side, Side]
) -> None:
    for pg_verb, sa_verb in (
        (awa.AsyncClient.cancel, awa_sa.cancel_job),
        (awa.AsyncClient.retry, awa_sa.retry_job),
    ):
        got = twin_step(
            sides,
            lambda c, verb=pg_verb: verb(c, 10_000),  # type: ignore[misc]
            lambda conn, verb=sa_verb: verb(conn, 10_000),  # type: ignore[misc]
        )
        assert got == (None, None)


def test_bulk_retry_and_discard_write_what_awa_pg_writes(
    live: dict[str, Any], sides: tuple[Side, Side]
) -> None:
    got_pg, got_sa = twin_step(
        sides,
        lambda c: c.retry_failed(kind="bulk"),
        lambda conn: awa_sa.retry_failed(conn, kind="bulk"),
        bulk=True,
    )
    assert [job_of_sa(j) for j in got_sa.jobs] == [
        job_of_pg(j) for j in sorted(got_pg.jobs, key=lambda j: j.id)
    ]
    assert (
        (got_sa.matched, got_sa.pruned_failed_count)
        == (got_pg.matched, got_pg.pruned_failed_count)
        == (2, None)
    )
    got_pg, got_sa = twin_step(
        sides,
        lambda c: c.retry_failed(queue=OTHER),
        lambda conn: awa_sa.retry_failed(conn, queue=OTHER),
        bulk=True,
    )
    assert [job_of_sa(j) for j in got_sa.jobs] == [job_of_pg(j) for j in got_pg.jobs]
    assert got_sa.matched == got_pg.matched == 1
    got = twin_step(
        sides,
        lambda c: c.discard_failed("junk"),
        lambda conn: awa_sa.discard_failed(conn, "junk"),
        bulk=True,
    )
    assert got == (len(JUNK), len(JUNK))
    # Nothing left to match: both answer nothing, and write nothing.
    got_pg, got_sa = twin_step(
        sides,
        lambda c: c.retry_failed(kind="bulk"),
        lambda conn: awa_sa.retry_failed(conn, kind="bulk"),
        bulk=True,
    )
    assert (got_sa.jobs, got_sa.matched) == (got_pg.jobs, got_pg.matched) == ([], 0)
    got = twin_step(
        sides, lambda c: c.discard_failed("junk"), lambda conn: awa_sa.discard_failed(conn, "junk")
    )
    assert got == (0, 0)


REMIND = {"order": 42, "note": "ß", "at": [1, 2.5, None]}
"""Keys out of order and a non-ASCII string: the key hashes awa-pg's JSON text of them."""
PER_QUEUE = {"by_args": True, "by_queue": True}
PER_PERIOD = {"by_args": False, "by_period": 7}
NO_CLAIM = {"by_args": True, "states": 1 << 3}
"""Claims the key only once completed: two live jobs hold the same key, neither in the claims."""


def enqueue_twins(sides: tuple[Side, Side]) -> list[int]:
    """The same unique jobs on both clusters, in the same order: the same ids."""
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    made: list[list[int]] = []
    for side in sides:
        ids = []
        for args, unique, run_at in (
            (REMIND, PER_QUEUE, None),
            ({"n": 0}, PER_PERIOD, later),
            ({"twice": True}, NO_CLAIM, None),
            ({"twice": True}, NO_CLAIM, later),
        ):
            job = pg_call(
                side.url,
                lambda c, a=args, u=unique, r=run_at: c.insert(  # type: ignore[misc]
                    a, kind="remind", queue=IDLE, unique_opts=u, run_at=r
                ),
            )
            ids.append(job.id)
        side.notices()
        made.append(ids)
    assert made[0] == made[1]
    return made[0]


def test_cancel_by_unique_key_cancels_what_awa_pg_cancels(
    live: dict[str, Any], sides: tuple[Side, Side]
) -> None:
    per_queue, per_period, first, second = enqueue_twins(sides)
    held = {job for _, job in snapshot(sides[1].engine)["claims"]}
    assert per_queue in held
    assert not held & {first, second}
    steps: list[tuple[dict[str, Any], int | None]] = [
        ({"args": REMIND}, None),  # the queue left out: another key, nothing found
        ({"queue": IDLE, "args": REMIND}, per_queue),
        ({"queue": IDLE, "args": REMIND}, None),  # cancelled: terminal, no longer found
        ({"period_bucket": 7}, per_period),  # scheduled
        ({"args": {"twice": True}}, first),  # the oldest of two live holders
        ({"args": {"twice": True}}, second),
        ({"args": {"twice": True}}, None),
    ]
    for parts, cancelled in steps:
        got_pg, got_sa = twin_step(
            sides,
            lambda c, p=parts: c.cancel_by_unique_key("remind", **p),  # type: ignore[misc]
            lambda conn, p=parts: awa_sa.cancel_by_unique_key(conn, "remind", **p),  # type: ignore[misc]
        )
        assert job_of_sa(got_sa) == job_of_pg(got_pg), parts
        assert (None if got_sa is None else (got_sa.id, got_sa.state)) == (
            None if cancelled is None else (cancelled, "cancelled")
        ), parts
