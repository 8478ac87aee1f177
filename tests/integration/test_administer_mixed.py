"""Retry, discard and callback waits in mixed_transition: awa-sa writes what awa-pg 0.6.9 writes.

Twin clusters, each a clone of the ``awa migrate`` template: a canonical job enqueued first
(``awa.jobs_hot`` id 1, on a queue no worker serves), then the real CLI prepares queue storage
in schema ``awa_qs`` and flips the cluster to ``mixed_transition``. On each the same jobs, in
the same order, enqueued by awa-pg (so into ``awa_qs``, whose ids start at 1 too) and failed
by a real awa-pg worker of the ``queue_storage_target`` role (its handler raises, one attempt
each), then two it parks on a callback (``register_callback``, ``WaitForCallback``); a
scheduled job cancelled by awa-pg's cancel. Two of the failed jobs are filed in the DLQ by
awa-pg's own move, on both twins, before their retries are compared. A side session holds the
maintenance-leader lock throughout, so no promotion, rescue or recompute runs.

Each verb runs by awa-pg's ``AsyncClient`` on one twin and by awa-sa, in a caller's
transaction that also commits a business row, on the other (:mod:`administering`): every row
of every table of both schemas and every sequence changed alike, the same NOTIFYs. The
canonical job that shares id 1 is left as it was by both.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import pg_call, same_job, twin, twins
from conftest import QUIESCED_FLIP, run_awa
from runtimes import pg_url

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes and the real CLI

SCHEMAS = ("awa", "awa_qs")
CHANNELS = ("awa:cancel", "awa:work_q", "awa:fail_q", "awa:idle_q", "awa:cb_q", "awa:dlq_q")
FAILING: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    # (kind, queue, priority, options): failed by a real worker (max_attempts 1), in this order.
    ("fails_one", "work_q", 2, {"unique_opts": {"by_args": True}, "tags": ["a"]}),
    ("fails_kind", "work_q", 2, {"metadata": {"m": 6}}),
    ("fails_kind", "work_q", 2, {}),
    ("fails_q", "fail_q", 2, {}),
    ("fails_q", "fail_q", 3, {}),
    ("fails_discard", "work_q", 2, {"unique_opts": {"by_args": True}}),
    ("fails_discard", "work_q", 2, {}),
    ("fails_dlq", "work_q", 2, {"unique_opts": {"by_args": True}, "tags": ["d"]}),
    ("fails_dlq", "dlq_q", 3, {}),
)
FAILS_ONE = 1
DEAD = (8, 9)
"""Filed in the DLQ of ``awa_qs`` by awa-pg on both twins, then retried out of it."""
"""awa_qs's first job: the same id as the canonical job enqueued before the flip."""
WAITING = (len(FAILING) + 1, len(FAILING) + 2)
"""Parked on a callback by their handler: a ``leases`` row of ``awa_qs``, ``waiting_external``."""
CANCELLED = len(FAILING) + 3


@dataclass
class Twins:
    urls: tuple[str, str]
    engines: tuple[sa.Engine, sa.Engine]


