"""The dead-letter queue in the caller's transaction: move failed jobs in, read, purge.

awa-pg 0.6.9's DLQ calls (``Client.move_failed_to_dlq``, ``list_dlq``, ``purge_dlq``, ...) run
on the client's own pool, on queue storage only. These write and read the same rows
(:mod:`awa_sa.administer.statements.dlq`) in the bind's transaction, after the routing lock:
a service can file a job as dead in the same commit as the incident row that explains it.
While routing is canonical there is no DLQ, and each call raises
:class:`~awa_sa.core.errors.ValidationError`, as awa-pg raises its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from awa_sa.administer.api import Step, _job_id, _text
from awa_sa.administer.statements.canonical import JobRow
from awa_sa.administer.statements.deferred import done_job_fields
from awa_sa.administer.statements.dlq import (
    By,
    dlq_count,
    dlq_job_row,
    dlq_move_targets,
    dlq_routing,
    list_dlq_rows,
    move_to_dlq,
    purge_dlq_rows,
)
from awa_sa.core.binds import administered, check_bind
from awa_sa.core.compiled import run
from awa_sa.core.errors import ValidationError
from awa_sa.settle.statements.canonical import ROUTING_LOCK
from awa_sa.settle.statements.receipt_settles import receipt_lock
from awa_sa.tables.queue_storage import translate_map

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

NO_DLQ = "DLQ APIs currently require an active queue_storage backend"
"""awa-pg 0.6.9's own refusal while routing is canonical."""
FILTERS = ("b_kind", "b_queue", "b_tag", "b_before_id", "b_before_dlq_at")


@dataclass(frozen=True, slots=True)
class DlqEntry:
    """A job in the dead-letter queue, as awa-pg's ``DlqEntry`` reports it: the job's row as
    it failed (``storage`` the schema), why and when it was moved, and its last run lease."""

    job: JobRow
    reason: str
    dlq_at: datetime
    original_run_lease: int


def _schema(conn: Connection) -> str:
    run(conn, ROUTING_LOCK, None)
    schema = conn.execute(dlq_routing()).scalar()
    if schema is None:
        raise ValidationError(NO_DLQ)
    translate_map(schema)  # a name awa-sa cannot route to is refused here
    return str(schema)


def _entries(rows: Any, schema: str) -> list[DlqEntry]:
    return [
        DlqEntry(
            JobRow(**done_job_fields(row, unique_states=None), storage=schema),
            row.dlq_reason,
            row.dlq_at,
            int(row.original_run_lease),
        )
        for row in rows
    ]


def _filters(**given: object) -> dict[str, Any]:
    binds: dict[str, Any] = {}
    for name in ("kind", "queue", "tag"):
        value = given.get(name)
        binds[f"b_{name}"] = None if value is None else _text(name, value)
    before_id, before_at = given.get("before_id"), given.get("before_dlq_at")
    binds["b_before_id"] = None if before_id is None else _job_id(before_id)
    if before_at is not None and not (
        isinstance(before_at, datetime) and before_at.tzinfo is not None
    ):
        raise ValidationError("before_dlq_at must be an aware datetime")
    binds["b_before_dlq_at"] = before_at
    return binds


def _scoped(verb: str, binds: dict[str, Any], allow_all: object, scope: tuple[str, ...]) -> None:
    if not isinstance(allow_all, bool):
        raise ValidationError("allow_all must be a bool")
    if not allow_all and all(binds.get(f"b_{name}") is None for name in scope):
        names = ", ".join(scope[:-1]) + f" or {scope[-1]}" if len(scope) > 1 else scope[0]
        raise ValidationError(f"{verb} requires at least one of {names} (or allow_all=true)")


def _opts(schema: str) -> dict[str, Any]:
    return {"schema_translate_map": translate_map(schema)}


def list_dlq_step(limit: object = 100, **filters: object) -> Step[list[DlqEntry]]:
    """The validated step of :func:`list_dlq`, for either face."""
    binds = _filters(**filters)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValidationError("limit must be a non-negative int")
    binds["b_limit"] = limit

    def step(conn: Connection) -> list[DlqEntry]:
        schema = _schema(conn)
        found = conn.execute(list_dlq_rows(), binds, execution_options=_opts(schema)).all()
        return _entries(found, schema)

    return step


def get_dlq_job_step(job_id: object) -> Step[DlqEntry | None]:
    """The validated step of :func:`get_dlq_job`, for either face."""
    binds = {"b_job_id": _job_id(job_id)}

    def step(conn: Connection) -> DlqEntry | None:
        schema = _schema(conn)
        found = conn.execute(dlq_job_row(), binds, execution_options=_opts(schema)).all()
        entries = _entries(found, schema)
        return entries[0] if entries else None

    return step


def dlq_depth_step(queue: object) -> Step[int]:
    """The validated step of :func:`dlq_depth`, for either face."""
    binds = {"b_queue": None if queue is None else _text("queue", queue)}

    def step(conn: Connection) -> int:
        schema = _schema(conn)
        return int(conn.execute(dlq_count(), binds, execution_options=_opts(schema)).scalar_one())

    return step


def _moved(conn: Connection, by: By, binds: dict[str, Any]) -> tuple[str, list[DlqEntry]]:
    """Lock the failed rows, their receipts, then move them in one statement."""
    schema = _schema(conn)
    options = _opts(schema)
    targets = conn.execute(dlq_move_targets(by=by), binds, execution_options=options).all()
    if not targets:
        return schema, []
    ids = [int(t.job_id) for t in targets]
    leases = [int(t.run_lease) for t in targets]
    conn.execute(receipt_lock(batch=True), {"b_job_id": ids, "b_run_lease": leases})
    moving = {
        "b_job_ids": ids,
        "b_finalized_ats": [t.finalized_at for t in targets],
        "b_reason": binds["b_reason"],
    }
    filed = conn.execute(move_to_dlq(), moving, execution_options=options).all()
    return schema, _entries(filed, schema)


