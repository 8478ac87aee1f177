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
from collections.abc import Iterable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar, cast

try:  # SQLAlchemy's own message would name its extra, not ours
    importlib.import_module("greenlet")
except ImportError as exc:
    raise ImportError(
        "awa_sa.asyncio needs greenlet: pip install 'awa-sa[async]' (or 'awa-sa[asyncpg]')"
    ) from exc

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from awa_sa.administer.api_async import (
    bulk_move_failed_to_dlq,
    bulk_retry_from_dlq,
    cancel_by_unique_key,
    cancel_job,
    discard_failed,
    dlq_depth,
    drain_queue,
    get_dlq_job,
    list_dlq,
    move_failed_to_dlq,
    pause_queue,
    purge_dlq,
    purge_dlq_job,
    resume_queue,
    retry_failed,
    retry_from_dlq,
    retry_job,
)
from awa_sa.callbacks.api_async import (
    complete_external,
    fail_external,
    heartbeat_callback,
    resolve_callback,
    resume_external,
    retry_external,
)
from awa_sa.core.async_binds import administered, check_bind, on_sync
from awa_sa.enqueue.api_async import enqueue, enqueue_many
from awa_sa.read.api_async import get_job, list_jobs, queue_stats
from awa_sa.settle import binds as forms
from awa_sa.settle.api import settlings
from awa_sa.settle.by_job import settle_job_step
from awa_sa.settle.inputs import (
    AnyCall,
    prepare,
    prepare_all,
    prepare_batch,
    prepare_result,
    settling,
)
from awa_sa.settle.results import Attempt, Ending, Kind, Outcome, Result, Settle, Settlement
from awa_sa.settle.running import JobLike, RunningAttempt
from awa_sa.settle.running import attempt_of as _sync_attempt_of
from awa_sa.settle.running import running_attempts as _sync_running_attempts

_T = TypeVar("_T")

__all__ = [
    "attempt_of",
    "bulk_move_failed_to_dlq",
    "bulk_retry_from_dlq",
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
    "resolve_callback",
    "resume_external",
    "resume_queue",
    "retry_external",
    "retry_failed",
    "retry_from_dlq",
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
    check_bind(bind)
    outcome = (await _within(bind, [prepare(job_id, run_lease, kind, error, progress)]))[0]
    return cast(Outcome, outcome)  # a re-schedule's


async def reschedule_canonical_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, attempts: Iterable[Attempt]
) -> list[Outcome]:
    """Async :func:`awa_sa.reschedule_canonical_attempts`; same arguments, outcomes and errors."""
    check_bind(bind)
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
    check_bind(bind)
    return (await _within(bind, [prepare_result(job_id, run_lease, result, error, progress)]))[0]


async def settle_canonical_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, attempts: Iterable[Settle | Attempt]
) -> list[Ending]:
    """Async :func:`awa_sa.settle_canonical_attempts`; same arguments, outcomes and errors."""
    check_bind(bind)
    calls = prepare_batch(attempts)
    return await _within(bind, calls) if calls else []


async def settle(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    attempt: RunningAttempt | JobLike,
    result: Result,
    *,
    error: Any = None,
    progress: Any = None,
) -> Ending:
    """Async :func:`awa_sa.settle`; same arguments, outcomes and errors."""
    check_bind(bind)
    if not isinstance(attempt, RunningAttempt):
        return await administered(bind, settle_job_step(attempt, result, error, progress))
    return (await _within(bind, [settling(attempt, result, error, progress)]))[0]


async def settle_attempts(
    bind: AsyncEngine | AsyncConnection | AsyncSession, settlements: Iterable[Settlement]
) -> list[Ending]:
    """Async :func:`awa_sa.settle_attempts`; same arguments, outcomes and errors."""
    check_bind(bind)
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
    check_bind(bind)
    listing = partial(
        _sync_running_attempts,
        queue=queue,
        kind=kind,
        running_for=running_for,
        job_id=job_id,
        attempt=attempt,
        limit=limit,
    )
    return await on_sync(bind, listing)


async def attempt_of(
    bind: AsyncEngine | AsyncConnection | AsyncSession, job: JobLike | Any
) -> RunningAttempt:
    """Async :func:`awa_sa.attempt_of`; same arguments, result and errors.

    In an awa-pg handler, ``job`` is the ``Job`` the handler was given, and ``bind`` the
    connection whose transaction then writes the handler's rows and settles the attempt.
    """
    check_bind(bind)
    return await on_sync(bind, _sync_attempt_of, job)


async def _within(
    bind: AsyncEngine | AsyncConnection | AsyncSession, calls: Sequence[AnyCall]
) -> list[Ending]:
    return await on_sync(bind, forms.in_transaction, calls, engine_form=forms.within)
