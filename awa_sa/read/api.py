"""Reading jobs in the caller's transaction: ``get_job``, ``list_jobs``, ``queue_stats``,
and ``jobs_view`` to join.

awa-pg 0.6.9's ``Client.get_job`` reads on the client's own pool, outside the service's
transaction, and on queue storage puts the job together from several statements in Rust.
These read in the bind's transaction, so they see what it sees (its own uncommitted writes,
one snapshot under REPEATABLE READ), with the answer awa-pg gives (docs/reading.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

from sqlalchemy import Connection, Engine, Select, literal
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.core.binds import check_bind, guarded
from awa_sa.core.compiled import execute, run
from awa_sa.core.driver_errors import translated
from awa_sa.core.errors import ValidationError
from awa_sa.core.job_rows import JobRow
from awa_sa.read.statements.jobs import job_selectable
from awa_sa.read.statements.listings import QS_LIMIT, list_jobs_rows
from awa_sa.read.statements.lookups import ROUTING, Plane, job_rows, read_job
from awa_sa.read.statements.schemas import of_schema, placeholder
from awa_sa.read.statements.stats import QueueStat, queue_stats_of, queue_stats_rows
from awa_sa.tables.queue_storage import translate_map

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")
Step = Callable[[Connection], _T]
"""What a read does on a Connection, once validated; both faces run it."""

CANONICAL = "canonical"
_UNSEEN = "\0unseen"
"""No routing met yet: not a schema name (a NUL is refused in one)."""
BIGINT_MAX = 2**63 - 1


def job_id_of(job_id: object, name: str = "job_id") -> int:
    if not isinstance(job_id, int) or isinstance(job_id, bool):
        raise ValidationError(f"{name} must be an int, got {type(job_id).__name__}")
    if not -BIGINT_MAX - 1 <= job_id <= BIGINT_MAX:
        raise ValidationError(f"{name} must be a bigint, got {job_id}")
    return job_id


def read(bind: Engine | Connection | Session, step: Step[_T]) -> _T:
    """*step* in the bind's transaction (a Connection or Session), or on a connection of the
    Engine's own (its read-only transaction committed). AUTOCOMMIT reads too."""
    if isinstance(bind, Engine):
        with translated(), bind.connect() as conn:
            found = guarded(conn, _on, step)
            # Ended by COMMIT, which leaves it idle: the pool's ROLLBACK is then a no-op, and
            # psycopg 3 keeps its prepared statements (it discards them all on a ROLLBACK).
            conn.commit()
            return found
    if not isinstance(bind, Connection):
        with translated():  # a Session's autobegin checks a connection out
            bind = bind.connection()
    return guarded(bind, _on, step)


def _on(conn: Connection, step: Step[_T]) -> _T:
    return step(conn)


_LAST_ROUTING: WeakKeyDictionary[Engine, str | None] = WeakKeyDictionary()
"""The routing each Engine's last read met: the schema the next read's text is compiled for."""


def get_job_step(job_id: object) -> Step[JobRow | None]:
    """The validated step of :func:`get_job`, for either face: one statement, compiled for
    the routing the engine last met and checking it (a read meeting another routing, the first
    on an engine, or the one after a flip, is read again for the routing it met)."""
    asked = {"b_job_id": job_id_of(job_id)}

    def step(conn: Connection) -> JobRow | None:
        engine = conn.engine
        schema = _LAST_ROUTING.get(engine, _UNSEEN)
        if schema is _UNSEEN:
            schema = run(conn, ROUTING, None)
        while True:
            plane: Plane = "canonical" if schema is None else "queue_storage"
            rows = execute(conn, read_job(plane=plane), asked | {"b_schema": schema}, schema)
            met = rows[0].routing_schema
            _LAST_ROUTING[engine] = met
            if met == schema:
                found = job_rows([row[1:] for row in rows if row.id is not None], met or CANONICAL)
                return found[0] if found else None
            schema = met

    return step


def get_job(bind: Engine | Connection | Session, job_id: int) -> JobRow | None:
    """Job *job_id* as awa-pg 0.6.9's ``Client.get_job`` answers it, every field, or None
    where awa-pg raises ``job not found``: read on the plane routing points at, in the bind's
    transaction (a ``Connection`` or ``Session``: its snapshot, its own uncommitted writes),
    or on a connection of an ``Engine``'s own.

    On queue storage the job's state is derived as awa-pg derives it (docs/reading.md); a
    finished job is readable until Awa's retention or ring rotation removes it.
    """
    check_bind(bind)
    return read(bind, get_job_step(job_id))


