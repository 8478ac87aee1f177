"""Callback waits on queue storage: awa-sa cancels and retries them as awa-pg 0.6.9's Client.

Twin clusters built by ``awa migrate``, each auto-finalized to queue storage in schema ``awa``
by its first real awa-pg runtime (the worker starts before any job). On each, the same jobs,
one at a time: a real handler registers a callback (some flush a progress first) and returns
``WaitForCallback``, which leaves the attempt a ``leases`` row in ``waiting_external`` (its
receipt materialised: a ``lease_claims`` row, or on a queue without a deadline a compact one).
A side session holds the maintenance-leader lock, so no callback-timeout rescue runs.

Each verb runs by awa-pg's ``AsyncClient`` on one twin and by awa-sa, in a caller's
transaction that also commits a business row, on the other (:mod:`administering`): every row
of every table of schema ``awa`` and every sequence changed alike, the same NOTIFYs. A rolled
back cancel leaves every row as it was, a rolled back retry all but its lane's gap. Then a job
both failed and waiting (made by a real worker and awa-pg's ``retry``, its failed row put back
by hand) and a failed one: ``retry_failed`` resumes the first's wait and retries the second, as
awa-pg's does; parked again by the worker, the first is matched again by queue, with nothing
done by hand. A cancel raced with awa-pg's ``complete_external`` (held locks, both orders)
ends the wait once. Last, a handler that registered a callback and keeps running is cancelled
beside its live worker on each twin: told once, and its completion changes nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import change, heard, pg_call, sa_call, same_job, snapshot, twin, twins
from racing import held, in_thread, wait_until_blocked
from runtimes import pg_url, rows
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

SCHEMAS = ("awa",)
CHANNELS = ("awa:cancel", "awa:cb_q", "awa:cbc_q", "awa:rf_q")
WAITING: tuple[dict[str, Any], ...] = (
    # The options of each job, enqueued and parked in this order: ids 1 to 10.
    {"unique_opts": {"by_args": True}, "tags": ["t"], "metadata": {"m": 1}},
    {"unique_opts": {"by_args": True}, "tags": ["t"], "metadata": {"m": 2}},
    {"progress": True},
    {"progress": True, "tags": ["p"]},
    {"unique_opts": {"by_args": True}},
    {},
    {"queue": "cbc_q", "tags": ["c"]},
    {"queue": "cbc_q", "unique_opts": {"by_args": True}},
    {},
    {},
)
CANCEL, RETRY, CANCEL_PROGRESS, RETRY_PROGRESS, ROLLED_BACK, ASYNC = range(1, 7)
CANCEL_COMPACT, RETRY_COMPACT = 7, 8
CANCEL_FIRST, COMPLETE_FIRST = 9, 10
"""Each raced with awa-pg's ``complete_external`` of its callback, in one order."""
"""Claimed under compact receipts (a queue without a deadline): no ``lease_claims`` row."""
QUEUES: list[dict[str, Any]] = [
    {"name": "cb_q", "max_workers": 1},  # the default deadline: a ``lease_claims`` receipt
    {"name": "cbc_q", "max_workers": 1, "deadline_duration_ms": 0},
]


@dataclass
class Twins:
    urls: tuple[str, str]
    engines: tuple[sa.Engine, sa.Engine]


def _parked(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM awa.leases WHERE state = 'waiting_external'")
            ).scalar_one()
        )


async def _park(url: str, engine: sa.Engine) -> list[int]:
    """The quick-start order: a runtime first (auto-finalizing), then each job, parked on a
    callback by its handler before the next is enqueued (so the twins' receipts match)."""
    client = awa.AsyncClient(pg_url(url))

    async def waits(job: Any) -> Any:
        if job.args.get("progress"):
            job.set_progress(50, "half way")
            await job.flush_progress()
        token = await job.register_callback(timeout_seconds=3600)
        return awa.WaitForCallback(token)

    client.task(dict, kind="waits", queue="cb_q")(waits)
    client.task(dict, kind="waits", queue="cbc_q")(waits)
    await client.start(QUEUES, promote_interval_ms=600_000, heartbeat_interval_ms=600_000)
    ids = []
    try:
        for n, options in enumerate(WAITING, start=1):
            given = dict(options)
            progress = given.pop("progress", False)
            given.setdefault("queue", "cb_q")
            job = await client.insert({"n": n, "progress": progress}, kind="waits", **given)
            ids.append(job.id)
            for _ in range(1200):
                if await asyncio.to_thread(_parked, engine) == n:
                    break
                await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
            else:
                raise AssertionError(f"job {job.id} was not parked within 60 s")
    finally:
        await client.shutdown()
        await client.close()
    return ids


