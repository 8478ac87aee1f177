"""A real awa-pg 0.6.9 worker claims and completes the jobs awa-sa enqueued, on both planes.

awa-sa enqueues in the caller's transaction and commits; the published runtime then claims
each job (canonical ``jobs_hot``, or the routing schema's ready entries once queue storage is
active), hands its handler the arguments awa-sa wrote (a dataclass back as that dataclass),
and completes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import Cluster
from runtimes import pg_url

import awa_sa

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
            for _ in range(WAIT_SECS * 100):  # the runtime's own pace: its completion flush
                health = await client.health_check()
                if all(q.in_flight == 0 for q in health.queues.values()):
                    break
                await asyncio.sleep(0.01)
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