def _counted(engine: sa.Engine, ids: list[int]) -> tuple[int, int]:
    """How many of *ids* failed, and how many wait on a callback."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM awa_qs.done_entries"
                "  WHERE state = 'failed' AND job_id = ANY(:ids)),"
                " (SELECT count(*) FROM awa_qs.leases"
                "  WHERE state = 'waiting_external' AND job_id = ANY(:ids))"
            ),
            {"ids": ids},
        ).one()
    return int(row[0]), int(row[1])


async def _fail(url: str, engine: sa.Engine) -> list[int]:
    """FAILING's jobs, enqueued first, then failed by a queue-storage target worker; two jobs
    it parks on a callback, one at a time; a scheduled job, cancelled by awa-pg. Every id, in
    that order."""
    client = awa.AsyncClient(pg_url(url))

    async def fails(job: Any) -> Any:
        raise RuntimeError("fails for good")

    async def waits(job: Any) -> Any:
        token = await job.register_callback(timeout_seconds=3600)
        return awa.WaitForCallback(token)

    for kind, queue in sorted({(kind, queue) for kind, queue, _, _ in FAILING}):
        client.task(dict, kind=kind, queue=queue)(fails)
    client.task(dict, kind="waits", queue="cb_q")(waits)
    ids = []
    for n, (kind, queue, priority, options) in enumerate(FAILING):
        job = await client.insert(
            {"f": n}, kind=kind, queue=queue, priority=priority, max_attempts=1, **options
        )
        ids.append(job.id)
    waiting: list[int] = []
    await client.start(
        [("work_q", 2), ("fail_q", 2), ("cb_q", 1), ("dlq_q", 1)],
        promote_interval_ms=600_000,
        heartbeat_interval_ms=600_000,
        queue_storage_schema="awa_qs",
        storage_transition_role="queue_storage_target",
    )
    try:
        for n in range(3):  # the failures, then each wait before the next (receipts in step)
            if n:
                job = await client.insert(
                    {"w": n}, kind="waits", queue="cb_q", unique_opts={"by_args": True}, tags=["w"]
                )
                waiting.append(job.id)
            for _ in range(1200):
                if await asyncio.to_thread(_counted, engine, ids + waiting) == (len(ids), n):
                    break
                await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
            else:
                raise AssertionError("the worker did not fail or park every job within 60 s")
    finally:
        await client.shutdown()
    try:
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        job = await client.insert({"c": 1}, kind="idle", queue="idle_q", run_at=later)
        await client.cancel(job.id)
        return [*ids, *waiting, job.id]
    finally:
        await client.close()


@pytest.fixture(scope="module")
def mixed(pg: EmbeddedPostgres, awa_databases: Databases, real_template: str) -> Iterator[Twins]:
    with ExitStack() as stack:
        urls, engines, made = [], [], []
        for _ in range(2):
            url, engine = twin(stack, pg, awa_databases, real_template)
            pg_call(url, lambda c: c.insert({"n": 0}, kind="before", queue="idle_q"))
            dbname = sa.make_url(url).database or ""
            details = '{"schema": "awa_qs"}'
            prepare = ("storage", "prepare", "--engine", "queue_storage", "--details", details)
            run_awa(pg, dbname, *prepare)
            run_awa(pg, dbname, *QUIESCED_FLIP)
            with engine.connect() as conn:
                phase = conn.execute(
                    sa.text(
                        "SELECT state, awa.active_queue_storage_schema()"
                        " FROM awa.storage_transition_state"
                    )
                ).one()
            assert tuple(phase) == ("mixed_transition", "awa_qs")
            made.append(asyncio.run(_fail(url, engine)))
            urls.append(url)
            engines.append(engine)
        assert made[0] == made[1]
        assert made[0][0] == FAILS_ONE
        assert made[0][-1] == CANCELLED
        yield Twins((urls[0], urls[1]), (engines[0], engines[1]))


def _twins(mixed: Twins, on_pg: Any, on_sa: Any) -> tuple[Any, Any, dict[str, Any], Any]:
    got = twins(mixed.urls, mixed.engines, on_pg, on_sa, schemas=SCHEMAS, channels=CHANNELS)
    assert not {"awa.jobs_hot", "awa.scheduled_jobs"} & set(got[2]), sorted(got[2])
    return got


RETRIED = {
    "awa_qs.done_entries",
    "awa_qs.queue_terminal_count_deltas",
    "awa_qs.ready_entries",
    "awa_qs.ready_segments",
    "sequences",
}
"""What every retry changes: the terminal row gone, its delta, the new ready row and segment,
the lane's enqueue sequence."""


def test_retry_job_of_a_failed_job_writes_what_awa_pg_writes(mixed: Twins) -> None:
    """awa_qs's job 1, failed with a unique key; the canonical job 1 stays available."""
    got_pg, got_sa, changed, notes = _twins(
        mixed, lambda c: c.retry(FAILS_ONE), lambda conn: awa_sa.retry_job(conn, FAILS_ONE)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage, got_sa.attempt) == ("available", "awa_qs", 0)
    assert set(changed) >= RETRIED, sorted(changed)
    assert [channel for channel, _ in notes] == ["awa:work_q"]
    with mixed.engines[1].connect() as conn:
        hot = conn.execute(sa.text("SELECT state::text FROM awa.jobs_hot WHERE id = 1")).scalar()
    assert hot == "available"


def test_retry_job_of_a_cancelled_job_writes_what_awa_pg_writes(mixed: Twins) -> None:
    got_pg, got_sa, changed, _ = _twins(
        mixed, lambda c: c.retry(CANCELLED), lambda conn: awa_sa.retry_job(conn, CANCELLED)
    )
    same_job(got_sa, got_pg)
    assert set(changed) >= RETRIED, sorted(changed)