@pytest.fixture(scope="module")
def parked(pg: EmbeddedPostgres, awa_databases: Databases, real_template: str) -> Iterator[Twins]:
    with ExitStack() as stack:
        urls, engines, made = [], [], []
        for _ in range(2):
            url, engine = twin(stack, pg, awa_databases, real_template)
            made.append(asyncio.run(_park(url, engine)))
            with engine.connect() as conn:
                routed = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()"))
                assert routed.scalar() == "awa"
            urls.append(url)
            engines.append(engine)
        assert made[0] == made[1] == list(range(1, len(WAITING) + 1))
        yield Twins((urls[0], urls[1]), (engines[0], engines[1]))


def _twins(parked: Twins, on_pg: Any, on_sa: Any) -> tuple[Any, Any, dict[str, Any], Any]:
    return twins(parked.urls, parked.engines, on_pg, on_sa, schemas=SCHEMAS, channels=CHANNELS)


CLOSED = {"awa.lease_claim_closures", "awa.lease_claims"}
"""A ``lease_claims`` receipt closed (a compact one: a closure batch)."""
CANCELLED = {"awa.done_entries", "awa.leases", "awa.queue_terminal_count_deltas"}
"""What every cancel of a callback wait changes: the lease gone, the cancelled row and its
delta (and its receipt closed)."""
RETRIED = {
    "awa.leases",
    "awa.ready_entries",
    "awa.ready_segments",
    "sequences",
}
"""What every retry of a callback wait changes: the lease gone, the new ready row and segment,
the lane's enqueue sequence (and its receipt closed)."""


@pytest.mark.parametrize(
    "job_id", [CANCEL, CANCEL_PROGRESS, CANCEL_COMPACT], ids=["keyed", "progress", "compact"]
)
def test_cancel_of_a_callback_wait_writes_what_awa_pg_writes(parked: Twins, job_id: int) -> None:
    got_pg, got_sa, changed, notes = _twins(
        parked, lambda c: c.cancel(job_id), lambda conn: awa_sa.cancel_job(conn, job_id)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage, got_sa.progress) == (
        "cancelled",
        "awa",
        got_pg.progress,
    )
    closed = {"awa.lease_claim_closure_batches"} if job_id == CANCEL_COMPACT else CLOSED
    assert set(changed) >= CANCELLED | closed, sorted(changed)
    assert notes == [("awa:cancel", f'{{"job_id":{job_id},"run_lease":1}}')]
    if job_id == CANCEL_PROGRESS:  # the flushed progress, from attempt_state into the payload
        assert got_sa.progress is not None
        assert "awa.attempt_state" in changed
    else:  # the key stays claimed: the mask claims neither waiting_external nor cancelled
        assert "awa.job_unique_claims" not in changed


@pytest.mark.parametrize(
    "job_id", [RETRY, RETRY_PROGRESS, RETRY_COMPACT], ids=["keyed", "progress", "compact"]
)
def test_retry_of_a_callback_wait_writes_what_awa_pg_writes(parked: Twins, job_id: int) -> None:
    got_pg, got_sa, changed, notes = _twins(
        parked, lambda c: c.retry(job_id), lambda conn: awa_sa.retry_job(conn, job_id)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.attempt, got_sa.progress) == ("available", 0, got_pg.progress)
    closed = {"awa.lease_claim_closure_batches"} if job_id == RETRY_COMPACT else CLOSED
    assert set(changed) >= RETRIED | closed, sorted(changed)
    queue = "cbc_q" if job_id == RETRY_COMPACT else "cb_q"
    assert [channel for channel, _ in notes] == [f"awa:{queue}"]
    if job_id == RETRY_PROGRESS:
        assert got_sa.progress is not None
        assert "awa.attempt_state" in changed


