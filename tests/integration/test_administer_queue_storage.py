"""Cancelling a queue-storage job: awa-sa writes what awa-pg 0.6.9's own Client writes (issue 37).

Twin clusters built by ``awa migrate``, each auto-finalized to queue storage in schema ``awa``
by its first real awa-pg runtime (the quick-start order: the worker starts before any job).
On each, the same jobs in the same order: two scheduled ones (one with a unique key, one with
tags and metadata on a queue and priority no job used before, so its lane is created by the
cancel), and a retryable one, left so by the real worker (its handler raises with attempts
left). A side session holds the maintenance-leader lock, so nothing promotes them. Then two
running attempts, one receipt of each shape (``lease_claims``, compact), held by a live
worker's handlers until the runtime tells them the job was cancelled.

Each is cancelled by awa-pg's ``AsyncClient.cancel`` on one cluster, by awa-sa in a caller's
transaction that also commits a business row on the other. Compared: every row of every table
of schema ``awa`` (partitions through their parents; the runtimes' own liveness and claimer
bookkeeping left out) and every sequence, before and after (for a running attempt, after the
runtime's own completion of it), with only the clocks masked. What awa-sa does not do on
queue storage is refused, and writes nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import Twin, change, masked, pg_call, same_job, snapshot, twin, twins
from conftest import QUIESCED_FLIP, awa_cli
from runtimes import pg_url
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import QueueStorageJobs, UniqueConflict
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

SCHEDULED, SCHEDULED_NEW_LANE, RETRYABLE, AVAILABLE = 1, 2, 3, 4
FAILING: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    # (kind, queue, priority, options): failed by a real worker (max_attempts 1), in this order.
    ("fails_one", "work_q", 2, {"unique_opts": {"by_args": True}, "tags": ["a"]}),
    ("fails_kind", "work_q", 2, {"metadata": {"m": 6}}),
    ("fails_kind", "work_q", 2, {}),
    ("fails_q", "fail_q", 2, {}),
    ("fails_q", "fail_q", 3, {}),
    ("fails_discard", "work_q", 2, {"unique_opts": {"by_args": True}}),
    ("fails_discard", "work_q", 2, {}),
    ("fails_rb", "rb_q", 2, {}),
    ("fails_async", "async_q", 2, {"tags": ["x"]}),
    ("fails_async", "async_q", 2, {}),
    ("fails_held", "work_q", 2, {"unique_opts": {"by_args": True}}),
)


Side = Twin


async def _start(side: Side) -> None:
    """The quick-start order: a runtime first (auto-finalizing), then the jobs."""
    client = awa.AsyncClient(pg_url(side.url))

    async def retries(job: Any) -> Any:
        raise RuntimeError("try again")

    client.task(dict, kind="retries", queue="work_q")(retries)
    await client.start([("work_q", 2)], promote_interval_ms=600_000, heartbeat_interval_ms=600_000)
    try:
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        await client.insert(
            {"n": 1}, kind="idle", queue="idle_q", run_at=later, unique_opts={"by_args": True}
        )
        await client.insert(
            {"n": 2},
            kind="idle",
            queue="new_q",
            priority=3,
            run_at=later,
            tags=["t"],
            metadata={"m": 1},
        )
        await client.insert({"n": 3}, kind="retries", queue="work_q", max_attempts=5)
        await client.insert({"n": 4}, kind="idle", queue="idle_q")
        for _ in range(1200):
            with side.engine.connect() as conn:
                found = conn.execute(
                    sa.text("SELECT state::text FROM awa.deferred_jobs WHERE job_id = :i"),
                    {"i": RETRYABLE},
                ).scalar()
            if found == "retryable":
                return
            await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
        raise AssertionError("the worker did not leave job 3 retryable within 60 s")
    finally:
        await client.shutdown()
        await client.close()


@pytest.fixture(scope="module")
def sides(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[tuple[Side, Side]]:
    with ExitStack() as stack:
        made = []
        for _ in range(2):
            side = twin(stack, pg, awa_databases, real_template)
            asyncio.run(_start(side))
            with side.engine.connect() as conn:
                assert (
                    conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
                    == "awa"
                )
            made.append(side)
        yield made[0], made[1]


@pytest.mark.parametrize(
    "job_id",
    [SCHEDULED, SCHEDULED_NEW_LANE, RETRYABLE],
    ids=["scheduled", "scheduled_new_lane", "retryable"],
)
def test_cancel_of_a_deferred_job_writes_what_awa_pg_writes(
    sides: tuple[Side, Side], job_id: int
) -> None:
    pg_side, sa_side = sides
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    got_pg = pg_call(pg_side.url, lambda client: client.cancel(job_id))
    with sa_side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('paid')"))
        got_sa = awa_sa.cancel_job(conn, job_id)
    assert got_sa is not None
    assert change(before[1], snapshot(sa_side.engine)) == change(
        before[0], snapshot(pg_side.engine)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage) == ("cancelled", "awa")
    with sa_side.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM public.business")).scalar_one() >= 1


def test_what_awa_sa_does_not_do_on_queue_storage_is_refused(sides: tuple[Side, Side]) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    refusals: list[tuple[Callable[[sa.Connection], object], str]] = [
        (lambda c: awa_sa.cancel_job(c, 10_000), "terminal or unknown"),
    ]
    for call, message in refusals:
        with sa_side.engine.begin() as conn, pytest.raises(QueueStorageJobs, match=message):
            call(conn)
    with sa_side.engine.begin() as conn:  # nothing to act on: nothing written
        assert awa_sa.retry_job(conn, AVAILABLE) is None
        assert awa_sa.retry_job(conn, 10_000) is None
        assert awa_sa.retry_failed(conn, kind="idle") == awa_sa.RetriedFailed([], 0, None)
        assert awa_sa.retry_failed(conn, queue="idle_q") == awa_sa.RetriedFailed([], 0, 0)
        assert awa_sa.discard_failed(conn, "idle") == 0
    assert snapshot(sa_side.engine) == before


def test_a_rolled_back_cancel_leaves_the_job_as_it_was(sides: tuple[Side, Side]) -> None:
    for side in sides:  # on both, so that the twins' ids stay in step
        with side.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO awa.jobs (kind, queue, args, state, run_at)"
                    " VALUES ('idle', 'idle_q', '{}', 'scheduled', now() + interval '1 hour')"
                )
            )
    _, sa_side = sides
    with sa_side.engine.connect() as conn:
        job_id = conn.execute(sa.text("SELECT max(job_id) FROM awa.deferred_jobs")).scalar_one()
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        assert awa_sa.cancel_job(conn, job_id) is not None
        conn.rollback()
    # The lane's sequences were ensured (they exist already) and nothing else changed.
    assert snapshot(sa_side.engine) == before


RECEIPT_Q = {"name": "receipt_q", "max_workers": 2}
"""A queue with the default deadline: a claim writes a ``lease_claims`` receipt."""
COMPACT_Q = {"name": "compact_q", "max_workers": 2, "deadline_duration_ms": 0}
"""No deadline: a claim writes one position of a compact ``lease_claim_batches`` row."""


async def _cancel_beside_worker(side: Side, by_awa_sa: bool) -> list[Any]:
    """Two attempts held by a live worker (one receipt of each shape), each cancelled while
    held; each handler returns once told, and the runtime's completion lands on shutdown."""
    client = awa.AsyncClient(pg_url(side.url))
    holding = asyncio.Event()
    told: list[int] = []
    runs: list[int] = []

    async def holds(job: Any) -> Any:
        runs.append(job.id)
        holding.set()
        while not job.is_cancelled():  # the handler's own pace, as a real one polls
            await asyncio.sleep(0.01)
        told.append(job.id)

    client.task(dict, kind="holds", queue="receipt_q")(holds)
    client.task(dict, kind="holdc", queue="compact_q")(holds)
    await client.start(
        [RECEIPT_Q, COMPACT_Q], promote_interval_ms=600_000, heartbeat_interval_ms=600_000
    )
    found: list[Any] = []
    try:
        for kind, queue in (("holds", "receipt_q"), ("holdc", "compact_q")):
            holding.clear()
            job = await client.insert(
                {"k": kind}, kind=kind, queue=queue, unique_opts={"by_args": True}
            )
            await asyncio.wait_for(holding.wait(), 60)
            before = await asyncio.to_thread(snapshot, side.engine)
            got: Any
            if by_awa_sa:
                got = await asyncio.to_thread(_sa_cancel, side, job.id)
            else:
                got = await client.cancel(job.id)
            for _ in range(3000):
                if job.id in told:
                    break
                await asyncio.sleep(0.01)  # the handler's pace
            found.append((job.id, got, before))
    finally:
        await client.shutdown()  # the handlers returned: their completions land
        await client.close()
    after = await asyncio.to_thread(snapshot, side.engine)
    return [
        (job_id, got, change(before, after), job_id in told, runs.count(job_id))
        for job_id, got, before in found
    ]