def move_failed_to_dlq_step(job_id: object, reason: object) -> Step[DlqEntry | None]:
    """The validated step of :func:`move_failed_to_dlq`, for either face."""
    binds = {"b_job_id": _job_id(job_id), "b_reason": _text("reason", reason)}

    def step(conn: Connection) -> DlqEntry | None:
        _, entries = _moved(conn, "job", binds)
        return entries[0] if entries else None

    return step


def bulk_move_failed_to_dlq_step(
    kind: object, queue: object, reason: object, allow_all: object
) -> Step[int]:
    """The validated step of :func:`bulk_move_failed_to_dlq`, for either face."""
    binds = _filters(kind=kind, queue=queue)
    _scoped("bulk_move_failed_to_dlq", binds, allow_all, ("kind", "queue"))
    binds = {"b_kind": binds["b_kind"], "b_queue": binds["b_queue"]}
    binds["b_reason"] = _text("reason", reason)
    return lambda conn: len(_moved(conn, "filter", binds)[1])


def purge_dlq_step(allow_all: object, **filters: object) -> Step[int]:
    """The validated step of :func:`purge_dlq`, for either face."""
    binds = _filters(**filters)
    _scoped("purge_dlq", binds, allow_all, ("kind", "queue", "tag"))

    def step(conn: Connection) -> int:
        schema = _schema(conn)
        done = conn.execute(purge_dlq_rows(by="filter"), binds, execution_options=_opts(schema))
        return int(done.rowcount)

    return step


def purge_dlq_job_step(job_id: object) -> Step[bool]:
    """The validated step of :func:`purge_dlq_job`, for either face."""
    binds = {"b_job_id": _job_id(job_id)}

    def step(conn: Connection) -> bool:
        schema = _schema(conn)
        done = conn.execute(purge_dlq_rows(by="job"), binds, execution_options=_opts(schema))
        return int(done.rowcount) > 0

    return step


def list_dlq(
    bind: Engine | Connection | Session,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    before_dlq_at: datetime | None = None,
    limit: int = 100,
) -> list[DlqEntry]:
    """The DLQ's entries as awa-pg's ``list_dlq`` reads them: of *kind*, *queue*, with *tag*,
    below the keyset cursor (*before_dlq_at*, *before_id*), newest move first, at most
    *limit*. Raises :class:`~awa_sa.core.errors.ValidationError` while routing is canonical."""
    check_bind(bind)
    step = list_dlq_step(
        limit, kind=kind, queue=queue, tag=tag, before_id=before_id, before_dlq_at=before_dlq_at
    )
    return administered(bind, step)


def get_dlq_job(bind: Engine | Connection | Session, job_id: int) -> DlqEntry | None:
    """Job *job_id*'s DLQ entry, or None, as awa-pg's ``get_dlq_job``."""
    check_bind(bind)
    return administered(bind, get_dlq_job_step(job_id))


def dlq_depth(bind: Engine | Connection | Session, *, queue: str | None = None) -> int:
    """How many jobs the DLQ holds, of *queue* or in all, as awa-pg's ``dlq_depth``."""
    check_bind(bind)
    return administered(bind, dlq_depth_step(queue))


def move_failed_to_dlq(
    bind: Engine | Connection | Session, job_id: int, reason: str
) -> DlqEntry | None:
    """Move failed job *job_id* into the DLQ with *reason*, as awa-pg's
    ``move_failed_to_dlq`` writes it (its newest failed row taken out of the terminal rows,
    its receipt closed, the terminal count lowered); its entry, or None when the job has no
    failed row (or another transaction holds it). ``bind`` as for
    :func:`~awa_sa.cancel_job`; routing canonical: ``ValidationError``."""
    check_bind(bind)
    return administered(bind, move_failed_to_dlq_step(job_id, reason))


def bulk_move_failed_to_dlq(
    bind: Engine | Connection | Session,
    *,
    kind: str | None = None,
    queue: str | None = None,
    reason: str = "manual",
    allow_all: bool = False,
) -> int:
    """Move every failed job of *kind* and *queue* into the DLQ, as awa-pg's
    ``bulk_move_failed_to_dlq``; how many rows moved. Neither filter needs ``allow_all``."""
    check_bind(bind)
    return administered(bind, bulk_move_failed_to_dlq_step(kind, queue, reason, allow_all))


def purge_dlq(
    bind: Engine | Connection | Session,
    *,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    before_dlq_at: datetime | None = None,
    allow_all: bool = False,
) -> int:
    """Delete the DLQ entries the filter picks, as awa-pg's ``purge_dlq``; how many. No kind,
    queue or tag needs ``allow_all``."""
    check_bind(bind)
    step = purge_dlq_step(
        allow_all, kind=kind, queue=queue, tag=tag, before_id=before_id, before_dlq_at=before_dlq_at
    )
    return administered(bind, step)


def purge_dlq_job(bind: Engine | Connection | Session, job_id: int) -> bool:
    """Delete job *job_id*'s DLQ entry, as awa-pg's ``purge_dlq_job``; whether there was one."""
    check_bind(bind)
    return administered(bind, purge_dlq_job_step(job_id))