async def _fail_then_park(url: str, engine: sa.Engine, again: tuple[int, ...] = ()) -> list[int]:
    """Two jobs of kind ``resumes`` failed by a real worker (max_attempts 1), then the first
    retried by awa-pg's ``Client.retry`` and parked on a callback by the same worker's handler;
    its failed row is then put back as it was (the one step by hand: no path of awa-pg 0.6.9
    that ran here leaves a job both failed and waiting, docs/contract.md#administer). With
    *again*, those jobs, made available by a retry, are parked by the worker's handler."""
    client = awa.AsyncClient(pg_url(url))
    seen: set[int] = set(again)
    waiting = "SELECT 1 FROM awa.leases WHERE job_id = :i AND state = 'waiting_external'"

    async def resumes(job: Any) -> Any:
        if job.id not in seen:
            seen.add(job.id)
            raise RuntimeError("fails for good")
        token = await job.register_callback(timeout_seconds=3600)
        return awa.WaitForCallback(token)

    def count(sql: str, job_id: int) -> int:
        return len(rows(engine, sql, i=job_id))

    async def until(sql: str, job_id: int) -> None:
        for _ in range(1200):
            if await asyncio.to_thread(count, sql, job_id):
                return
            await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
        raise AssertionError(f"job {job_id}: {sql} found nothing within 60 s")

    failed = "SELECT 1 FROM awa.done_entries WHERE job_id = :i AND state = 'failed'"
    client.task(dict, kind="resumes", queue="rf_q")(resumes)
    await client.start(
        [{"name": "rf_q", "max_workers": 1}],
        promote_interval_ms=600_000,
        heartbeat_interval_ms=600_000,
    )
    try:
        for job_id in again:
            await until(waiting, job_id)
        if again:
            return list(again)
        ids = []
        made: tuple[dict[str, Any], ...] = ({"unique_opts": {"by_args": True}, "tags": ["r"]}, {})
        for n, options in enumerate(made):
            job = await client.insert(
                {"r": n}, kind="resumes", queue="rf_q", max_attempts=1, **options
            )
            await until(failed, job.id)
            ids.append(job.id)
        (row,) = await asyncio.to_thread(
            rows,
            engine,
            "SELECT to_jsonb(d) AS d FROM awa.done_entries d WHERE job_id = :i",
            i=ids[0],
        )
        await client.retry(ids[0])
        await until(waiting, ids[0])
    finally:
        await client.shutdown()
        await client.close()
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO awa.done_entries SELECT (jsonb_populate_record("
                "NULL::awa.done_entries, CAST(:d AS jsonb))).*"
            ),
            {"d": json.dumps(row["d"])},
        )
    return ids


@pytest.fixture(scope="module")
def resumable(parked: Twins) -> list[int]:
    """On both twins: a job both failed and waiting on a callback, and a failed one."""
    pairs = zip(parked.urls, parked.engines, strict=True)
    made = [asyncio.run(_fail_then_park(url, engine)) for url, engine in pairs]
    assert made[0] == made[1]
    return made[0]


def test_retry_failed_resumes_a_failed_jobs_callback_wait_as_awa_pg(
    parked: Twins, resumable: list[int]
) -> None:
    """awa-pg's bulk retry resumes the wait of the job that also waits (its failed row stays)
    and retries the other's failed row, numbering both on the lane in id order. A rolled back
    call first, on both twins: every row as it was, the lane's gap alone left."""
    for engine in parked.engines:
        before = snapshot(engine, SCHEMAS)
        with engine.connect() as conn:
            got = awa_sa.retry_failed(conn, kind="resumes")
            assert [j.id for j in got.jobs] == resumable
            conn.rollback()
        assert list(change(before, snapshot(engine, SCHEMAS))) == ["sequences"]
    got_pg, got_sa, changed, notes = _twins(
        parked,
        lambda c: c.retry_failed(kind="resumes"),
        lambda conn: awa_sa.retry_failed(conn, kind="resumes"),
    )
    assert (got_sa.matched, got_sa.pruned_failed_count) == (got_pg.matched, None) == (2, None)
    assert [j.id for j in got_sa.jobs] == sorted(j.id for j in got_pg.jobs) == resumable
    for sa_job, pg_job in zip(got_sa.jobs, sorted(got_pg.jobs, key=lambda j: j.id), strict=True):
        same_job(sa_job, pg_job)
        assert (sa_job.state, sa_job.attempt) == ("available", 0)
    assert set(changed) >= RETRIED | CLOSED | {"awa.done_entries"}, sorted(changed)
    assert notes == [("awa:rf_q", "")]
    for engine in parked.engines:  # the waiting job's failed row stays, the other's is gone
        left = rows(engine, "SELECT job_id FROM awa.done_entries WHERE kind = 'resumes'")
        assert left == [{"job_id": resumable[0]}]