def _sa_cancel(side: Side, job_id: int) -> awa_sa.JobRow | None:
    with side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('paid')"))
        return awa_sa.cancel_job(conn, job_id)


def test_a_running_attempt_cancelled_beside_its_worker_writes_what_awa_pg_writes(
    sides: tuple[Side, Side],
) -> None:
    pg_side, sa_side = sides
    on_pg = asyncio.run(_cancel_beside_worker(pg_side, by_awa_sa=False))
    on_sa = asyncio.run(_cancel_beside_worker(sa_side, by_awa_sa=True))
    assert [job_id for job_id, *_ in on_sa] == [job_id for job_id, *_ in on_pg]
    for (job_id, got_pg, pg_change, pg_told, pg_runs), (
        _,
        got_sa,
        sa_change,
        sa_told,
        sa_runs,
    ) in zip(on_pg, on_sa, strict=True):
        assert got_sa is not None, job_id
        assert (got_sa.state, got_sa.storage) == ("cancelled", "awa"), job_id
        assert (got_sa.id, got_sa.kind, got_sa.queue, got_sa.attempt, got_sa.args) == (
            got_pg.id,
            got_pg.kind,
            got_pg.queue,
            got_pg.attempt,
            got_pg.args,
        )
        # Told once, ran once; the runtime's completion after the cancel changed nothing.
        assert (sa_told, sa_runs) == (pg_told, pg_runs) == (True, 1)
        # The later part of each change includes the second attempt's claim: compared whole.
        assert sa_change == pg_change, job_id
        written = [
            row
            for row in sa_change["awa.done_entries"][1]
            if f"({job_id}," in row or f",{job_id}," in row
        ]
        assert any("cancelled" in row for row in written), sa_change["awa.done_entries"]


