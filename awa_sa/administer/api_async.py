"""The async twins of the administering calls, re-exported by :mod:`awa_sa.asyncio`: each runs
its sync step through the async bridge (:mod:`awa_sa.core.async_binds`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from awa_sa.administer import api as administer
from awa_sa.administer import dead_letters as dlq
from awa_sa.administer import dlq_retry, queue_control
from awa_sa.administer.dead_letters import DlqEntry
from awa_sa.core.async_binds import AsyncBind, administered
from awa_sa.core.job_rows import JobRow


async def cancel_job(bind: AsyncBind, job_id: int) -> JobRow | None:
    """Async :func:`awa_sa.cancel_job`; same arguments, result and errors."""
    return await administered(bind, administer.cancel_job_step(job_id))


async def cancel_by_unique_key(
    bind: AsyncBind,
    kind: str,
    *,
    queue: str | None = None,
    args: Any | None = None,
    period_bucket: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.cancel_by_unique_key`; same arguments, result and errors."""
    step = administer.cancel_by_unique_key_step(kind, queue, args, period_bucket)
    return await administered(bind, step)


async def retry_job(bind: AsyncBind, job_id: int) -> JobRow | None:
    """Async :func:`awa_sa.retry_job`; same arguments, result and errors."""
    return await administered(bind, administer.retry_job_step(job_id))


async def retry_failed(
    bind: AsyncBind,
    *,
    kind: str | None = None,
    queue: str | None = None,
) -> administer.RetriedFailed:
    """Async :func:`awa_sa.retry_failed`; same arguments, result and errors."""
    return await administered(bind, administer.retry_failed_step(kind, queue))


async def discard_failed(bind: AsyncBind, kind: str) -> int:
    """Async :func:`awa_sa.discard_failed`; same arguments, result and errors."""
    return await administered(bind, administer.discard_failed_step(kind))


async def drain_queue(bind: AsyncBind, queue: str) -> int:
    """Async :func:`awa_sa.drain_queue`; same arguments, result and errors."""
    return await administered(bind, queue_control.drain_queue_step(queue))


async def pause_queue(bind: AsyncBind, queue: str, paused_by: str | None = None) -> None:
    """Async :func:`awa_sa.pause_queue`; same arguments, result and errors."""
    return await administered(bind, queue_control.pause_queue_step(queue, paused_by))


async def resume_queue(bind: AsyncBind, queue: str) -> None:
    """Async :func:`awa_sa.resume_queue`; same arguments, result and errors."""
    return await administered(bind, queue_control.resume_queue_step(queue))


async def list_dlq(
    bind: AsyncBind,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    before_dlq_at: datetime | None = None,
    limit: int = 100,
) -> list[DlqEntry]:
    """Async :func:`awa_sa.list_dlq`; same arguments, result and errors."""
    step = dlq.list_dlq_step(
        limit, kind=kind, queue=queue, tag=tag, before_id=before_id, before_dlq_at=before_dlq_at
    )
    return await administered(bind, step)


async def get_dlq_job(bind: AsyncBind, job_id: int) -> DlqEntry | None:
    """Async :func:`awa_sa.get_dlq_job`; same arguments, result and errors."""
    return await administered(bind, dlq.get_dlq_job_step(job_id))


async def dlq_depth(bind: AsyncBind, *, queue: str | None = None) -> int:
    """Async :func:`awa_sa.dlq_depth`; same arguments, result and errors."""
    return await administered(bind, dlq.dlq_depth_step(queue))


async def move_failed_to_dlq(bind: AsyncBind, job_id: int, reason: str) -> DlqEntry | None:
    """Async :func:`awa_sa.move_failed_to_dlq`; same arguments, result and errors."""
    return await administered(bind, dlq.move_failed_to_dlq_step(job_id, reason))


async def bulk_move_failed_to_dlq(
    bind: AsyncBind,
    *,
    kind: str | None = None,
    queue: str | None = None,
    reason: str = "manual",
    allow_all: bool = False,
) -> int:
    """Async :func:`awa_sa.bulk_move_failed_to_dlq`; same arguments, result and errors."""
    step = dlq.bulk_move_failed_to_dlq_step(kind, queue, reason, allow_all)
    return await administered(bind, step)


async def purge_dlq(
    bind: AsyncBind,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    before_dlq_at: datetime | None = None,
    allow_all: bool = False,
) -> int:
    """Async :func:`awa_sa.purge_dlq`; same arguments, result and errors."""
    step = dlq.purge_dlq_step(
        allow_all, kind=kind, queue=queue, tag=tag, before_id=before_id, before_dlq_at=before_dlq_at
    )
    return await administered(bind, step)


async def purge_dlq_job(bind: AsyncBind, job_id: int) -> bool:
    """Async :func:`awa_sa.purge_dlq_job`; same arguments, result and errors."""
    return await administered(bind, dlq.purge_dlq_job_step(job_id))


async def retry_from_dlq(
    bind: AsyncBind,
    job_id: int,
    *,
    run_at: datetime | None = None,
    priority: int | None = None,
    queue: str | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.retry_from_dlq`; same arguments, result and errors."""
    return await administered(bind, dlq_retry.retry_from_dlq_step(job_id, run_at, priority, queue))


async def bulk_retry_from_dlq(
    bind: AsyncBind,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    allow_all: bool = False,
) -> int:
    """Async :func:`awa_sa.bulk_retry_from_dlq`; same arguments, result and errors."""
    step = dlq_retry.bulk_retry_from_dlq_step(kind, queue, tag, allow_all)
    return await administered(bind, step)