def test_the_kept_failed_row_is_matched_again_once_the_job_waits_again(
    parked: Twins, resumable: list[int]
) -> None:
    """After the bulk retry above, the worker parks both jobs again: the first is again both
    failed and waiting, now with nothing done by hand, and a retry by queue resumes its wait
    alone (the second's failed row is gone), with the queue's pruned count, as awa-pg's."""
    for url, engine in zip(parked.urls, parked.engines, strict=True):
        asyncio.run(_fail_then_park(url, engine, tuple(resumable)))
    got_pg, got_sa, changed, notes = _twins(
        parked,
        lambda c: c.retry_failed(queue="rf_q"),
        lambda conn: awa_sa.retry_failed(conn, queue="rf_q"),
    )
    assert (got_sa.matched, got_sa.pruned_failed_count) == (got_pg.matched, 0) == (1, 0)
    ((sa_job,), (pg_job,)) = got_sa.jobs, got_pg.jobs
    same_job(sa_job, pg_job)
    assert sa_job.id == resumable[0]
    assert set(changed) >= RETRIED | CLOSED, sorted(changed)
    assert "awa.done_entries" not in changed
    assert notes == [("awa:rf_q", "")]


def test_a_rolled_back_cancel_or_retry_leaves_the_wait_as_it_was(parked: Twins) -> None:
    """Every row as it was; a retry's lane reservation alone outlives the rollback (a gap in
    the lane's numbering, docs/contract.md#administer)."""
    engine = parked.engines[1]
    before = snapshot(engine, SCHEMAS)
    with engine.connect() as conn:
        assert awa_sa.cancel_job(conn, ROLLED_BACK) is not None
        conn.rollback()
    assert snapshot(engine, SCHEMAS) == before
    with engine.connect() as conn:
        assert awa_sa.retry_job(conn, ROLLED_BACK) is not None
        conn.rollback()
    assert list(change(before, snapshot(engine, SCHEMAS))) == ["sequences"]


def _callback_id(engine: sa.Engine, job_id: int) -> str:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT callback_id::text FROM awa.leases WHERE job_id = :i"), {"i": job_id}
        )
        return str(found.scalar_one())


def _terminal(engine: sa.Engine, job_id: int) -> list[str]:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT state::text FROM awa.done_entries WHERE job_id = :i"
                " UNION ALL SELECT state::text FROM awa.leases WHERE job_id = :i"
            ),
            {"i": job_id},
        )
        return list(found.scalars())


def test_a_cancel_racing_awa_pgs_complete_external_ends_the_wait_once(parked: Twins) -> None:
    """Forced with held locks, on one twin: awa-sa's cancel holding the deleted lease makes
    ``complete_external`` wait, then find no wait; a side lock held on the lease while
    ``complete_external`` and then the cancel queue behind it lets the completion go first,
    and the cancel then finds a completed job (refused, nothing written)."""
    url, engine = parked.urls[1], parked.engines[1]
    callback = _callback_id(engine, CANCEL_FIRST)
    with held(engine) as tx:
        assert awa_sa.cancel_job(tx.conn, CANCEL_FIRST) is not None
        completing = in_thread(lambda: pg_call(url, lambda c: c.complete_external(callback)))
        wait_until_blocked(engine, tx.pid, pending=[completing])
        tx.commit()
    with pytest.raises(awa.AwaError):
        completing.result(timeout=60)
    assert _terminal(engine, CANCEL_FIRST) == ["cancelled"]

    callback = _callback_id(engine, COMPLETE_FIRST)
    with held(engine) as tx:
        tx.execute("SELECT 1 FROM awa.leases WHERE job_id = :i FOR UPDATE", {"i": COMPLETE_FIRST})
        completing = in_thread(lambda: pg_call(url, lambda c: c.complete_external(callback)))
        (first,) = wait_until_blocked(engine, tx.pid, pending=[completing])
        cancelling = in_thread(
            lambda: sa_call(engine, lambda c: awa_sa.cancel_job(c, COMPLETE_FIRST))
        )
        # The first waiter holds the row's tuple lock: the cancel queues behind it.
        wait_until_blocked(engine, first.pid, pending=[completing, cancelling])
        tx.rollback()
    assert completing.result(timeout=60).id == COMPLETE_FIRST
    with pytest.raises(awa_sa.QueueStorageJobs):
        cancelling.result(timeout=60)
    assert _terminal(engine, COMPLETE_FIRST) == ["completed"]


