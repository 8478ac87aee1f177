"""The async face of enqueueing, re-exported by :mod:`awa_sa.asyncio`.

As the async settles do, it checks every job first and then runs the sync insert
(:mod:`awa_sa.enqueue.api`) in SQLAlchemy's greenlet bridge: an ``AsyncEngine``'s whole Engine form
in one kept greenlet, an ``AsyncConnection``'s (or an ``AsyncSession``'s current connection's)
insert on its sync Connection. Imported only through :mod:`awa_sa.asyncio`, which checks that
greenlet is installed first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, Unpack, overload

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from awa_sa.core.binds import session_dialect
from awa_sa.core.driver_errors import translated_error
from awa_sa.core.drivers import check_dialect
from awa_sa.core.errors import ValidationError
from awa_sa.core.internals import run_in_greenlet
from awa_sa.core.unique_keys import Unique
from awa_sa.enqueue import api as sync
from awa_sa.enqueue.api import OnDuplicate, prepare_batch
from awa_sa.enqueue.new_jobs import Duplicate, EnqueuedJob, NewJob, Options, batch_of, prepare
from awa_sa.enqueue.statements import Batch

AsyncBind = AsyncEngine | AsyncConnection | AsyncSession


async def enqueue(
    bind: AsyncBind,
    args: Any,
    *,
    kind: str | None = None,
    queue: str = "default",
    priority: int = 2,
    max_attempts: int = 25,
    tags: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    run_at: datetime | str | None = None,
    unique_opts: Mapping[str, Any] | Unique | None = None,
    ordering_key: bytes | str | None = None,
) -> EnqueuedJob:
    """Async :func:`awa_sa.enqueue`; same arguments, rows and errors."""
    _check_bind(bind)
    job = NewJob(
        args,
        kind=kind,
        queue=queue,
        priority=priority,
        max_attempts=max_attempts,
        tags=tags,
        metadata=metadata,
        run_at=run_at,
        unique_opts=unique_opts,
        ordering_key=ordering_key,
    )
    (row,) = await _within(bind, batch_of([prepare(job)]), "raise")
    assert isinstance(row, EnqueuedJob)  # "raise" answers no Duplicate
    return row


@overload
async def enqueue_many(
    bind: AsyncBind,
    jobs: Iterable[Any],
    *,
    on_duplicate: Literal["raise"] = ...,
    **options: Unpack[Options],
) -> list[EnqueuedJob]: ...


@overload
async def enqueue_many(
    bind: AsyncBind,
    jobs: Iterable[Any],
    *,
    on_duplicate: Literal["skip"],
    **options: Unpack[Options],
) -> list[EnqueuedJob | Duplicate]: ...


async def enqueue_many(
    bind: AsyncBind,
    jobs: Iterable[Any],
    *,
    on_duplicate: OnDuplicate = "raise",
    **options: Unpack[Options],
) -> list[EnqueuedJob] | list[EnqueuedJob | Duplicate]:
    """Async :func:`awa_sa.enqueue_many`; same arguments, rows and errors."""
    _check_bind(bind)
    prepared = prepare_batch(jobs, on_duplicate, options)._replace(many=True)
    return await _within(bind, prepared, on_duplicate) if prepared.jobs else []


def _check_bind(bind: object) -> None:
    if isinstance(bind, AsyncEngine | AsyncConnection):
        check_dialect(bind.dialect, is_async=True)
    elif isinstance(bind, AsyncSession):
        check_dialect(session_dialect(bind.sync_session), is_async=True)
    else:
        raise ValidationError(
            "bind must be a sqlalchemy AsyncEngine, AsyncConnection or AsyncSession, got "
            f"{type(bind).__name__} (use the awa_sa functions for sync binds)"
        )


async def _within(bind: AsyncBind, jobs: Batch, on_duplicate: OnDuplicate) -> list[Any]:
    if isinstance(bind, AsyncEngine):
        return await run_in_greenlet(sync.within, bind.sync_engine, jobs, on_duplicate)
    try:  # a Session's autobegin, or a connection not started
        if isinstance(bind, AsyncSession):
            bind = await bind.connection()
        if bind.sync_connection is None:
            return await bind.run_sync(sync.in_transaction, jobs, on_duplicate)
        return await run_in_greenlet(sync.in_transaction, bind.sync_connection, jobs, on_duplicate)
    except Exception as exc:
        raise translated_error(exc)  # noqa: B904 -- translated() chained it already