def test_in_mixed_transition_a_deferred_job_of_the_routing_schema_is_cancelled_as_awapg_call(
    clone_database: Callable[[str], str], real_template: str
) -> None:
    """Routing flipped to ``awa_qs`` by the real CLI, no runtime: a canonical job enqueued
    before the flip and a scheduled one after, on both twins. ``cancel_job(1)`` names the
    routing schema's job 1 on both sides (the planes' ids collide; awa-pg's cancel looks there
    alone), and the canonical job 1 is left as it was by both."""
    pg_url_, sa_url = clone_database(real_template), clone_database(real_template)
    for url in (pg_url_, sa_url):
        asyncio.run(_mixed(url))
    engines = [sa.create_engine(pg_url_), sa.create_engine(sa_url)]
    try:
        before = [snapshot_of(e) for e in engines]
        got_pg = pg_call(pg_url_, lambda client: client.cancel(1))
        with engines[1].begin() as conn:
            got_sa = awa_sa.cancel_job(conn, 1)
        after = [snapshot_of(e) for e in engines]
    finally:
        for e in engines:
            e.dispose()
    assert got_sa is not None
    assert (got_sa.storage, got_sa.state, got_sa.kind) == ("awa_qs", "cancelled", "later")
    assert (got_pg.id, got_pg.kind) == (got_sa.id, got_sa.kind)
    assert change(before[1], after[1]) == change(before[0], after[0])
    assert change(before[1], after[1])["awa_qs.done_entries"][1]
    assert "awa.jobs_hot" not in change(before[1], after[1])