def test_the_async_twins_cancel_and_retry_a_callback_wait_with_asyncpg(parked: Twins) -> None:
    """On one twin only, so last: a retry of the wait, then a cancel of the job it made
    available (its ready row tombstoned), after which awa-pg's own cancel finds nothing."""
    url = sa.make_url(parked.urls[1]).set(drivername="postgresql+asyncpg")

    async def retry_then_cancel() -> tuple[awa_sa.JobRow | None, awa_sa.JobRow | None]:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                retried = await awa_async.retry_job(conn, ASYNC)
            async with engine.begin() as conn:
                return retried, await awa_async.cancel_job(conn, ASYNC)
        finally:
            await engine.dispose()

    got, cancelled = asyncio.run(retry_then_cancel())
    assert got is not None
    assert (got.id, got.state, got.attempt, got.storage) == (ASYNC, "available", 0, "awa")
    assert cancelled is not None
    assert (cancelled.id, cancelled.state, cancelled.attempt) == (ASYNC, "cancelled", 0)
    with pytest.raises(Exception, match="not found"):
        pg_call(parked.urls[1], lambda c: c.cancel(ASYNC))


async def _cancel_beside_worker(url: str, engine: sa.Engine, by_awa_sa: bool) -> dict[str, Any]:
    """A live worker's handler registers a callback and keeps running (its lease ``running``)
    until told it is cancelled; the cancel by awa-sa (a caller's transaction) or by awa-pg; the
    runtime's completion of the attempt lands on shutdown."""
    client = awa.AsyncClient(pg_url(url))
    holding = asyncio.Event()
    told: list[int] = []

    async def holds(job: Any) -> Any:
        await job.register_callback(timeout_seconds=3600)
        holding.set()
        while not job.is_cancelled():  # the handler's own pace, as a real one polls
            await asyncio.sleep(0.01)
        told.append(job.id)

    client.task(dict, kind="holds", queue="cbr_q")(holds)
    await client.start(
        [{"name": "cbr_q", "max_workers": 1}],
        promote_interval_ms=600_000,
        heartbeat_interval_ms=600_000,
    )
    try:
        job = await client.insert({"h": 1}, kind="holds", queue="cbr_q")
        await asyncio.wait_for(holding.wait(), 60)
        lease = await asyncio.to_thread(
            rows, engine, "SELECT state::text AS state FROM awa.leases WHERE job_id = :i", i=job.id
        )
        assert lease == [{"state": "running"}]
        before = await asyncio.to_thread(snapshot, engine, SCHEMAS)

        def cancel() -> Any:
            if by_awa_sa:
                return sa_call(engine, lambda conn: awa_sa.cancel_job(conn, job.id))
            return pg_call(url, lambda c: c.cancel(job.id))

        got, notes = await asyncio.to_thread(heard, url, CHANNELS, cancel)
        for _ in range(3000):
            if told:
                break
            await asyncio.sleep(0.01)  # the handler's pace
    finally:
        await client.shutdown()  # the handler returned: its completion lands
        await client.close()
    after = await asyncio.to_thread(snapshot, engine, SCHEMAS)
    return {"job": got, "change": change(before, after), "notes": notes, "told": told}


def test_a_running_attempt_with_a_callback_cancelled_beside_its_worker_as_awa_pg(
    parked: Twins,
) -> None:
    """Last: a worker of its own on each twin. Its handler is told and returns once; the
    runtime's completion after the cancel changes nothing."""
    on_pg = asyncio.run(_cancel_beside_worker(parked.urls[0], parked.engines[0], False))
    on_sa = asyncio.run(_cancel_beside_worker(parked.urls[1], parked.engines[1], True))
    got_pg, got_sa = on_pg["job"], on_sa["job"]
    assert got_sa is not None
    same_job(got_sa, got_pg)
    assert on_sa["change"] == on_pg["change"]
    assert set(on_sa["change"]) >= CANCELLED | CLOSED, sorted(on_sa["change"])
    assert (
        on_sa["notes"]
        == on_pg["notes"]
        == [("awa:cancel", f'{{"job_id":{got_sa.id},"run_lease":1}}')]
    )
    assert on_sa["told"] == on_pg["told"] == [got_sa.id]
    # One terminal row, the cancel's: the completion found no lease and wrote nothing.
    (written,) = on_sa["change"]["awa.done_entries"][1]
    assert ",cancelled," in written
    assert "awa.receipt_completion_batches" not in on_sa["change"]
