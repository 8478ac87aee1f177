"""A real awa-pg 0.6.9 worker runs every job of a large set-based batch, and of none rolled back.

On an ``awa migrate`` cluster with queue storage active: a large batch committed by
``enqueue_many`` in two lanes of one queue (priorities 1 and 2), then a batch in lane 2 rolled
back in the caller's transaction, then a small one committed after it in the same lane. The
rolled-back batch leaves nothing but a gap in its lane's sequence. A real worker (:data:`SLOTS`
slots on the queue) must then be handed every committed job exactly once, claim each lane's
jobs in lane order (its receipts, in the order taken, walk ``lane_seq`` upwards, across the
gap) and complete them all.

The large batch is :data:`JOBS` jobs (2,000; ``AWA_SA_BULK_WORKER_JOBS=100000`` for the
issue's size, some minutes).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import awa
import pytest
from conftest import Cluster
from runtimes import STILL, pg_url, rows, until_idle

import awa_sa

JOBS = int(os.environ.get("AWA_SA_BULK_WORKER_JOBS", "2000"))
ROLLED_BACK = 300
"""The rolled-back batch: in the priority-2 lane, after the large one."""
AFTER = 100
SLOTS = 16
"""The batch committed after the rolled-back one, in the same lane."""


@pytest.mark.parametrize("real_plane", ["active"], indirect=True)
def test_a_real_worker_runs_every_job_of_a_large_batch_in_lane_order(real_plane: Cluster) -> None:
    cluster = real_plane
    jobs = [
        awa_sa.NewJob({"lane": 1 + n % 2, "n": n}, kind="b", queue="q", priority=1 + n % 2)
        for n in range(JOBS)
    ]
    with cluster.engine.connect() as conn:
        made = awa_sa.enqueue_many(conn, jobs)
        conn.commit()
    with cluster.engine.connect() as conn:
        gone = awa_sa.enqueue_many(
            conn, [{"lane": 2, "n": -n} for n in range(ROLLED_BACK)], kind="b", queue="q"
        )
        conn.rollback()
    after = [{"lane": 2, "n": JOBS + n} for n in range(AFTER)]
    with cluster.engine.connect() as conn:
        made += awa_sa.enqueue_many(conn, after, kind="b", queue="q")
        conn.commit()
    gone_ids = [job.id for job in gone]
    assert not set(gone_ids) & {job.id for job in made}
    lanes = rows(
        cluster.engine,
        "SELECT priority, count(*) AS n, min(lane_seq) AS first, max(lane_seq) AS last"
        " FROM awa_qs.ready_entries WHERE queue = 'q' GROUP BY priority ORDER BY priority",
    )
    half = JOBS // 2
    # Lane 2 has its batch's jobs, then nothing for the rolled-back ones (a gap), then the last.
    assert lanes == [
        {"priority": 1, "n": JOBS - half, "first": 1, "last": JOBS - half},
        {"priority": 2, "n": half + AFTER, "first": 1, "last": half + ROLLED_BACK + AFTER},
    ]
    seen: list[tuple[int, int, int]] = []
    done = asyncio.Event()

    async def handle(job: Any) -> None:
        seen.append((job.id, job.args["lane"], job.args["n"]))
        if len(seen) >= JOBS + AFTER:
            done.set()

    async def run() -> None:
        client = awa.AsyncClient(pg_url(cluster.url))
        client.task(dict, kind="b", queue="q")(handle)
        await client.start(
            [("q", SLOTS)],
            poll_interval_ms=20,
            heartbeat_interval_ms=600_000,
            queue_storage_schema="awa_qs",
            queue_storage_queue_rotate_interval_ms=STILL,
            queue_storage_lease_rotate_interval_ms=STILL,
            queue_storage_claim_rotate_interval_ms=STILL,
        )
        try:
            await asyncio.wait_for(done.wait(), 60 + JOBS / 100)
            await until_idle(client)
        finally:
            await client.shutdown()
            await client.close()

    asyncio.run(run())
    assert sorted(job_id for job_id, _, _ in seen) == sorted(job.id for job in made)  # none twice
    # Claimed in lane order: each lane's receipts, by receipt id, walk its lane_seq upwards.
    # The lane is the one the job was enqueued in: a receipt carries the priority the job was
    # claimed at, which Awa's aging lowers for a job that waited (the large size waits minutes).
    claims = rows(
        cluster.engine, "SELECT job_id, lane_seq FROM awa_qs.lease_claims ORDER BY receipt_id"
    )
    assert sorted(claim["job_id"] for claim in claims) == sorted(job.id for job in made)
    lane_of = {job.id: job.priority for job in made}
    for number in (1, 2):
        walked = [claim["lane_seq"] for claim in claims if lane_of[claim["job_id"]] == number]
        assert walked == sorted(walked)
        handed = [n for _, lane, n in seen if lane == number]
        assert sorted(handed) == [n for n in range(JOBS + AFTER) if _lane(n) == number]
    # Completed: a bare job's completion is a receipt_completion_batches entry (the runtime's
    # fast path), any other a done_entries row. Read there, not through the awa.jobs view,
    # which takes minutes over 100,000 finished queue-storage jobs.
    completed = rows(
        cluster.engine,
        "SELECT unnest(job_ids) AS job_id FROM awa_qs.receipt_completion_batches UNION ALL"
        " SELECT job_id FROM awa_qs.done_entries WHERE state = 'completed'",
    )
    assert sorted(row["job_id"] for row in completed) == sorted(job.id for job in made)
    for table in ("ready_entries", "deferred_jobs", "done_entries"):
        sql = f"SELECT job_id FROM awa_qs.{table} WHERE job_id = ANY(:ids)"
        assert rows(cluster.engine, sql, ids=gone_ids) == []


def _lane(n: int) -> int:
    """Job *n*'s lane: the large batch alternates, the batch after it is all in lane 2."""
    return 2 if n >= JOBS else 1 + n % 2