async def _mixed(url: str) -> None:
    client = awa.AsyncClient(pg_url(url))
    try:
        await client.insert({"n": 1}, kind="before", queue="q")  # canonical job 1
    finally:
        await client.close()
    env_url = pg_url(url)
    for args in (
        ("storage", "prepare", "--engine", "queue_storage", "--details", '{"schema": "awa_qs"}'),
        QUIESCED_FLIP,
    ):
        await asyncio.to_thread(_awa_cli, env_url, args)
    client = awa.AsyncClient(pg_url(url))
    try:
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        await client.insert({"n": 2}, kind="later", queue="q", run_at=later)  # awa_qs job 1
    finally:
        await client.close()


def _awa_cli(url: str, args: tuple[str, ...]) -> None:
    env = {**os.environ, "DATABASE_URL": url, "RUST_LOG": "warn"}
    subprocess.run([awa_cli(), *args], env=env, check=True, capture_output=True, timeout=120)


def snapshot_of(engine: sa.Engine) -> dict[str, list[str]]:
    """:func:`snapshot` over both schemas a mixed_transition cluster writes."""
    out = snapshot(engine)
    with engine.connect() as conn:
        for table in ("jobs_hot", "scheduled_jobs"):
            out[f"awa.{table}"] = sorted(
                masked(t)
                for t in conn.execute(sa.text(f"SELECT t::text FROM awa.{table} t")).scalars()
            )
        for table in ("deferred_jobs", "done_entries", "queue_terminal_count_deltas"):
            out[f"awa_qs.{table}"] = sorted(
                masked(t)
                for t in conn.execute(sa.text(f"SELECT t::text FROM awa_qs.{table} t")).scalars()
            )
    return out


def test_the_async_twin_cancels_on_queue_storage_with_asyncpg(sides: tuple[Side, Side]) -> None:
    for side in sides:  # on both, so that the twins' ids stay in step
        with side.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO awa.jobs (kind, queue, args, state, run_at, tags, metadata)"
                    " VALUES ('idle', 'idle_q', '{\"a\": [1]}', 'scheduled',"
                    " now() + interval '1 hour', '{x}', '{\"m\": 2}')"
                )
            )
    _, sa_side = sides
    with sa_side.engine.connect() as conn:
        job_id = conn.execute(sa.text("SELECT max(job_id) FROM awa.deferred_jobs")).scalar_one()
    url = sa.make_url(sa_side.url).set(drivername="postgresql+asyncpg")

    async def cancel() -> awa_sa.JobRow | None:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                return await awa_async.cancel_job(conn, job_id)
        finally:
            await engine.dispose()

    got = asyncio.run(cancel())
    assert got is not None
    assert (got.id, got.state, got.storage) == (job_id, "cancelled", "awa")
    assert (got.args, got.tags, got.metadata) == ({"a": [1]}, ["x"], {"m": 2})


