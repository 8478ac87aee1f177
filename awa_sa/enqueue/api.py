"""Enqueueing jobs in the caller's transaction: ``enqueue`` and ``enqueue_many``.

Each call checks every job first (:mod:`awa_sa.enqueue.new_jobs`), then sends one statement
(:mod:`awa_sa.enqueue.statements`) in the bind's form: an ``Engine`` in a transaction of its
own, committed; a ``Connection`` or ``Session`` in the caller's, never committed here. A batch
is one statement whatever its size.

A job with a unique key runs under a savepoint, so that a duplicate (SQLSTATE 23505 from the
claim) rolls back only the insert and the caller's transaction goes on. On a conflict the batch
is replayed one job at a time, each unique job under its own savepoint, to find which position
is the duplicate: ``on_duplicate="raise"`` then rolls the whole batch back and raises
:class:`~awa_sa.core.errors.DuplicateJob` naming it; ``"skip"`` keeps the others and answers
:class:`~awa_sa.enqueue.new_jobs.Duplicate` at its position. The costs in round trips are in
docs/enqueue.md#duplicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Unpack, overload

from sqlalchemy import Connection, Engine

from awa_sa.core.binds import check_bind
from awa_sa.core.compiled import run
from awa_sa.core.driver_errors import translated, translated_error
from awa_sa.core.errors import (
    CONNECTION_LOST,
    DatabaseError,
    DuplicateJob,
    UniqueConflict,
    ValidationError,
)
from awa_sa.core.unique_keys import Unique
from awa_sa.enqueue.answers import collector_paused, enqueued
from awa_sa.enqueue.bulk_flow import set_based
from awa_sa.enqueue.new_jobs import (
    Duplicate,
    EnqueuedJob,
    NewJob,
    Options,
    Prepared,
    batch_of,
    prepare,
    shared_batch,
)
from awa_sa.enqueue.statements import INSERT_JOBS, UNIQUE_HOLDER, Batch

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

OnDuplicate = Literal["raise", "skip"]


def enqueue(
    bind: Engine | Connection | Session,
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
    """Enqueue one job as awa-pg 0.6.9's ``Client.insert`` does, in *bind*'s transaction.

    The keywords and their defaults are ``Client.insert``'s. The job goes where Awa's
    producer function puts new work in the current storage phase, with the same row, unique
    claim and NOTIFY; with a ``Connection`` or ``Session`` it becomes visible (and its NOTIFY
    is delivered) when the caller commits, and nothing is left if it rolls back.

    Raises :class:`~awa_sa.core.errors.ValidationError` before any statement,
    :class:`~awa_sa.core.errors.DuplicateJob` when another job holds its unique key (the caller's
    transaction is left usable), or :class:`~awa_sa.core.errors.DatabaseError`.
    """
    check_bind(bind)
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
    (row,) = within(bind, batch_of([prepare(job)]), "raise")
    assert isinstance(row, EnqueuedJob)  # "raise" answers no Duplicate
    return row


@overload
def enqueue_many(
    bind: Engine | Connection | Session,
    jobs: Iterable[Any],
    *,
    on_duplicate: Literal["raise"] = ...,
    **options: Unpack[Options],
) -> list[EnqueuedJob]: ...


@overload
def enqueue_many(
    bind: Engine | Connection | Session,
    jobs: Iterable[Any],
    *,
    on_duplicate: Literal["skip"],
    **options: Unpack[Options],
) -> list[EnqueuedJob | Duplicate]: ...


def enqueue_many(
    bind: Engine | Connection | Session,
    jobs: Iterable[Any],
    *,
    on_duplicate: OnDuplicate = "raise",
    **options: Unpack[Options],
) -> list[EnqueuedJob] | list[EnqueuedJob | Duplicate]:
    """Enqueue many jobs in one statement; their rows in input order.

    Each item of *jobs* is a :class:`~awa_sa.enqueue.new_jobs.NewJob`, or the args of a job that
    takes
    *options*: ``enqueue``'s keywords with its defaults, as awa-pg's ``insert_many_copy`` takes
    them for its list of args (a ``NewJob`` carries its own, and refuses the batch's).

    Every job is checked before any statement (a refusal names its index). With
    ``on_duplicate="raise"`` a duplicate anywhere writes none of the batch and raises
    :class:`~awa_sa.core.errors.DuplicateJob` with its ``index``; with ``"skip"`` the duplicate's
    position answers :class:`~awa_sa.enqueue.new_jobs.Duplicate` and the others are written. Two
    jobs of one batch with the same key are duplicates of each other: the later one is. An empty
    batch returns ``[]`` without touching the database.
    """
    check_bind(bind)
    prepared = prepare_batch(jobs, on_duplicate, options)._replace(many=True)
    return within(bind, prepared, on_duplicate) if prepared.jobs else []


@collector_paused()
def prepare_batch(jobs: object, on_duplicate: object, options: Mapping[str, Any]) -> Batch:
    """Every job of a batch checked, or the first one's reason to refuse.

    Args under the batch's options go as one ``shared`` batch where they can
    (:func:`~awa_sa.enqueue.new_jobs.shared_batch`), else each as its own job.
    """
    if on_duplicate not in ("raise", "skip"):
        raise ValidationError(f"on_duplicate must be 'raise' or 'skip', got {on_duplicate!r}")
    unknown = sorted(set(options) - set(Options.__annotations__))
    if unknown:
        raise TypeError(
            f"enqueue_many() got unexpected keyword arguments {unknown} (per-job options go "
            "in a NewJob)"
        )
    if isinstance(jobs, str | bytes | Mapping) or not isinstance(jobs, Iterable):
        raise ValidationError(
            f"jobs must be an iterable of NewJob or args, got {type(jobs).__name__}"
        )
    items = jobs if isinstance(jobs, list) else list(jobs)
    shared = NewJob(None, **options)
    if len(items) > 1 and not isinstance(items[0], NewJob):
        batch = shared_batch(items, shared)
        if batch is not None:
            return batch
    out = []
    for index, item in enumerate(items):
        try:
            if not isinstance(item, NewJob):
                out.append(prepare(dataclasses.replace(shared, args=item)))
                continue
            if options:
                raise ValidationError(
                    "a NewJob carries its own options; the batch's keywords are for args alone"
                )
            out.append(prepare(item))
        except ValidationError as exc:
            raise ValidationError(f"jobs[{index}]: {exc}") from exc
    return batch_of(out) if out else Batch(out, None)


def within(
    bind: Engine | Connection | Session, jobs: Batch, on_duplicate: OnDuplicate
) -> list[Any]:
    """*jobs* inserted in *bind*'s form: the Engine's own transaction, or the caller's.

    The Engine form has no caller's transaction to protect: its first try sends the statement
    without a savepoint, and only a conflict makes it try again, in a new transaction, the
    way the Connection form goes (to find the duplicate's position, or skip it).
    """
    if isinstance(bind, Engine):
        try:
            try:
                with bind.begin() as conn:
                    return in_transaction(conn, jobs, on_duplicate, guard=False)
            except _Conflict:
                with bind.begin() as conn:
                    return in_transaction(conn, jobs, on_duplicate)
        except Exception as exc:
            raise translated_error(exc)  # noqa: B904 -- translated() chained it already
    if not isinstance(bind, Connection):
        with translated():  # a Session's autobegin checks a connection out
            bind = bind.connection()
    return in_transaction(bind, jobs, on_duplicate)


class _Conflict(Exception):
    """The unguarded first try of the Engine form met a unique conflict."""


def in_transaction(
    conn: Connection, jobs: Batch, on_duplicate: OnDuplicate, *, guard: bool = True
) -> list[EnqueuedJob | Duplicate]:
    """The insert in whatever transaction *conn* has; translated, a dead connection invalidated.

    Without *guard* a unique job gets no savepoint, and a conflict raises ``_Conflict``.
    """
    try:
        return _insert(conn, jobs, on_duplicate, guard)
    except _Conflict:
        raise
    except Exception as exc:
        error = translated_error(exc)
        lost = isinstance(error, DatabaseError) and error.sqlstate == CONNECTION_LOST
        if lost and not conn.invalidated:
            with suppress(Exception):
                conn.invalidate()
        raise error  # noqa: B904 -- translated() chained it already


def _insert(
    conn: Connection, batch: Batch, on_duplicate: OnDuplicate, guard: bool
) -> list[EnqueuedJob | Duplicate]:
    done = set_based(conn, batch, on_duplicate, guard)
    if isinstance(done, list):
        return done
    jobs = batch.jobs
    if all(job.unique_key is None for job in jobs):
        return [*enqueued(jobs, run(conn, done, batch))]
    if not guard:
        try:
            return [*enqueued(jobs, run(conn, done, batch))]
        except Exception as exc:
            if isinstance(translated_error(exc), UniqueConflict):
                raise _Conflict from exc
            raise
    try:
        with conn.begin_nested():
            return [*enqueued(jobs, run(conn, done, batch))]
    except Exception as exc:
        if not isinstance(translated_error(exc), UniqueConflict):
            raise
    if len(jobs) == 1:
        raise _duplicate(conn, jobs[0], None)
    return _one_by_one(conn, jobs, on_duplicate)


def _one_by_one(
    conn: Connection, jobs: Sequence[Prepared], on_duplicate: OnDuplicate
) -> list[EnqueuedJob | Duplicate]:
    """The batch again, one job at a time, to find its duplicates (under one savepoint, so a
    ``"raise"`` leaves nothing of it)."""
    out: list[EnqueuedJob | Duplicate] = []
    batch = conn.begin_nested()
    try:
        for index, job in enumerate(jobs):
            found = _alone(conn, job)
            if found is None:
                error = _duplicate(conn, job, index)
                if on_duplicate == "raise":
                    raise error
                out.append(Duplicate(job.kind, error.unique_key, error.existing_id))
            else:
                out.append(found)
    except BaseException:
        batch.rollback()
        raise
    batch.commit()
    return out


def _alone(conn: Connection, job: Prepared) -> EnqueuedJob | None:
    """*job* inserted, or None when its unique key is taken (its savepoint rolled back)."""
    if job.unique_key is None:
        (row,) = enqueued([job], run(conn, INSERT_JOBS, Batch([job], None)))
        return row
    try:
        with conn.begin_nested():
            (row,) = enqueued([job], run(conn, INSERT_JOBS, Batch([job], None)))
            return row
    except Exception as exc:
        if not isinstance(translated_error(exc), UniqueConflict):
            raise
    return None


def _duplicate(conn: Connection, job: Prepared, index: int | None) -> DuplicateJob:
    """The error for *job*'s taken key, naming the job that holds it where one does."""
    key = job.unique_key
    assert key is not None  # only a unique job conflicts
    holder = run(conn, UNIQUE_HOLDER, key)
    return DuplicateJob(job.kind, bytes.fromhex(key), holder, index)
