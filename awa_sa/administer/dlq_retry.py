"""Retrying jobs out of the dead-letter queue in the caller's transaction.

awa-pg 0.6.9's ``Client.retry_from_dlq`` and ``bulk_retry_from_dlq`` revive DLQ rows on the
client's own pool. These write the same rows (:mod:`awa_sa.administer.statements.dlq_retry`) in
the bind's transaction, after the routing lock: a service can put a job back to work in the
same commit as the fix that makes it worth running again, and a rollback leaves it in the DLQ.
The order is the other queue-storage retries' (:mod:`awa_sa.administer.queue_storage`): the
rows locked and the refusals read while nothing is written, the claims, each lane ensured, the
ring cursor, then one statement; each lane's enqueue shard picked as awa-pg's call picks it.
While routing is canonical there is no DLQ, and each call
raises :class:`~awa_sa.core.errors.ValidationError`, as awa-pg raises its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from awa_sa.administer.api import Step, _job_id, _text
from awa_sa.administer.callback_leases import ready_ring, shard_binds, shards_picked
from awa_sa.administer.dead_letters import _filters, _opts, _schema, _scoped
from awa_sa.administer.queue_storage import ready_job_fields
from awa_sa.administer.statements.deferred import done_job_fields
from awa_sa.administer.statements.dlq_retry import (
    dlq_retry_claims,
    dlq_retry_deferred,
    dlq_retry_ready,
    dlq_retry_targets,
)
from awa_sa.core.binds import administered, check_bind
from awa_sa.core.errors import UniqueConflict, ValidationError
from awa_sa.core.job_rows import JobRow

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

SMALLINT = (-(2**15), 2**15 - 1)


def _priority(priority: object) -> int | None:
    if priority is None:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValidationError(f"priority must be an int, got {type(priority).__name__}")
    if not SMALLINT[0] <= priority <= SMALLINT[1]:
        raise ValidationError(f"priority must fit a smallint, got {priority}")
    return priority


def _run_at(run_at: object) -> datetime | None:
    if run_at is not None and not (isinstance(run_at, datetime) and run_at.tzinfo is not None):
        raise ValidationError("run_at must be an aware datetime")
    return run_at


def _revived(
    conn: Connection, schema: str, targets: Sequence[Any], binds: Mapping[str, Any]
) -> list[JobRow]:
    """The locked DLQ rows *targets* written back as jobs: (due now) each lane's enqueue
    shard picked, the claims, then (due now) the lanes and the ring cursor, then one
    statement; the new rows by id."""
    options = _opts(schema)
    lanes = sorted({(t.to_queue, int(t.to_priority)) for t in targets})
    deferred = bool(targets[0].deferred)
    shards: dict[tuple[str, int], int] = {}
    if not deferred:  # awa-pg's one insert: one pick per lane, in lane order
        shards = dict(zip(lanes, shards_picked(conn, [q for q, _ in lanes]), strict=True))
    ids = {"b_job_ids": [int(t.job_id) for t in targets]}
    claims = conn.execute(dlq_retry_claims(deferred=deferred), ids, execution_options=options)
    moved = claims.one()
    if moved.taken < moved.wanted:
        raise UniqueConflict("idx_awa_jobs_unique", "a retried job's unique key is held")
    written = {**ids, "b_to_queue": binds.get("b_to_queue")}
    written["b_to_priority"] = binds.get("b_to_priority")
    if deferred:
        written["b_run_at"] = binds["b_run_at"]
        rows = conn.execute(dlq_retry_deferred(), written, execution_options=options).all()
        fields = [done_job_fields(row, unique_states=None) for row in rows]
    else:
        ring = ready_ring(conn, schema, [(q, p, shards[q, p]) for q, p in lanes])
        written["b_ready_slot"] = ring.current_slot
        written["b_ready_generation"] = ring.generation
        placed = {int(t.job_id): shards[t.to_queue, int(t.to_priority)] for t in targets}
        written.update(shard_binds(placed))
        rows = conn.execute(dlq_retry_ready(), written, execution_options=options).all()
        fields = [ready_job_fields(row) for row in rows]
    return [JobRow(**f, storage=schema) for f in fields]


def retry_from_dlq_step(
    job_id: object, run_at: object, priority: object, queue: object
) -> Step[JobRow | None]:
    """The validated step of :func:`retry_from_dlq`, for either face."""
    binds = {
        "b_job_id": _job_id(job_id),
        "b_run_at": _run_at(run_at),
        "b_to_priority": _priority(priority),
        "b_to_queue": None if queue is None else _text("queue", queue),
    }

    def step(conn: Connection) -> JobRow | None:
        schema = _schema(conn)
        found = conn.execute(dlq_retry_targets(by="job"), binds, execution_options=_opts(schema))
        targets = found.all()
        if not targets:
            return None
        return _revived(conn, schema, targets, binds)[0]

    return step


def bulk_retry_from_dlq_step(
    kind: object, queue: object, tag: object, allow_all: object
) -> Step[int]:
    """The validated step of :func:`bulk_retry_from_dlq`, for either face."""
    binds = _filters(kind=kind, queue=queue, tag=tag)
    _scoped("bulk_retry_from_dlq", binds, allow_all, ("kind", "queue", "tag"))

    def step(conn: Connection) -> int:
        schema = _schema(conn)
        found = conn.execute(dlq_retry_targets(by="filter"), binds, execution_options=_opts(schema))
        targets = found.all()
        if not targets:
            return 0
        return len(_revived(conn, schema, targets, {}))

    return step


def retry_from_dlq(
    bind: Engine | Connection | Session,
    job_id: int,
    *,
    run_at: datetime | None = None,
    priority: int | None = None,
    queue: str | None = None,
) -> JobRow | None:
    """Revive job *job_id* from the DLQ, as awa-pg's ``retry_from_dlq`` writes it: attempt 0,
    on *queue* and at *priority* where given, available now, or scheduled when *run_at* is
    still ahead; its row after, or None when the DLQ has no such job.

    ``bind`` as for :func:`~awa_sa.cancel_job`; routing canonical: ``ValidationError``; a
    unique key another job holds: :class:`~awa_sa.core.errors.UniqueConflict`, as awa-pg.
    """
    check_bind(bind)
    return administered(bind, retry_from_dlq_step(job_id, run_at, priority, queue))


def bulk_retry_from_dlq(
    bind: Engine | Connection | Session,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    allow_all: bool = False,
) -> int:
    """Revive every DLQ row of *kind*, *queue* and with *tag*, as awa-pg's
    ``bulk_retry_from_dlq``, each available now in its own queue; how many. No kind, queue or
    tag needs ``allow_all``."""
    check_bind(bind)
    return administered(bind, bulk_retry_from_dlq_step(kind, queue, tag, allow_all))