def test_cancel_by_unique_key_on_queue_storage_writes_what_awa_pg_writes(
    sides: tuple[Side, Side],
) -> None:
    """A scheduled job found by its key is cancelled as awa-pg cancels it, by either face, and
    so is an available one (not its lane's head: awa-pg moves no cursor); no key, None."""

    async def onpg_call(url: str, call: Callable[[awa.AsyncClient], Any]) -> Any:
        client = awa.AsyncClient(pg_url(url))
        try:
            return await call(client)
        finally:
            await client.close()

    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    for side in sides:  # on both, so that the twins' ids stay in step
        for args, run_at in (({"lane": 1}, None), ({"n": 99}, later), ({"n": 98}, later)):
            asyncio.run(
                onpg_call(
                    side.url,
                    lambda c, a=args, r=run_at: c.insert(  # type: ignore[misc]
                        a, kind="keyed", queue="idle_q", run_at=r, unique_opts={}
                    ),
                )
            )
    pg_side, sa_side = sides
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    got_pg = asyncio.run(
        onpg_call(pg_side.url, lambda c: c.cancel_by_unique_key("keyed", args={"n": 99}))
    )
    with sa_side.engine.begin() as conn:
        got_sa = awa_sa.cancel_by_unique_key(conn, "keyed", args={"n": 99})
    assert got_sa is not None
    assert (got_sa.id, got_sa.state, got_sa.args) == (got_pg.id, "cancelled", got_pg.args)
    assert change(before[1], snapshot(sa_side.engine)) == change(
        before[0], snapshot(pg_side.engine)
    )
    url = sa.make_url(sa_side.url).set(drivername="postgresql+asyncpg")

    async def on_sa(args: dict[str, Any]) -> awa_sa.JobRow | None:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                return await awa_async.cancel_by_unique_key(conn, "keyed", args=args)
        finally:
            await engine.dispose()

    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    got_pg = asyncio.run(
        onpg_call(pg_side.url, lambda c: c.cancel_by_unique_key("keyed", args={"n": 98}))
    )
    got_sa = asyncio.run(on_sa({"n": 98}))
    assert got_sa is not None
    assert (got_sa.id, got_sa.state, got_sa.storage) == (got_pg.id, "cancelled", "awa")
    assert change(before[1], snapshot(sa_side.engine)) == change(
        before[0], snapshot(pg_side.engine)
    )
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    assert asyncio.run(on_sa({"n": 98})) is None  # cancelled: no longer found
    assert snapshot(sa_side.engine) == before[1]
    got_pg = asyncio.run(
        onpg_call(pg_side.url, lambda c: c.cancel_by_unique_key("keyed", args={"lane": 1}))
    )
    got_sa = asyncio.run(on_sa({"lane": 1}))
    assert got_sa is not None
    assert (got_sa.id, got_sa.state, got_sa.attempt) == (got_pg.id, "cancelled", 0)
    assert change(before[1], snapshot(sa_side.engine)) == change(
        before[0], snapshot(pg_side.engine)
    )


# --- retry_job, retry_failed, discard_failed on queue storage ------------------------------
# These run after the tests above: their failing worker claims jobs in batches of its own,
# which would make the twins' claim sequences differ under the running-attempt comparison.


async def _fail(side: Side) -> list[int]:
    """The jobs of FAILING, failed by a real worker; their ids, in FAILING's order."""
    client = awa.AsyncClient(pg_url(side.url))

    async def fails(job: Any) -> Any:
        raise RuntimeError("fails for good")

    for kind, queue in sorted({(kind, queue) for kind, queue, _, _ in FAILING}):
        client.task(dict, kind=kind, queue=queue)(fails)
    await client.start(
        [("work_q", 2), ("fail_q", 2), ("rb_q", 1), ("async_q", 1)],
        promote_interval_ms=600_000,
        heartbeat_interval_ms=600_000,
    )
    try:
        ids = []
        for n, (kind, queue, priority, options) in enumerate(FAILING):
            job = await client.insert(
                {"f": n}, kind=kind, queue=queue, priority=priority, max_attempts=1, **options
            )
            ids.append(job.id)
        for _ in range(1200):
            with side.engine.connect() as conn:
                failed = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM awa.done_entries"
                        " WHERE state = 'failed' AND job_id = ANY(:ids)"
                    ),
                    {"ids": ids},
                ).scalar_one()
            if failed == len(ids):
                return ids
            await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
        raise AssertionError("the worker did not fail every job within 60 s")
    finally:
        await client.shutdown()
        await client.close()


@pytest.fixture(scope="module")
def failed(sides: tuple[Side, Side]) -> dict[str, int]:
    """FAILING's jobs failed on both twins (the same ids), by kind: the first of each kind."""
    made = [asyncio.run(_fail(side)) for side in sides]
    assert made[0] == made[1]
    ids: dict[str, int] = {}
    for (kind, *_), job_id in zip(FAILING, made[0], strict=True):
        ids.setdefault(kind, job_id)
    return ids


CHANNELS = ("awa:work_q", "awa:fail_q", "awa:idle_q", "awa:rb_q")
"""The queues' channels a retry NOTIFYs on."""


