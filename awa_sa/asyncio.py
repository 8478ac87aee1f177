"""The async face: the same flow on ``AsyncEngine``/``AsyncConnection`` (psycopg 3 or asyncpg).

The sync flow runs in SQLAlchemy's greenlet bridge, so there is one copy of the decision logic
and both faces send the same compiled statements. An ``AsyncConnection`` runs it in a greenlet
on its sync Connection, as ``run_sync`` would. An ``AsyncEngine`` runs the whole sync Engine
form (checkout, the one statement in autocommit -- or BEGIN, the flow, COMMIT when it says to
go on -- and checkin) in one greenlet, as ``AsyncConnection`` runs each of those steps, rather
than one greenlet and event-loop round per step: ``async with engine.begin()`` costs five of
them and a task. The greenlet is a kept one (``awa_sa.core.internals.run_in_greenlet``), not a new
one per call. The sync engine, its pool and its events are the same either way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar, cast
from uuid import UUID

try:  # SQLAlchemy's own message would name its extra, not ours
    importlib.import_module("greenlet")
except ImportError as exc:
    raise ImportError(
        "awa_sa.asyncio needs greenlet: pip install 'awa-sa[async]' (or 'awa-sa[asyncpg]')"
    ) from exc

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from awa_sa.administer import api as administer
from awa_sa.administer import dead_letters as dlq
from awa_sa.administer import queue_control
from awa_sa.administer.dead_letters import DlqEntry
from awa_sa.callbacks import api as callbacks
from awa_sa.core import binds
from awa_sa.core.driver_errors import translated_error
from awa_sa.core.drivers import check_dialect
from awa_sa.core.errors import ValidationError
from awa_sa.core.internals import run_in_greenlet
from awa_sa.core.job_rows import JobRow
from awa_sa.enqueue.api_async import enqueue, enqueue_many
from awa_sa.read import api as reads
from awa_sa.read.statements.stats import QueueStat
from awa_sa.settle import binds as forms
from awa_sa.settle.api import settling, settlings
from awa_sa.settle.inputs import AnyCall, prepare, prepare_all, prepare_batch, prepare_result
from awa_sa.settle.results import Attempt, Ending, Kind, Outcome, Result, Settle, Settlement
from awa_sa.settle.running import JobLike, RunningAttempt
from awa_sa.settle.running import attempt_of as _sync_attempt_of
from awa_sa.settle.running import running_attempts as _sync_running_attempts

_T = TypeVar("_T")

__all__ = [
    "attempt_of",
    "bulk_move_failed_to_dlq",
    "cancel_by_unique_key",
    "cancel_job",
    "complete_external",
    "discard_failed",
    "dlq_depth",
    "drain_queue",
    "enqueue",
    "enqueue_many",
    "fail_external",
    "get_dlq_job",
    "get_job",
    "heartbeat_callback",
    "list_dlq",
    "list_jobs",
    "move_failed_to_dlq",
    "pause_queue",
    "purge_dlq",
    "purge_dlq_job",
    "queue_stats",
    "reschedule_canonical_attempt",
    "reschedule_canonical_attempts",
    "resume_external",
    "resume_queue",
    "retry_external",
    "retry_failed",
    "retry_job",
    "running_attempts",
    "settle",
    "settle_attempts",
    "settle_canonical_attempt",
    "settle_canonical_attempts",
]


async def reschedule_canonical_attempt(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    job_id: int,
    run_lease: int,
    kind: Kind,
    *,
    error: Any = None,
    progress: Any = None,
) -> Outcome:
    """Async :func:`awa_sa.reschedule_canonical_attempt`; same arguments, outcomes and errors.

    An ``AsyncSession`` joins its current transaction, as an ``AsyncConnection`` does, and is
    never committed here.

    Input is validated before a connection is even checked out. With ``engine``'s database
    reached through an ``AsyncEngine`` (psycopg 3 here; asyncpg works alike)::

        >>> import asyncio
        >>> from sqlalchemy.ext.asyncio import create_async_engine
        >>> import awa_sa.asyncio
        >>> from awa_sa import Rescheduled, RetryBackoff
        >>> from awa_sa.testing import running_attempt
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(conn)
        >>> async def retry() -> object:
        ...     async_engine = create_async_engine(engine.url)
        ...     try:
        ...         return await awa_sa.asyncio.reschedule_canonical_attempt(
        ...             async_engine, job_id, lease, RetryBackoff()
        ...         )
        ...     finally:
        ...         await async_engine.dispose()
        >>> isinstance(asyncio.run(retry()), Rescheduled)
        True
    """
    _check_bind(bind)
    outcome = (await _within(bind, [prepare(job_id, run_lease, kind, error, progress)]))[0]
    return cast(Outcome, outcome)  # a re-schedule's


async def reschedule_canonical_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, attempts: Iterable[Attempt]
) -> list[Outcome]:
    """Async :func:`awa_sa.reschedule_canonical_attempts`; same arguments, outcomes and errors."""
    _check_bind(bind)
    calls = prepare_all(attempts)
    return cast(list[Outcome], await _within(bind, calls)) if calls else []


async def settle_canonical_attempt(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    job_id: int,
    run_lease: int,
    result: Result,
    *,
    error: Any = None,
    progress: Any = None,
) -> Ending:
    """Async :func:`awa_sa.settle_canonical_attempt`; same arguments, outcomes and errors."""
    _check_bind(bind)
    return (await _within(bind, [prepare_result(job_id, run_lease, result, error, progress)]))[0]


async def settle_canonical_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, attempts: Iterable[Settle | Attempt]
) -> list[Ending]:
    """Async :func:`awa_sa.settle_canonical_attempts`; same arguments, outcomes and errors."""
    _check_bind(bind)
    calls = prepare_batch(attempts)
    return await _within(bind, calls) if calls else []


async def settle(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    attempt: RunningAttempt,
    result: Result,
    *,
    error: Any = None,
    progress: Any = None,
) -> Ending:
    """Async :func:`awa_sa.settle`; same arguments, outcomes and errors."""
    _check_bind(bind)
    return (await _within(bind, [settling(attempt, result, error, progress)]))[0]


async def settle_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, settlements: Iterable[Settlement]
) -> list[Ending]:
    """Async :func:`awa_sa.settle_attempts`; same arguments, outcomes and errors."""
    _check_bind(bind)
    calls = settlings(settlements)
    return await _within(bind, calls) if calls else []


async def running_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    *,
    queue: str | None = None,
    kind: str | None = None,
    running_for: timedelta | None = None,
    job_id: int | None = None,
    attempt: int | None = None,
    limit: int | None = None,
) -> list[RunningAttempt]:
    """Async :func:`awa_sa.running_attempts`; same arguments, results and errors.

    An ``AsyncConnection`` or ``AsyncSession`` reads in its transaction; an ``AsyncEngine``
    opens one connection for the reads.
    """
    _check_bind(bind)
    listing = partial(
        _sync_running_attempts,
        queue=queue,
        kind=kind,
        running_for=running_for,
        job_id=job_id,
        attempt=attempt,
        limit=limit,
    )
    return await _on_sync(bind, listing)


async def attempt_of(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job: JobLike | Any
) -> RunningAttempt:
    """Async :func:`awa_sa.attempt_of`; same arguments, result and errors.

    In an awa-pg handler, ``job`` is the ``Job`` the handler was given, and ``bind`` the
    connection whose transaction then writes the handler's rows and settles the attempt.
    """
    _check_bind(bind)
    return await _on_sync(bind, _sync_attempt_of, job)


async def cancel_job(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int
) -> JobRow | None:
    """Async :func:`awa_sa.cancel_job`; same arguments, result and errors."""
    return await _administered(bind, administer.cancel_job_step(job_id))


async def cancel_by_unique_key(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    kind: str,
    *,
    queue: str | None = None,
    args: Any | None = None,
    period_bucket: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.cancel_by_unique_key`; same arguments, result and errors."""
    step = administer.cancel_by_unique_key_step(kind, queue, args, period_bucket)
    return await _administered(bind, step)


