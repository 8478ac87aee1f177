"""The async twins of the callback calls, re-exported by :mod:`awa_sa.asyncio`: each runs its
sync step through the async bridge (:mod:`awa_sa.core.async_binds`)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from awa_sa.callbacks import api as callbacks
from awa_sa.callbacks.expressions import DefaultAction
from awa_sa.callbacks.resolve import Resolved
from awa_sa.core.async_binds import AsyncBind, administered
from awa_sa.core.job_rows import JobRow


async def complete_external(
    bind: AsyncBind,
    callback_id: str | UUID,
    payload: Any | None = None,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.complete_external`; same arguments, result and errors."""
    return await administered(
        bind, callbacks.complete_external_step(callback_id, payload, run_lease)
    )


async def fail_external(
    bind: AsyncBind,
    callback_id: str | UUID,
    error: str,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.fail_external`; same arguments, result and errors."""
    return await administered(bind, callbacks.fail_external_step(callback_id, error, run_lease))


async def retry_external(bind: AsyncBind, callback_id: str | UUID) -> JobRow | None:
    """Async :func:`awa_sa.retry_external`; same arguments, result and errors."""
    return await administered(bind, callbacks.retry_external_step(callback_id))


async def resume_external(
    bind: AsyncBind,
    callback_id: str | UUID,
    payload: Any | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.resume_external`; same arguments, result and errors."""
    return await administered(bind, callbacks.resume_external_step(callback_id, payload))


async def heartbeat_callback(
    bind: AsyncBind,
    callback_id: str | UUID,
    timeout_seconds: float = 3600.0,
) -> JobRow | None:
    """Async :func:`awa_sa.heartbeat_callback`; same arguments, result and errors."""
    return await administered(bind, callbacks.heartbeat_callback_step(callback_id, timeout_seconds))


async def resolve_callback(
    bind: AsyncBind,
    callback_id: str | UUID,
    payload: Any | None = None,
    default_action: DefaultAction = "ignore",
    *,
    run_lease: int | None = None,
) -> Resolved | None:
    """Async :func:`awa_sa.resolve_callback`; same arguments, result and errors."""
    step = callbacks.resolve_callback_step(callback_id, payload, default_action, run_lease)
    return await administered(bind, step)