def _twins(
    sides: tuple[Side, Side],
    on_pg: Callable[[awa.AsyncClient], Any],
    on_sa: Callable[[sa.Connection], Any],
    touched: set[str],
) -> tuple[Any, Any]:
    """awa-pg's call on one twin, awa-sa's on the other: the same rows changed (at least in
    the tables *touched*), the same NOTIFYs; both results."""
    pg_side, sa_side = sides
    got_pg, got_sa, changed, sa_heard = twins(
        (pg_side.url, sa_side.url),
        (pg_side.engine, sa_side.engine),
        on_pg,
        on_sa,
        schemas=("awa",),
        channels=CHANNELS,
    )
    assert touched <= set(changed), sorted(changed)
    assert bool(sa_heard) == ("awa.ready_entries" in touched), sa_heard
    return got_pg, got_sa


def _same_job(got_sa: awa_sa.JobRow, got_pg: Any) -> None:
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage, got_sa.attempt) == ("available", "awa", 0)


RETRIED = {
    "awa.done_entries",
    "awa.queue_terminal_count_deltas",
    "awa.ready_entries",
    "awa.ready_segments",
    "sequences",
}
"""What every retry changes: the terminal row gone, its delta, the new ready row and segment,
the lane's enqueue sequence."""


def test_retry_job_of_a_failed_job_writes_what_awa_pg_writes(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    """Failed by the real worker, with a unique key: its claim is taken again."""
    job_id = failed["fails_one"]
    got_pg, got_sa = _twins(
        sides,
        lambda c: c.retry(job_id),
        lambda conn: awa_sa.retry_job(conn, job_id),
        RETRIED | {"awa.job_unique_claims"},
    )
    _same_job(got_sa, got_pg)
    assert len(got_sa.errors) == len(got_pg.errors) == 1


def test_retry_job_of_a_cancelled_job_writes_what_awa_pg_writes(sides: tuple[Side, Side]) -> None:
    """A scheduled job cancelled by awa-pg on both twins (a ``done_entries`` row of its own,
    not ready-backed), then retried."""
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    ids = []
    for side in sides:
        job = pg_call(
            side.url, lambda c: c.insert({"c": 1}, kind="idle", queue="idle_q", run_at=later)
        )
        pg_call(side.url, lambda c, i=job.id: c.cancel(i))  # type: ignore[misc]
        ids.append(job.id)
    assert ids[0] == ids[1]
    got_pg, got_sa = _twins(
        sides, lambda c: c.retry(ids[0]), lambda conn: awa_sa.retry_job(conn, ids[0]), RETRIED
    )
    _same_job(got_sa, got_pg)


def test_retry_failed_by_kind_and_by_queue_write_what_awa_pg_writes(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    for by in ({"kind": "fails_kind"}, {"queue": "fail_q"}):
        got_pg, got_sa = _twins(
            sides,
            lambda c, by=by: c.retry_failed(**by),  # type: ignore[misc]
            lambda conn, by=by: awa_sa.retry_failed(conn, **by),  # type: ignore[misc]
            RETRIED,
        )
        assert (got_sa.matched, got_sa.pruned_failed_count) == (
            got_pg.matched,
            got_pg.pruned_failed_count,
        ), by
        assert len(got_sa.jobs) == len(got_pg.jobs) == 2, by
        for sa_job, pg_job in zip(
            got_sa.jobs, sorted(got_pg.jobs, key=lambda j: j.id), strict=True
        ):
            _same_job(sa_job, pg_job)


def test_a_retry_whose_key_another_job_holds_raises_as_awa_pg_and_writes_nothing(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    """A failed job's key taken meanwhile by a new scheduled job: awa-pg raises UniqueConflict
    and its rollback leaves only its lane reservation behind (a gap); awa-sa raises before
    it reserves, and with the caller's rollback nothing at all is left."""
    job_id = failed["fails_held"]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    for side in sides:
        pg_call(
            side.url,
            lambda c: c.insert(
                {"f": len(FAILING) - 1},
                kind="fails_held",
                queue="work_q",
                run_at=later,
                unique_opts={"by_args": True},
            ),
        )
    pg_side, sa_side = sides
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    with pytest.raises(awa.UniqueConflict):
        pg_call(pg_side.url, lambda c: c.retry(job_id))
    with sa_side.engine.connect() as conn, pytest.raises(UniqueConflict):
        awa_sa.retry_job(conn, job_id)
    assert snapshot(sa_side.engine) == before[1]
    assert list(change(before[0], snapshot(pg_side.engine))) == ["sequences"]


def test_discard_failed_writes_what_awa_pg_writes(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    got_pg, got_sa = _twins(
        sides,
        lambda c: c.discard_failed("fails_discard"),
        lambda conn: awa_sa.discard_failed(conn, "fails_discard"),
        {"awa.done_entries", "awa.queue_terminal_count_deltas"},
    )
    assert got_sa == got_pg == 2


def test_a_rolled_back_retry_leaves_the_jobs_as_they_were_but_a_lane_gap(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    """Every row as it was; only the lane's enqueue sequence moved on (a reservation is not
    transactional). Then a committed retry after the gap is claimed by a real worker."""
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    for retry in (
        lambda conn: awa_sa.retry_job(conn, failed["fails_rb"]),
        lambda conn: awa_sa.retry_failed(conn, kind="fails_rb"),
    ):
        with sa_side.engine.connect() as conn:
            assert retry(conn) is not None
            conn.rollback()
    after = snapshot(sa_side.engine)
    moved = change(before, after)
    assert list(moved) == ["sequences"], moved
    (gone,), (now,) = moved["sequences"]
    assert gone.split(",")[0] == now.split(",")[0]
    assert "queue_enqueue_seq_" in now
    # Two numbers reserved and never filled: the gap.
    assert int(now.rstrip(")").split(",")[1]) - int(gone.rstrip(")").split(",")[1]) == 2
    asyncio.run(_claimed_after_gap(sa_side, failed["fails_rb"]))


async def _claimed_after_gap(side: Side, job_id: int) -> None:
    """The committed retry of the job, behind two rolled-back reservations of its lane, is
    claimed and run by a real awa-pg worker."""
    with side.engine.begin() as conn:
        assert awa_sa.retry_job(conn, job_id) is not None
    client = awa.AsyncClient(pg_url(side.url))
    ran = asyncio.Event()

    async def runs(job: Any) -> Any:
        ran.set()

    client.task(dict, kind="fails_rb", queue="rb_q")(runs)
    await client.start([("rb_q", 1)], promote_interval_ms=600_000, heartbeat_interval_ms=600_000)
    try:
        await asyncio.wait_for(ran.wait(), 60)
    finally:
        await client.shutdown()
        await client.close()
    with side.engine.connect() as conn:
        state = conn.execute(
            sa.text(
                "SELECT state::text FROM awa.done_entries WHERE job_id = :i"
                " ORDER BY finalized_at DESC LIMIT 1"
            ),
            {"i": job_id},
        ).scalar()
    assert state == "completed"


def test_the_async_twins_retry_and_discard_on_queue_storage_with_asyncpg(
    sides: tuple[Side, Side], failed: dict[str, int]
) -> None:
    """The job ids travel as a ``bigint[]``: asyncpg's own binding, on one twin only (last)."""
    _, sa_side = sides
    url = sa.make_url(sa_side.url).set(drivername="postgresql+asyncpg")

    async def run() -> tuple[awa_sa.JobRow | None, awa_sa.RetriedFailed, int]:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                one = await awa_async.retry_job(conn, failed["fails_async"])
                rest = await awa_async.retry_failed(conn, queue="async_q")
                gone = await awa_async.discard_failed(conn, "fails_async")
            return one, rest, gone
        finally:
            await engine.dispose()

    one, rest, gone = asyncio.run(run())
    assert one is not None
    assert (one.id, one.state, one.storage, one.tags) == (
        failed["fails_async"],
        "available",
        "awa",
        ["x"],
    )
    assert (len(rest.jobs), rest.matched, rest.pruned_failed_count) == (1, 1, 0)
    assert rest.jobs[0].id == failed["fails_async"] + 1
    assert gone == 0  # both are available again: no failed row left to discard
    with sa_side.engine.connect() as conn:
        ready = conn.execute(
            sa.text(
                "SELECT job_id, attempt FROM awa.ready_entries WHERE queue = 'async_q'"
                " ORDER BY lane_seq DESC LIMIT 2"
            )
        ).all()
    assert sorted(tuple(r) for r in ready) == [(one.id, 0), (one.id + 1, 0)]
