"""Administering jobs in the caller's transaction: cancel (by id or unique key), retry, bulk
retry and discard.

awa-pg 0.6.9's ``Client.cancel``, ``cancel_by_unique_key``, ``retry``, ``retry_failed`` and
``discard_failed`` run on the client's own pool, each in a transaction of its own. These do
what they write, on a bind's transaction (docs/administer.md): a service can cancel a job in
the same commit as the business row that makes it moot, and a rollback leaves the job as it
was.

Each call validates its input before any connection is touched, then, in the bind's form
(:func:`awa_sa.core.binds.administered`), share-locks the transition singleton (the routing lock,
as a reschedule takes it) and sends one statement that reads routing afresh and writes only
while routing is canonical (:mod:`awa_sa.administer.statements.canonical`). Once routing points at
queue storage that statement wrote nothing: a cancel goes on in the routing schema
(:mod:`awa_sa.administer.queue_storage_cancel`), a retry or
discard of failed jobs too (:mod:`awa_sa.administer.queue_storage`), a cancel or retry of a callback
wait as well (:mod:`awa_sa.administer.callback_leases`), and what awa-sa cannot write there as
awa-pg does raises :class:`~awa_sa.core.errors.QueueStorageJobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, Select

from awa_sa.administer.queue_storage import discarded, retried
from awa_sa.administer.queue_storage_cancel import (
    JobFields,
    cancel_on_queue_storage,
    unique_holder_on_queue_storage,
)
from awa_sa.administer.statements.canonical import (
    By,
    JobRow,
    cancel_job_canonical,
    discard_failed_canonical,
    job_rows,
    retry_failed_canonical,
    retry_job_canonical,
    unique_holder_canonical,
)
from awa_sa.core.binds import administered, check_bind
from awa_sa.core.compiled import run
from awa_sa.core.errors import QueueStorageJobs, ValidationError
from awa_sa.core.unique_keys import to_json, unique_key, unique_of
from awa_sa.settle.running import CANONICAL
from awa_sa.settle.statements.canonical import ROUTING_LOCK

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")
Step = Callable[[Connection], _T]
"""What a call does on a Connection, once validated; both faces run it."""

BIGINT_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class RetriedFailed:
    """What :func:`retry_failed` did, as awa-pg's ``RetryFailedResult`` reports it.

    ``jobs`` are the rows taken back to available, by id; ``matched`` the failed jobs the
    filter found (equal to ``len(jobs)`` on the canonical plane, where one statement finds and
    moves them); ``pruned_failed_count`` is None there, as awa-pg reports it.
    """

    jobs: list[JobRow]
    matched: int
    pruned_failed_count: int | None = None


def _job_id(job_id: object) -> int:
    if not isinstance(job_id, int) or isinstance(job_id, bool):
        raise ValidationError(f"job_id must be an int, got {type(job_id).__name__}")
    if not 0 < job_id <= BIGINT_MAX:
        raise ValidationError(f"job_id must be a positive bigint, got {job_id}")
    return job_id


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be a str, got {type(value).__name__}")
    if "\x00" in value:
        raise ValidationError(f"{name} must not contain NUL characters")
    return value


def _canonical(
    verb: str,
    build: Callable[[bool], Select[Any]],
    binds: Mapping[str, Any],
    elsewhere: Callable[[Connection, str], list[Any]] | None = None,
) -> Step[list[Any]]:
    """The step: the routing lock, then the statement. Once routing is queue storage the
    statement wrote nothing: *elsewhere* goes on in that schema, or the call is refused."""

    def step(conn: Connection) -> list[Any]:
        routed = run(conn, ROUTING_LOCK, None)
        rows = list(conn.execute(build(routed), binds).all())
        schema = rows[0].routing_schema
        if schema is None:
            return rows
        if elsewhere is None:
            raise QueueStorageJobs(verb, schema, "awa-sa administers canonical jobs only")
        return elsewhere(conn, schema)

    return step


def cancel_job_step(job_id: object) -> Step[JobRow | None]:
    """The validated step of :func:`cancel_job`, for either face."""
    binds = {"b_job_id": _job_id(job_id)}
    rows = _canonical(
        "cancel_job",
        lambda routed: cancel_job_canonical(routed=routed),
        binds,
        lambda conn, schema: cancel_on_queue_storage(conn, schema, binds["b_job_id"]),
    )
    return lambda conn: _one(rows(conn))


def cancel_by_unique_key_step(
    kind: object, queue: object, args: object, period_bucket: object
) -> Step[JobRow | None]:
    """The validated step of :func:`cancel_by_unique_key`, for either face."""
    name = _text("kind", kind)
    lane = None if queue is None else _text("queue", queue)
    if period_bucket is not None and (
        not isinstance(period_bucket, int)
        or isinstance(period_bucket, bool)
        or not -BIGINT_MAX - 1 <= period_bucket <= BIGINT_MAX
    ):
        raise ValidationError("period_bucket must be an int in the signed 64-bit range")
    args_json = "" if args is None else to_json(args)
    parts = {"by_args": args is not None, "by_queue": lane is not None, "by_period": period_bucket}
    checked = unique_of(parts)  # a mapping always answers a Unique, or raises
    assert checked is not None
    binds = {"b_unique_key": unique_key(name, lane or "", args_json, checked)}

    def step(conn: Connection) -> JobRow | None:
        routed = run(conn, ROUTING_LOCK, None)
        held = conn.execute(unique_holder_canonical(routed=routed), binds).one()
        if held.routing_schema is not None:
            job_id = unique_holder_on_queue_storage(conn, held.routing_schema, binds)
            return None if job_id is None else cancel_job_step(job_id)(conn)
        if held.job_id is None:
            return None
        return cancel_job_step(held.job_id)(conn)

    return step


def retry_job_step(job_id: object) -> Step[JobRow | None]:
    """The validated step of :func:`retry_job`, for either face."""
    binds = {"b_job_id": _job_id(job_id)}
    rows = _canonical(
        "retry_job",
        lambda routed: retry_job_canonical(routed=routed),
        binds,
        lambda conn, schema: retried(conn, schema, "job", binds)[0],
    )
    return lambda conn: _one(rows(conn))


def retry_failed_step(kind: object, queue: object) -> Step[RetriedFailed]:
    """The validated step of :func:`retry_failed`, for either face."""
    if (kind is None) == (queue is None):
        raise ValidationError("Specify exactly one of kind or queue")
    by: By = "kind" if kind is not None else "queue"
    binds = {"b_key": _text(by, kind if kind is not None else queue)}
    rows = _canonical(
        "retry_failed",
        lambda routed: retry_failed_canonical(routed=routed, by=by),
        binds,
        lambda conn, schema: [RetriedFailed(*retried(conn, schema, by, binds))],
    )

    def step(conn: Connection) -> RetriedFailed:
        found = rows(conn)
        if found and isinstance(found[0], RetriedFailed):
            return found[0]
        jobs = job_rows(found, CANONICAL)
        return RetriedFailed(jobs, len(jobs))

    return step


def discard_failed_step(kind: object) -> Step[int]:
    """The validated step of :func:`discard_failed`, for either face."""
    binds = {"b_key": _text("kind", kind)}
    rows = _canonical(
        "discard_failed",
        lambda routed: discard_failed_canonical(routed=routed),
        binds,
        lambda conn, schema: [discarded(conn, schema, binds["b_key"])],
    )

    def step(conn: Connection) -> int:
        found = rows(conn)[0]
        return found if isinstance(found, int) else int(found.discarded)

    return step


def _one(rows: list[Any]) -> JobRow | None:
    if rows and isinstance(rows[0], JobFields):
        return JobRow(**rows[0].fields, storage=rows[0].storage)
    if rows and isinstance(rows[0], JobRow):
        return rows[0]
    jobs = job_rows(rows, CANONICAL)
    return jobs[0] if jobs else None


def cancel_job(bind: Engine | Connection | Session, job_id: int) -> JobRow | None:
    """Cancel job *job_id* if it is not terminal (available, scheduled, retryable, running,
    waiting_external), as awa-pg's ``Client.cancel`` writes it; its row after, or None when no
    such job was found (awa-pg 0.6.9 raises ``AwaError("job not found: N")`` there).

    A running (or callback-waiting) attempt is told to stop by awa-pg's ``awa:cancel`` NOTIFY,
    delivered when the transaction commits; the runtime's later ending of that attempt then
    changes nothing. ``bind`` is an ``Engine`` (own transaction, committed), or a
    ``Connection`` or ``Session`` (the caller's transaction, never committed here). Once
    routing is queue storage, a live job of the routing schema is cancelled as awa-pg cancels
    it there (an available one but for awa-pg's later claim-cursor move, and its lane's claim
    head locked until the transaction ends); a terminal or unknown job raises
    :class:`~awa_sa.core.errors.QueueStorageJobs` (docs/contract.md#cancel). There, as in
    awa-pg, a job whose unique mask claims ``cancelled`` takes its key for the cancelled row,
    and a key another job holds raises :class:`~awa_sa.core.errors.UniqueConflict` with
    nothing written, the transaction still usable.
    """
    check_bind(bind)
    return administered(bind, cancel_job_step(job_id))


def cancel_by_unique_key(
    bind: Engine | Connection | Session,
    kind: str,
    *,
    queue: str | None = None,
    args: Any | None = None,
    period_bucket: int | None = None,
) -> JobRow | None:
    """Cancel the oldest job that is not terminal whose unique key is the one awa-pg computes
    from *kind* and whichever of *queue*, *args* and *period_bucket* are given, as awa-pg's
    ``Client.cancel_by_unique_key`` does; its row after, or None when no job holds that key.

    Pass exactly the parts the job's ``unique_opts`` hashed (``by_queue``, ``by_args``,
    ``by_period``), else the key differs and nothing is found. The cancel is
    :func:`cancel_job`'s, with its ``bind`` and its refusals; on queue storage the job is
    picked as awa-pg picks it there (docs/administer.md).
    """
    check_bind(bind)
    return administered(bind, cancel_by_unique_key_step(kind, queue, args, period_bucket))


def retry_job(bind: Engine | Connection | Session, job_id: int) -> JobRow | None:
    """Take job *job_id* back to available if it is failed, cancelled or waiting_external, as
    awa-pg's ``Client.retry`` writes it (attempt 0, run now); its row after, or None.

    ``bind`` and the errors are as for :func:`cancel_job`; a retried job whose unique key
    another job now holds raises :class:`~awa_sa.core.errors.UniqueConflict`, as in awa-pg.
    """
    check_bind(bind)
    return administered(bind, retry_job_step(job_id))


def retry_failed(
    bind: Engine | Connection | Session, *, kind: str | None = None, queue: str | None = None
) -> RetriedFailed:
    """Take every failed job of *kind*, or of *queue* (exactly one), back to available, in one
    statement, as awa-pg's ``Client.retry_failed`` writes them; see :class:`RetriedFailed`.

    ``bind`` and the errors are as for :func:`retry_job`.
    """
    check_bind(bind)
    return administered(bind, retry_failed_step(kind, queue))


def discard_failed(bind: Engine | Connection | Session, kind: str) -> int:
    """Delete every failed job of *kind*, in one statement, as awa-pg's
    ``Client.discard_failed`` does; how many were deleted.

    ``bind`` and the errors are as for :func:`cancel_job`.
    """
    check_bind(bind)
    return administered(bind, discard_failed_step(kind))