JOB_STATES = frozenset(
    {
        "scheduled",
        "available",
        "running",
        "completed",
        "retryable",
        "failed",
        "cancelled",
        "waiting_external",
    }
)


def _text_or_none(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"{name} must be a str or None, got {type(value).__name__}")
    return value


def list_jobs_step(
    state: object, kind: object, queue: object, *, tag: object, before_id: object, limit: object
) -> Step[list[JobRow]]:
    """The validated step of :func:`list_jobs`, for either face."""
    if _text_or_none("state", state) is not None and state not in JOB_STATES:
        raise ValidationError(f"unknown job state: {state}")
    limit = job_id_of(limit, "limit")
    asked = {
        "b_state": state,
        "b_kind": _text_or_none("kind", kind),
        "b_queue": _text_or_none("queue", queue),
        "b_tag": _text_or_none("tag", tag),
        "b_before_id": None if before_id is None else job_id_of(before_id, "before_id"),
    }

    def step(conn: Connection) -> list[JobRow]:
        schema = run(conn, ROUTING, None)
        if schema is None:
            if limit < 0:  # awa-pg sends it, and PostgreSQL refuses a negative LIMIT
                raise ValidationError(f"limit must not be negative, got {limit}")
            rows = execute(conn, list_jobs_rows(plane="canonical"), asked | {"b_limit": limit})
            return job_rows(rows, CANONICAL)
        clamped = min(max(limit, QS_LIMIT[0]), QS_LIMIT[1])
        query = list_jobs_rows(plane="queue_storage")
        return job_rows(execute(conn, query, asked | {"b_limit": clamped}, schema), schema)

    return step


def list_jobs(
    bind: Engine | Connection | Session,
    *,
    state: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    tag: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[JobRow]:
    """Jobs as awa-pg 0.6.9's ``Client.list_jobs`` lists them, newest id first, each as
    :func:`get_job` reads it, in the bind's transaction: filtered by *state*, *kind*, *queue*
    and *tag* (awa-model's filter, which awa-pg's Python client does not pass), and paged by
    *before_id* (only ids below it: pass the last id of the previous page).

    On queue storage awa-pg lists only the jobs its listing rows name, which leaves out a job
    running under a receipt, and clamps *limit* to 1..1000; so does this (docs/reading.md).
    """
    check_bind(bind)
    step = list_jobs_step(state, kind, queue, tag=tag, before_id=before_id, limit=limit)
    return read(bind, step)


def queue_stats_step() -> Step[list[QueueStat]]:
    """The step of :func:`queue_stats`, for either face."""

    def step(conn: Connection) -> list[QueueStat]:
        schema = run(conn, ROUTING, None)
        query = queue_stats_rows(plane="canonical" if schema is None else "queue_storage")
        return queue_stats_of(execute(conn, query, {}, schema))

    return step


def queue_stats(bind: Engine | Connection | Session) -> list[QueueStat]:
    """Every queue's counts as awa-pg 0.6.9's ``Client.queue_stats`` reports them, in queue
    order, read in the bind's transaction: on the canonical plane from the maintenance
    leader's cached counts, on queue storage counted from the listing rows (docs/reading.md)."""
    check_bind(bind)
    return read(bind, queue_stats_step())


def jobs_view(queue_storage: str | None = "awa") -> Select[Any]:
    """Jobs as a selectable to join, filter and order with a service's own tables, one row
    per job with :class:`JobRow`'s columns (``storage`` too), each as ``get_job`` reads it::

        job = awa_sa.jobs_view("awa").subquery("job")
        select(orders.c.id, job.c.state).join(job, job.c.id == orders.c.job_id)

    *queue_storage* names the cluster's queue-storage schema (``awa`` unless its runtimes
    name another), or None for a cluster that only ever ran canonical. The rows are those of
    the plane routing points at when the statement runs, as awa-pg reports them. A filter or
    join on ``id``, ``kind`` or ``queue`` reaches each table's index (docs/reading.md).
    """
    if queue_storage is None:
        return job_selectable(placeholder(), "canonical", _canonical())
    translate_map(queue_storage)
    schema: ColumnElement[Any] = literal(queue_storage)
    return job_selectable(of_schema(queue_storage), "routed", schema)


def _canonical() -> ColumnElement[Any]:
    return literal(CANONICAL)
