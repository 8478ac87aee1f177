"""The canonical move: the one statement, and the routing lock and move it falls back to.

Each statement is paired (:class:`~awa_sa.core.registry.Query`) with the attempts it is
called with (:class:`~awa_sa.settle.statements.attempts.MoveItem`) and what its rows say
(:class:`Moved`): the jobs it moved, or why it moved nothing (:class:`GoOn`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, NamedTuple

from sqlalchemy import (
    CTE,
    ColumnElement,
    Select,
    Text,
    and_,
    case,
    cast,
    func,
    insert,
    literal_column,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB

from awa_sa.core.registry import Query, Rows, no_binds, statement
from awa_sa.core.sql import head_row, head_then, representable, scalar
from awa_sa.settle.statements.attempts import (
    MoveItem,
    attempt_rows,
    errors_after,
    finalized_at,
    item_binds,
    run_at,
    shared_key,
    successor_attempt,
    successor_state,
    take,
)
from awa_sa.tables.canonical import pg_proc, scheduled_jobs, storage_transition_state

ROUTING_BODY_MD5 = {
    "awa.active_storage_engine()": "2d08edf5c7f3a3a0b4969ccfde457de7",
    "awa.active_queue_storage_schema()": "9ed6712cdfb4be3bc945808d16271511",
}
"""``md5(prosrc)`` of the routing functions awa-cli 0.6.6 to 0.6.9 install (identical bodies).