async def retry_job(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int
) -> JobRow | None:
    """Async :func:`awa_sa.retry_job`; same arguments, result and errors."""
    return await _administered(bind, administer.retry_job_step(job_id))


async def retry_failed(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    *,
    kind: str | None = None,
    queue: str | None = None,
) -> administer.RetriedFailed:
    """Async :func:`awa_sa.retry_failed`; same arguments, result and errors."""
    return await _administered(bind, administer.retry_failed_step(kind, queue))


async def discard_failed(bind: AsyncEngine | AsyncConnection | AsyncSession, kind: str) -> int:
    """Async :func:`awa_sa.discard_failed`; same arguments, result and errors."""
    return await _administered(bind, administer.discard_failed_step(kind))


async def drain_queue(bind: AsyncEngine | AsyncConnection | AsyncSession, queue: str) -> int:
    """Async :func:`awa_sa.drain_queue`; same arguments, result and errors."""
    return await _administered(bind, queue_control.drain_queue_step(queue))


async def pause_queue(
    bind: AsyncEngine | AsyncConnection | AsyncSession, queue: str, paused_by: str | None = None
) -> None:
    """Async :func:`awa_sa.pause_queue`; same arguments, result and errors."""
    return await _administered(bind, queue_control.pause_queue_step(queue, paused_by))


