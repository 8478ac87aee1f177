"""The async twins of the reads, re-exported by :mod:`awa_sa.asyncio`: each runs its sync step
through the async bridge (:mod:`awa_sa.core.async_binds`)."""

from __future__ import annotations

from awa_sa.core.async_binds import AsyncBind, check_bind, on_sync
from awa_sa.core.job_rows import JobRow
from awa_sa.read import api as reads
from awa_sa.read.statements.stats import QueueStat


async def get_job(bind: AsyncBind, job_id: int) -> JobRow | None:
    """Async :func:`awa_sa.get_job`; same arguments, result and errors. An ``AsyncConnection``
    or ``AsyncSession`` reads in its transaction."""
    check_bind(bind)
    return await on_sync(bind, reads.read, reads.get_job_step(job_id))


async def list_jobs(
    bind: AsyncBind,
    *,
    state: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[JobRow]:
    """Async :func:`awa_sa.list_jobs`; same arguments, result and errors."""
    check_bind(bind)
    step = reads.list_jobs_step(state, kind, queue, tag=tag, before_id=before_id, limit=limit)
    return await on_sync(bind, reads.read, step)


async def queue_stats(bind: AsyncBind) -> list[QueueStat]:
    """Async :func:`awa_sa.queue_stats`; same arguments, result and errors."""
    check_bind(bind)
    return await on_sync(bind, reads.read, reads.queue_stats_step())