def test_retry_failed_by_kind_and_by_queue_write_what_awa_pg_writes(mixed: Twins) -> None:
    for by in ({"kind": "fails_kind"}, {"queue": "fail_q"}):
        got_pg, got_sa, changed, notes = _twins(
            mixed,
            lambda c, by=by: c.retry_failed(**by),
            lambda conn, by=by: awa_sa.retry_failed(conn, **by),
        )
        assert set(changed) >= RETRIED, (by, sorted(changed))
        assert (got_sa.matched, got_sa.pruned_failed_count) == (
            got_pg.matched,
            got_pg.pruned_failed_count,
        ), by
        assert len(got_sa.jobs) == len(got_pg.jobs) == 2, by
        for sa_job, pg_job in zip(
            got_sa.jobs, sorted(got_pg.jobs, key=lambda j: j.id), strict=True
        ):
            same_job(sa_job, pg_job)
            assert sa_job.storage == "awa_qs"
        assert notes, by


def test_discard_failed_writes_what_awa_pg_writes(mixed: Twins) -> None:
    got_pg, got_sa, changed, notes = _twins(
        mixed,
        lambda c: c.discard_failed("fails_discard"),
        lambda conn: awa_sa.discard_failed(conn, "fails_discard"),
    )
    assert got_sa == got_pg == 2
    assert {"awa_qs.done_entries", "awa_qs.queue_terminal_count_deltas"} <= set(changed)
    assert notes == []


def test_a_callback_wait_is_cancelled_and_retried_as_awa_pg(mixed: Twins) -> None:
    """Parked in ``awa_qs`` by a real handler: the lease deleted, its receipt closed, then the
    cancelled row (with the ``awa:cancel`` NOTIFY), or the job enqueued again."""
    cancelled, retried = WAITING
    got_pg, got_sa, changed, notes = _twins(
        mixed, lambda c: c.cancel(cancelled), lambda conn: awa_sa.cancel_job(conn, cancelled)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage) == ("cancelled", "awa_qs")
    assert {"awa_qs.leases", "awa_qs.done_entries", "awa_qs.lease_claim_closures"} <= set(changed)
    assert notes == [("awa:cancel", f'{{"job_id":{cancelled},"run_lease":1}}')]
    got_pg, got_sa, changed, notes = _twins(
        mixed, lambda c: c.retry(retried), lambda conn: awa_sa.retry_job(conn, retried)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage, got_sa.attempt) == ("available", "awa_qs", 0)
    assert set(changed) >= RETRIED - {"awa_qs.done_entries", "awa_qs.queue_terminal_count_deltas"}
    assert [channel for channel, _ in notes] == ["awa:cb_q"]


async def _to_dlq(client: awa.AsyncClient, job_id: int) -> Any:
    return await client.move_failed_to_dlq(job_id, "poison")


def test_dlq_retries_write_what_awa_pg_writes(mixed: Twins) -> None:
    """Two failed jobs of ``awa_qs`` filed in its DLQ by awa-pg's own move on both twins: one
    retried by id, the other by kind."""
    for url in mixed.urls:
        for job_id in DEAD:
            pg_call(url, partial(_to_dlq, job_id=job_id))
    revived = {"awa_qs.dlq_entries", "awa_qs.ready_entries", "awa_qs.ready_segments", "sequences"}
    got_pg, got_sa, changed, notes = _twins(
        mixed,
        lambda c: c.retry_from_dlq(DEAD[0]),
        lambda conn: awa_sa.retry_from_dlq(conn, DEAD[0]),
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.storage, got_sa.attempt) == ("available", "awa_qs", 0)
    assert set(changed) >= revived | {"awa.job_unique_claims"}, sorted(changed)
    assert notes == [("awa:work_q", "")]
    got_pg, got_sa, changed, notes = _twins(
        mixed,
        lambda c: c.bulk_retry_from_dlq(kind="fails_dlq"),
        lambda conn: awa_sa.bulk_retry_from_dlq(conn, kind="fails_dlq"),
    )
    assert got_pg == got_sa == 1
    assert set(changed) >= revived, sorted(changed)
    assert notes == [("awa:dlq_q", "")]