async def resume_queue(bind: AsyncEngine | AsyncConnection | AsyncSession, queue: str) -> None:
    """Async :func:`awa_sa.resume_queue`; same arguments, result and errors."""
    return await _administered(bind, queue_control.resume_queue_step(queue))


async def list_dlq(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
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
    return await _administered(bind, step)


async def get_dlq_job(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int
) -> DlqEntry | None:
    """Async :func:`awa_sa.get_dlq_job`; same arguments, result and errors."""
    return await _administered(bind, dlq.get_dlq_job_step(job_id))


async def dlq_depth(
    bind: AsyncEngine | AsyncConnection | AsyncSession, *, queue: str | None = None
) -> int:
    """Async :func:`awa_sa.dlq_depth`; same arguments, result and errors."""
    return await _administered(bind, dlq.dlq_depth_step(queue))


async def move_failed_to_dlq(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int, reason: str
) -> DlqEntry | None:
    """Async :func:`awa_sa.move_failed_to_dlq`; same arguments, result and errors."""
    return await _administered(bind, dlq.move_failed_to_dlq_step(job_id, reason))


async def bulk_move_failed_to_dlq(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    *,
    kind: str | None = None,
    queue: str | None = None,
    reason: str = "manual",
    allow_all: bool = False,
) -> int:
    """Async :func:`awa_sa.bulk_move_failed_to_dlq`; same arguments, result and errors."""
    step = dlq.bulk_move_failed_to_dlq_step(kind, queue, reason, allow_all)
    return await _administered(bind, step)


async def purge_dlq(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
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
    return await _administered(bind, step)


async def purge_dlq_job(bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int) -> bool:
    """Async :func:`awa_sa.purge_dlq_job`; same arguments, result and errors."""
    return await _administered(bind, dlq.purge_dlq_job_step(job_id))


async def get_job(bind: AsyncEngine | AsyncConnection | AsyncSession, job_id: int) -> JobRow | None:
    """Async :func:`awa_sa.get_job`; same arguments, result and errors. An ``AsyncConnection``
    or ``AsyncSession`` reads in its transaction."""
    _check_bind(bind)
    return await _on_sync(bind, reads.read, reads.get_job_step(job_id))


async def list_jobs(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    *,
    state: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[JobRow]:
    """Async :func:`awa_sa.list_jobs`; same arguments, result and errors."""
    _check_bind(bind)
    step = reads.list_jobs_step(state, kind, queue, tag=tag, before_id=before_id, limit=limit)
    return await _on_sync(bind, reads.read, step)


async def queue_stats(bind: AsyncEngine | AsyncConnection | AsyncSession) -> list[QueueStat]:
    """Async :func:`awa_sa.queue_stats`; same arguments, result and errors."""
    _check_bind(bind)
    return await _on_sync(bind, reads.read, reads.queue_stats_step())


async def complete_external(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    callback_id: str | UUID,
    payload: Any | None = None,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.complete_external`; same arguments, result and errors."""
    return await _administered(
        bind, callbacks.complete_external_step(callback_id, payload, run_lease)
    )


async def fail_external(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    callback_id: str | UUID,
    error: str,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.fail_external`; same arguments, result and errors."""
    return await _administered(bind, callbacks.fail_external_step(callback_id, error, run_lease))


async def retry_external(
    bind: AsyncEngine | AsyncConnection | AsyncSession, callback_id: str | UUID
) -> JobRow | None:
    """Async :func:`awa_sa.retry_external`; same arguments, result and errors."""
    return await _administered(bind, callbacks.retry_external_step(callback_id))


async def resume_external(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    callback_id: str | UUID,
    payload: Any | None = None,
) -> JobRow | None:
    """Async :func:`awa_sa.resume_external`; same arguments, result and errors."""
    return await _administered(bind, callbacks.resume_external_step(callback_id, payload))


async def heartbeat_callback(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    callback_id: str | UUID,
    timeout_seconds: float = 3600.0,
) -> JobRow | None:
    """Async :func:`awa_sa.heartbeat_callback`; same arguments, result and errors."""
    return await _administered(
        bind, callbacks.heartbeat_callback_step(callback_id, timeout_seconds)
    )


async def _administered(
    bind: AsyncEngine | AsyncConnection | AsyncSession, step: administer.Step[_T]
) -> _T:
    _check_bind(bind)
    return await _on_sync(bind, binds.administer_in, step, engine_form=binds.administered)


def _check_bind(bind: object) -> None:
    if isinstance(bind, AsyncEngine | AsyncConnection):
        check_dialect(bind.dialect, is_async=True)
    elif isinstance(bind, AsyncSession):
        check_dialect(binds.session_dialect(bind.sync_session), is_async=True)
    else:
        raise ValidationError(
            "bind must be a sqlalchemy AsyncEngine, AsyncConnection or AsyncSession, got "
            f"{type(bind).__name__} (use the awa_sa functions for sync binds)"
        )


async def _within(
    bind: AsyncEngine | AsyncConnection | AsyncSession, calls: Sequence[AnyCall]
) -> list[Ending]:
    return await _on_sync(bind, forms.in_transaction, calls, engine_form=forms.within)


async def _on_sync(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    fn: Callable[..., _T],
    *args: Any,
    engine_form: Callable[..., _T] | None = None,
) -> _T:
    """``fn(conn, *args)`` on the sync Connection behind *bind*, or ``engine_form`` (else
    ``fn``) of the whole sync Engine, each in one kept greenlet (the module's docstring)."""
    if isinstance(bind, AsyncEngine):
        return await run_in_greenlet(engine_form or fn, bind.sync_engine, *args)
    try:  # a connection that died in the greenlet, or a Session's autobegin
        if isinstance(bind, AsyncSession):
            bind = await bind.connection()
        if bind.sync_connection is None:  # not started: run_sync raises SQLAlchemy's error
            return await bind.run_sync(fn, *args)
        return await run_in_greenlet(fn, bind.sync_connection, *args)
    except Exception as exc:
        # translated() entered only once something was raised (as in awa_sa.settle.binds)
        raise translated_error(exc)  # noqa: B904 -- translated() chained it already