The one-statement canonical path copies ``active_storage_engine()``'s expression; it trusts
that copy only while the installed bodies are these (docs/contract.md#routing-guard).
"""


@statement
def routing_lock() -> Select[Any]:
    """Share-lock the transition singleton; no row means canonical routing.

    The first step of the path the call goes on with when :func:`move_if_canonical` moved
    nothing (docs/contract.md#routing).

    Every storage transition locks this row exclusively first, so holding it to the end of the
    transaction keeps routing fixed until the write commits (docs/contract.md#routing-lock).
    """
    return (
        select(literal_column("1"))
        .select_from(storage_transition_state)
        .where(storage_transition_state.c.singleton)
        .with_for_update(read=True)
    )


def _routing_read(routed: bool) -> ColumnElement[Any]:
    """The queue-storage schema routing points at, read by this statement; NULL unrouted."""
    if routed:
        return func.awa.active_queue_storage_schema(type_=Text)
    return cast(null(), Text)


def _scheduled_successor(taken: CTE) -> list[ColumnElement[Any]]:
    """The successor row, column for column in ``scheduled_jobs`` order, same id."""
    changed: dict[str, ColumnElement[Any]] = {
        "state": successor_state(taken),
        "attempt": successor_attempt(taken),
        "run_at": run_at(taken),
        # Untyped: INSERT ... SELECT gives a NULL its target column's type.
        "heartbeat_at": null(),
        "deadline_at": null(),
        "finalized_at": finalized_at(taken, taken.c.finalized_at),
        "errors": errors_after(taken),
        "progress": cast(taken.c.new_progress, JSONB),
    }
    # A changed column is labelled with the column it fills, so the compiled text (``awa-sa
    # sql``) reads as such; a column carried over names itself. SQLAlchemy labels a CTE's
    # columns in an INSERT ... SELECT that is itself a CTE, so those are literal references:
    # the labels would take the one statement past psycopg 3's 4 KB query cache.
    return [
        changed[c.name].label(c.name)
        if c.name in changed
        else literal_column(f"{taken.name}.{c.name}", c.type)
        for c in scheduled_jobs.c
    ]


_MOVED_COLUMNS = [scheduled_jobs.c[name] for name in ("id", "run_lease", "run_at", "attempt")]
"""What the outcome reports of each moved job."""


def _insert_scheduled(taken: CTE) -> CTE:
    """INSERT the successors into ``scheduled_jobs``, returning what the outcome reports."""
    target = scheduled_jobs.c
    return (
        insert(scheduled_jobs)
        .from_select(
            [c.name for c in target],
            select(*_scheduled_successor(taken)).select_from(taken),
        )
        # Unqualified: RETURNING sees only the inserted row, and the names are shorter.
        .returning(
            *(
                literal_column(c.name, c.type)
                for c in (target.id, target.run_lease, target.run_at, target.attempt)
            )
        )
        .cte("moved")
    )


def _moved(
    firsts: CTE, head: CTE, *, batch: bool, routed_here: list[ColumnElement[bool]]
) -> Select[Any]:
    """The guarded move where *routed_here* holds: the head, then ``(id, run_lease, run_at,
    attempt)`` per moved job."""
    moved = _insert_scheduled(take(firsts, head, batch=batch, routed_here=routed_here))
    return head_then(
        head,
        moved,
        moved.c.id,
        moved.c.run_lease,
        representable(moved.c.run_at).label("run_at"),
        moved.c.attempt,
    )


@statement
def canonical_move(*, routed: bool, batch: bool) -> Select[Any]:
    """After :func:`routing_lock`: read routing afresh and, only if it is NULL, move the rows.

    See docs/contract.md#routing and #canonical-move.

    One round trip after the lock, whatever the batch size. The routing read is a new
    statement, so under READ COMMITTED its snapshot postdates the lock and cannot miss a
    transition that committed while we waited. The move is one DELETE...INSERT CTE: the same
    id, each successor built only from its deleted row and its own item.

    Always returns a first row ``(routing_schema, shared_key, ...)``: a non-NULL
    ``routing_schema`` means nothing was touched (always NULL when not ``routed``, for the
    missing singleton and the queue-storage fall-through); ``shared_key`` true means nothing was
    touched either (see ``shared_key``). Then one row per moved job ``(id, run_lease, run_at,
    attempt)``, which ``(id, run_lease)`` maps back to the first item asking for it; the first
    row carries NULLs there when nothing moved.
    """
    firsts = attempt_rows(batch)
    routing_schema = _routing_read(routed).label("routing_schema")
    head = head_row(routing_schema, shared_key(firsts, batch).label("shared_key"))
    routed_here = scalar(head, "routing_schema").is_(None)
    return _moved(firsts, head, batch=batch, routed_here=[routed_here])


def _active_engine(row: Any) -> ColumnElement[Any]:
    """``awa.active_storage_engine()``'s expression over *row*, before its ``COALESCE``.

    Copied from the body awa-cli installs (``ROUTING_BODY_MD5``): in mixed_transition and
    active the prepared engine, else the current one, trimmed, blank meaning none.
    """
    flipping = row.c.state.in_([literal_column("'mixed_transition'"), literal_column("'active'")])
    engine = case(
        (flipping, func.coalesce(row.c.prepared_engine, row.c.current_engine)),
        else_=row.c.current_engine,
    )
    return func.nullif(func.btrim(engine, type_=Text), literal_column("''"), type_=Text)


def _locked_routing() -> CTE:
    """Share-lock the singleton and compute the engine from the row version that was locked.

    Under READ COMMITTED a ``FOR SHARE`` that waited for a transition locks and returns the
    newest committed version of the row, whatever the statement's snapshot; the STABLE
    function would read that older snapshot (docs/contract.md#one-statement). Materialized,
    so it runs once, and first: :func:`_routed_head` reads it in its FROM.
    """
    state = storage_transition_state.alias("transition")
    return (
        select(_active_engine(state).label("engine"))
        .where(state.c.singleton)
        .with_for_update(read=True)
        .cte("routing")
        .prefix_with("MATERIALIZED")
    )


def _bodies_known() -> ColumnElement[bool]:
    """Are the installed routing functions the ones :func:`_active_engine` copies?

    Checked in every call, so a migration that replaced either is seen by connections that
    sat in a pool meanwhile: both must be found with their known body; a missing one is not.
    One scalar lookup per function, each an index scan of ``pg_proc`` by oid: one ``count(*)``
    over an ``OR`` of both was planned as a bitmap heap scan and cost twice the server time
    (docs/performance.md#routing-guard). The columns are unqualified (the subquery reads one
    table) to keep the one statement under psycopg's query-cache limit.
    """
    each = (
        select(literal_column("md5(prosrc)"))
        .select_from(pg_proc)
        .where(literal_column("oid") == func.to_regprocedure(literal_column(f"'{function}'")))
        .scalar_subquery()
        == literal_column(f"'{md5}'")
        for function, md5 in ROUTING_BODY_MD5.items()
    )
    return and_(*each).is_(true())


def queue_storage_schema() -> ColumnElement[Any]:
    """``awa.active_queue_storage_schema()``, called only where routing may not be canonical.

    The function (plpgsql, with its own ``search_path``, so never inlined) costs about as much
    server time as a small statement. Where the installed bodies are the known ones and the
    singleton's engine, as :func:`_active_engine` computes it, is not queue storage, the
    function would return NULL: that is said without calling it (CASE evaluates only the branch
    it takes). The singleton is read in the statement's snapshot, as the STABLE function reads
    it; nothing is locked.
    """
    state = storage_transition_state.alias("transition")
    found = select(_active_engine(state)).where(state.c.singleton).scalar_subquery()
    engine = func.coalesce(found, literal_column("'canonical'"), type_=Text)
    canonical = and_(_bodies_known(), engine != literal_column("'queue_storage'"))
    return case(
        (canonical, cast(null(), Text)),
        else_=func.awa.active_queue_storage_schema(type_=Text),
    )


def _routed_head(routing: CTE, firsts: CTE, batch: bool) -> CTE:
    """The first row: ``queue_storage``, ``guarded``, ``shared_key``, in that order of work.

    Selected FROM the routing CTE (outer-joined to one row, for the missing singleton), so the
    singleton is locked before anything reads ``awa.jobs_hot`` -- the shared-key check does.
    """
    engine = func.coalesce(routing.c.engine, literal_column("'canonical'"), type_=Text)
    one = select(literal_column("1").label("one")).subquery("one")
    return (
        select(
            (engine == literal_column("'queue_storage'")).label("queue_storage"),
            _bodies_known().label("guarded"),
            shared_key(firsts, batch).label("shared_key"),
        )
        .select_from(one.outerjoin(routing, true()))
        .cte("head")
        .prefix_with("MATERIALIZED")
    )


@statement
def move_if_canonical(*, batch: bool) -> Select[Any]:
    """The canonical reschedule in one statement: lock, route, guard, move (docs/contract.md).

    Routing comes from the singleton row this statement share-locks, not from the function
    (see ``_locked_routing``), and only while the installed routing bodies are the known ones.
    The move is :func:`canonical_move`'s, column for column. The first row says whether the
    call must go on: ``queue_storage`` (routing points there), ``guarded`` false (unknown
    routing bodies) or ``shared_key`` (see ``shared_key``) -- then nothing was touched. Then
    one row per moved job ``(id, run_lease, run_at, attempt)``, as for ``canonical_move``.
    """
    firsts = attempt_rows(batch)
    head = _routed_head(_locked_routing(), firsts, batch)
    routed_here = [~scalar(head, "queue_storage"), scalar(head, "guarded")]
    return _moved(firsts, head, batch=batch, routed_here=routed_here)


# --- what the rows say ---------------------------------------------------------------------


class GoOn(Enum):
    """Why a move touched nothing, and what the call must go on with (docs/contract.md)."""

    QUEUE_STORAGE = "queue storage"
    """Routing points to queue storage: the attempts migrate (the one statement locked the
    singleton; the routed move read the schema)."""
    UNKNOWN_ROUTING = "unknown routing bodies"
    """The installed routing functions are not the ones the one statement copies: lock, and
    read routing with the installed function."""
    SHARED_KEY = "shared key"
    """Two of the batch's rows share a unique key: one attempt at a time (see ``shared_key``)."""


class MovedJob(NamedTuple):
    """A job the canonical move rescheduled: same id; ``run_at`` and ``attempt`` as stored."""

    job_id: int
    run_lease: int
    run_at: datetime
    attempt: int


@dataclass(frozen=True, slots=True)
class Moved:
    """What a canonical move did: the jobs it moved, or why it touched nothing."""

    jobs: list[MovedJob]
    go_on: GoOn | None
    routing_schema: str | None = None
    """The queue-storage schema the routed move read (with ``GoOn.QUEUE_STORAGE``)."""

    @classmethod
    def read(cls, rows: Rows) -> Moved:
        flags = rows[0]  # each moving statement has its own flags: a missing one is not set
        jobs = [MovedJob(r.id, r.run_lease, r.run_at, r.attempt) for r in rows if r.id is not None]
        schema = getattr(flags, "routing_schema", None)
        go_on = None
        if getattr(flags, "queue_storage", False) or schema is not None:
            go_on = GoOn.QUEUE_STORAGE
        elif not getattr(flags, "guarded", True):
            go_on = GoOn.UNKNOWN_ROUTING
        elif flags.shared_key:
            go_on = GoOn.SHARED_KEY
        return cls(jobs, go_on, schema)


def _batch(items: Sequence[MoveItem]) -> bool:
    return len(items) > 1


ROUTING_LOCK: Query[None, bool] = Query(
    lambda _: routing_lock(), no_binds, lambda rows: len(rows) > 0
)
"""True when the singleton was there to lock; no row means canonical routing."""

MOVE_IF_CANONICAL: Query[Sequence[MoveItem], Moved] = Query(
    lambda items: move_if_canonical(batch=_batch(items)), item_binds, Moved.read
)
CANONICAL_MOVE: Query[Sequence[MoveItem], Moved] = Query(
    lambda items: canonical_move(routed=False, batch=_batch(items)), item_binds, Moved.read
)
"""The move alone, under a lock already held or with no singleton to lock."""
ROUTED_MOVE: Query[Sequence[MoveItem], Moved] = Query(
    lambda items: canonical_move(routed=True, batch=_batch(items)), item_binds, Moved.read
)
"""After :data:`ROUTING_LOCK`: routing read by the installed function, and the move if NULL."""
