"""``running_attempts`` against attempts a real Awa worker claimed (awa-pg 0.6.9, its runtime).

Two places hand over ``(job_id, run_lease)``: a handler of the worker itself, which has its
job but not the lease (it resolves the job with ``attempt_of``), and an admin tool, which knows
neither (it lists ``running_attempts``). Both are played
here on an ``awa migrate`` cluster, and the rows are read back after the worker has shut down:
the runtime's own completion of an attempt awa-sa already settled must change nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from runtimes import pg_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import (
    CANONICAL,
    Attempt,
    Rescheduled,
    RetryAfter,
    Snooze,
    attempt_of,
    reschedule_canonical_attempts,
    running_attempts,
)

pytestmark = pytest.mark.slow  # attempts claimed by a real awa-pg worker


@dataclass
class Mail:
    to: str


@dataclass
class Invoice:
    n: int


@dataclass
class Flaky:
    n: int


def run_worker(
    url: str, handlers: dict[type, Callable[[Any], Awaitable[Any]]], held: int, while_held: Any
) -> None:
    """Insert one job per ``(args, queue)``, let a real worker claim them, run *while_held*.

    Each handler is wrapped to count itself as holding once it runs; *while_held* (sync, in a
    thread) runs once *held* handlers are holding, then every handler is released.
    """

    async def run() -> None:
        client = awa.AsyncClient(pg_url(url))
        holding = asyncio.Semaphore(0)
        release = asyncio.Event()
        for args_type, handler in handlers.items():

            async def wrapped(job: Any, handler: Any = handler) -> Any:
                result = await handler(job)
                holding.release()
                await release.wait()
                return result

            queue = "billing" if args_type is Invoice else "mail"
            client.task(args_type, queue=queue)(wrapped)
        await client.insert(Mail(to="ada@example.com"), queue="mail")
        await client.insert(Mail(to="bob@example.com"), queue="mail")
        await client.insert(Invoice(n=1), queue="billing")
        await client.start([("mail", 4), ("billing", 4)], heartbeat_interval_ms=600_000)
        try:
            for _ in range(held):
                await asyncio.wait_for(holding.acquire(), 60)
            await asyncio.to_thread(while_held)
        finally:
            release.set()
            await client.shutdown()
            await client.close()

    asyncio.run(run())


async def holds(job: Any) -> None:
    return None


def placement(engine: sa.Engine) -> dict[str, list[tuple[str, str]]]:
    """Each job's kind -> [(table, state)], after the worker is gone."""
    query = """
        SELECT kind, 'jobs_hot', state::text FROM awa.jobs_hot
        UNION ALL SELECT kind, 'scheduled_jobs', state::text FROM awa.scheduled_jobs
        ORDER BY 1, 2, 3
    """
    out: dict[str, list[tuple[str, str]]] = {}
    with engine.connect() as conn:
        for kind, table, state in conn.exec_driver_sql(query):
            out.setdefault(kind, []).append((table, state))
    return out


def test_an_admin_tool_lists_and_snoozes_what_the_worker_holds(
    real_engine: sa.Engine, real_db_url: str
) -> None:
    seen: dict[str, Any] = {}

    def admin() -> None:
        every = running_attempts(real_engine)
        seen["every"] = every
        seen["mail"] = running_attempts(real_engine, queue="mail")
        seen["invoice"] = running_attempts(real_engine, kind="invoice")
        seen["old"] = running_attempts(real_engine, running_for=dt.timedelta(hours=1))
        seen["first"] = running_attempts(real_engine, limit=1)
        with real_engine.connect() as conn:
            leases: dict[int, int] = dict(
                conn.exec_driver_sql("SELECT id, run_lease FROM awa.jobs_hot").all()
            )
        seen["leases"] = leases
        batch = [Attempt(a.job_id, a.run_lease, Snooze(3600)) for a in seen["mail"]]
        seen["outcomes"] = reschedule_canonical_attempts(real_engine, batch)

    run_worker(real_db_url, {Mail: holds, Invoice: holds}, held=3, while_held=admin)
    every = seen["every"]
    assert sorted((a.kind, a.queue, a.attempt) for a in every) == [
        ("invoice", "billing", 1),
        ("mail", "mail", 1),
        ("mail", "mail", 1),
    ]
    assert {a.job_id: a.run_lease for a in every} == seen["leases"]
    assert {a.storage for a in every} == {CANONICAL}  # routing is canonical: one plane
    assert all(a.running_for >= dt.timedelta(0) and a.heartbeat_at is not None for a in every)
    assert [a.attempted_at for a in every] == sorted(a.attempted_at for a in every)
    assert [a.kind for a in seen["mail"]] == ["mail", "mail"]
    assert [a.queue for a in seen["invoice"]] == ["billing"]
    assert seen["old"] == []
    assert [a.job_id for a in seen["first"]] == [every[0].job_id]
    assert [type(o) for o in seen["outcomes"]] == [Rescheduled, Rescheduled]
    # The runtime's completion of the snoozed attempts found nothing: they stay snoozed.
    assert placement(real_engine) == {
        "invoice": [("jobs_hot", "completed")],
        "mail": [("scheduled_jobs", "scheduled"), ("scheduled_jobs", "scheduled")],
    }


def test_a_handler_finds_its_lease_and_retries_with_an_audit_row(
    real_engine: sa.Engine, real_db_url: str
) -> None:
    with real_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE audit (job_id bigint, outcome text)")
    engine: dict[str, AsyncEngine] = {}

    async def retries(job: Any) -> Any:
        # What a service's handler does when its work failed (docs/attempts.md): find the
        # claim, retry later, and write its audit row in the same transaction.
        if "engine" not in engine:
            engine["engine"] = create_async_engine(real_db_url, poolclass=sa.NullPool)
        async with engine["engine"].begin() as conn:
            mine = await conn.run_sync(attempt_of, job)
            if mine.on_queue_storage:
                return awa.RetryAfter(600)  # the runtime re-schedules it itself here
            outcome = await awa_async.settle(
                conn, mine, RetryAfter(3600), error={"error": "smtp down"}
            )
            await conn.execute(
                sa.text("INSERT INTO audit VALUES (:id, :outcome)"),
                {"id": job.id, "outcome": type(outcome).__name__},
            )

    run_worker(real_db_url, {Mail: retries, Invoice: holds}, held=3, while_held=lambda: None)
    with real_engine.connect() as conn:
        audit = sorted(conn.exec_driver_sql("SELECT outcome FROM audit").scalars())
        errors = conn.exec_driver_sql("SELECT errors FROM awa.scheduled_jobs").scalars().all()
    assert audit == ["Rescheduled", "Rescheduled"]  # both canonical: never the early return
    assert [e[-1]["error"] for e in errors] == ["smtp down", "smtp down"]
    assert placement(real_engine) == {
        "invoice": [("jobs_hot", "completed")],
        "mail": [("scheduled_jobs", "retryable"), ("scheduled_jobs", "retryable")],
    }
