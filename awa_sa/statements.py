"""Pure statement builders for the reschedule: each returns one Core statement and does no I/O.

Every builder is memoised, so one statement object per shape exists for the life of the process
and :mod:`awa_sa.compiled` compiles each once; values travel only as bind parameters, and the
queue-storage schema only through ``schema_translate_map`` (see :mod:`awa_sa.queue_storage`).
Builders take keyword arguments only, and each is registered where it is defined, so
:func:`all_builders` -- what ``awa-sa sql`` lists and the tests compile -- cannot miss one.

The statements that move, claim or write rows work on a batch, so there is one statement per
step whatever the batch size, and the kind is a per-row value (``tag``), not part of the shape.
``batch=True`` binds one array per field, one element per row, unnested (``WITH ORDINALITY``
for the attempts, so each knows its position ``ord`` in the caller's list); ``batch=False``
binds the scalars of a single row. That is the only difference between the two shapes, and it
exists because an array of unknown length makes PostgreSQL plan the statement afresh on every
execution, which more than doubled the cost of a single call (measured: 2.1-2.5 ms against
0.94 ms for the canonical lock and move through raw psycopg).

JSON columns (args, metadata, errors, progress, payload) never pass through Python values between
statements: they are returned as text and cast back to jsonb, or composed in SQL, so numbers such
as ``1e400`` or long decimals survive exactly. Timestamps taken from a row are carried as text
for the same reason (``infinity`` and dates outside Python's range are legal in PostgreSQL).

Bind names carry a prefix (``guard_``, ``b_``) because SQLAlchemy reserves a column's own name for
its VALUES/SET parameter in ``insert()``/``update()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import partial, reduce, wraps
from importlib import import_module
from itertools import product
from typing import Any, Literal, ParamSpec, TypeVar, get_args, get_origin, get_type_hints

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Double,
    Insert,
    LargeBinary,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    false,
    func,
    insert,
    literal_column,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa import queue_storage as qs
from awa_sa.tables import (
    CALLBACK_COLUMNS,
    Timestamp,
    job_state,
    job_unique_claims,
    jobs_hot,
    pg_proc,
    scheduled_jobs,
    storage_transition_state,
)

_PG_DISTINCT_ON: Callable[..., Any] | None = getattr(
    import_module("sqlalchemy.dialects.postgresql"), "distinct_on", None
)
"""SQLAlchemy 2.1's DISTINCT ON construct; None on 2.0."""

KindTag = Literal["snooze", "retry_after", "retry_backoff"]
"""A kind as the statements see it, one per row (``b_tag``); the delay is ``b_delay``."""

ITEM_PARAMS = ("guard_id", "guard_lease", "b_tag", "b_delay", "b_error", "b_progress")
"""The per-attempt bind arrays of the moving statements, in unnest order."""

ROUTING_BODY_MD5 = {
    "awa.active_storage_engine()": "2d08edf5c7f3a3a0b4969ccfde457de7",
    "awa.active_queue_storage_schema()": "9ed6712cdfb4be3bc945808d16271511",
}
"""``md5(prosrc)`` of the routing functions awa-cli 0.6.6 to 0.6.9 install (identical bodies).

The one-statement canonical path copies ``active_storage_engine()``'s expression; it trusts
that copy only while the installed bodies are these (docs/contract.md#routing-guard).
"""

LIFECYCLE_DUPLICATE = "rescheduled as duplicate: unique claim held by a newer job"

_EMPTY_OBJECT = cast(literal_column("'{}'"), JSONB)
_EMPTY_ARRAY = cast(literal_column("'[]'"), JSONB)
_EMPTY_ERRORS = cast(literal_column("'{}'"), ARRAY(JSONB))
_ZERO: ColumnElement[Any] = literal_column("0")
_SHARD0 = cast(_ZERO, SmallInteger)
"""Cancelled rows never entered a lane; Awa files them under shard 0."""


def _state(name: str) -> ColumnElement[Any]:
    return cast(literal_column(f"'{name}'"), job_state)


def _jsonb_param(name: str) -> ColumnElement[Any]:
    return _text_param_as(name, JSONB)


def _text_param_as(name: str, type_: Any) -> ColumnElement[Any]:
    return cast(bindparam(name, type_=Text), type_)


def _concat(*parts: ColumnElement[Any]) -> ColumnElement[Any]:
    def op(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
        return a.op("||", return_type=JSONB)(b)

    return reduce(op, parts)


_P = ParamSpec("_P")
_S = TypeVar("_S")

_BUILDERS: list[Callable[..., Any]] = []
"""Every statement builder, in definition order: ``@_statement`` adds it, ``all_builders`` reads."""


def _statement(builder: Callable[_P, _S]) -> Callable[_P, _S]:
    """Register *builder* and memoise it on its keyword arguments, in whatever order named.

    ``functools.cache`` keys on the order too, so ``f(a=1, b=2)`` and ``f(b=2, a=1)`` would be
    two statement objects, each compiled once more.
    """
    built: dict[frozenset[tuple[str, object]], _S] = {}

    @wraps(builder)
    def memoised(*args: _P.args, **kwargs: _P.kwargs) -> _S:
        if args:
            raise TypeError(f"{builder.__name__}() takes keyword arguments only")
        key = frozenset(kwargs.items())
        found = built.get(key)
        if found is None:
            found = built[key] = builder(*args, **kwargs)
        return found

    _BUILDERS.append(memoised)
    return memoised


# --- the batch: one row per attempt, the first of each (job_id, lease) kept -----------------


def _bound_rows(
    name: str, fields: Sequence[tuple[str, str, Any]], batch: bool, ordinality: bool = False
) -> Any:
    """Rows ``name(column, ...)`` from ``(bind, column, type)`` fields, optionally with ``ord``.

    A batch binds one array per field and gets one row per element. A single row binds
    scalars: the same row, but a plan PostgreSQL can cache, where an array of unknown length
    makes it re-plan on every execution (which doubles the cost of a single call).
    """
    if not batch:
        row = [cast(bindparam(p, type_=t), t).label(c) for p, c, t in fields]
        if ordinality:
            row.append(literal_column("1").label("ord"))
        return select(*row).subquery(name)
    arrays = func.unnest(*(bindparam(p, type_=ARRAY(t)) for p, _, t in fields))
    columns = [column(c, t) for _, c, t in fields]
    if ordinality:
        rows = arrays.table_valued(*columns, with_ordinality="ord")
    else:
        rows = arrays.table_valued(*columns)
    return rows.render_derived(name=name)


def _firsts(batch: bool) -> CTE:
    """The attempts as rows ``(job_id, lease, tag, delay, error, new_progress, ord)``.

    Only the first item of each ``(job_id, lease)`` survives: one by one, a repeat finds the
    row already gone and is Stale, and at most one lease can match a row. ``new_progress``
    would clash with the row's own ``progress`` in ``RETURNING``.
    """
    names = ("job_id", "lease", "tag", "delay", "error", "new_progress")
    types = (BigInteger, BigInteger, Text, Double, Text, Text)
    fields = list(zip(ITEM_PARAMS, names, types, strict=True))
    items = _bound_rows("item", fields, batch, ordinality=True)
    if not batch:
        return select(items).cte("firsts")
    firsts = _distinct_on(select(items), items.c.job_id, items.c.lease)
    return firsts.order_by(items.c.job_id, items.c.lease, items.c.ord).cte("firsts")


def _distinct_on(query: Select[Any], *on: ColumnElement[Any]) -> Select[Any]:
    """``SELECT DISTINCT ON (on...)``, spelled as each SQLAlchemy line wants it.

    2.1 has ``postgresql.distinct_on`` and deprecates expressions in ``Select.distinct()``;
    2.0 has only the latter. Both compile to the same text.
    """
    if _PG_DISTINCT_ON is None:
        return query.distinct(*on)
    return query.ext(_PG_DISTINCT_ON(*on))  # type: ignore[attr-defined,unused-ignore]


def _guard(row: Any, firsts: CTE) -> list[ColumnElement[bool]]:
    return [
        row.c.id == firsts.c.job_id,
        row.c.state == literal_column("'running'"),
        row.c.run_lease == firsts.c.lease,
    ]


def _shared_key(firsts: CTE, batch: bool) -> ColumnElement[bool]:
    """Do two rows the batch would touch share a unique key?

    Then the order of claim releases and acquisitions decides outcomes (a row released later
    in the list still blocks an earlier one, one by one), which set-wise statements cannot
    reproduce; the flow then goes one attempt at a time instead. An alias, so the subquery
    does not correlate with the DELETE's own ``jobs_hot``.
    """
    if not batch:
        return false()
    row = jobs_hot.alias("candidate")
    shared: Select[Any] = (
        select(literal_column("1"))
        .select_from(row)
        .join(firsts, true())
        .where(*_guard(row, firsts), row.c.unique_key.is_not(None))
        .group_by(row.c.unique_key)
        .having(func.count() > literal_column("1"))
    )
    return exists(shared)


_ITEM_COLUMNS = ("ord", "tag", "delay", "error", "new_progress")
"""What a taken row carries from its item, besides the ``jobs_hot`` columns."""


def _take(
    firsts: CTE,
    head: CTE,
    *,
    batch: bool,
    routed_here: Sequence[ColumnElement[bool]] = (),
    eligible: Sequence[ColumnElement[bool]] = (),
) -> CTE:
    """DELETE the guarded rows, returning each with its item; none when ``head.shared_key``.

    *routed_here* says whether this statement's branch applies at all; *eligible* picks the
    rows this statement takes among those it may lock. A batch first locks every guarded row
    its branch may touch, in id order (:func:`_lock_in_id_order`), eligible or not: the rows
    left to a later statement of the same call (callback wiring, a shared key) are then locked
    already, and the call takes all its row locks in that one order. A single call has one
    row, whose lock needs no order.
    """
    unshared = ~_scalar(head, "shared_key")
    if not batch:
        return (
            delete(jobs_hot)
            .where(*_guard(jobs_hot, firsts), *routed_here, *eligible, unshared)
            .returning(*jobs_hot.c, *(firsts.c[name] for name in _ITEM_COLUMNS))
            .cte("taken")
        )
    locked = _lock_in_id_order(firsts, routed_here, and_(*eligible, unshared))
    return (
        delete(jobs_hot)
        .where(jobs_hot.c.id == locked.c.id, locked.c.take)
        .returning(*jobs_hot.c, *(locked.c[name] for name in _ITEM_COLUMNS))
        .cte("taken")
    )


def _lock_in_id_order(
    firsts: CTE, routed_here: Sequence[ColumnElement[bool]], take: ColumnElement[bool]
) -> CTE:
    """``SELECT ... ORDER BY id FOR UPDATE``: the guarded rows, locked lowest id first.

    A DELETE locks rows in whatever order its plan visits them, so two multi-row lockers could
    each hold a row the other waits for. PostgreSQL locks a ``FOR UPDATE`` query's rows as they
    leave its sort, so this order is the statement's own, whatever the plan, and a batch cannot
    deadlock with another locker that also goes by ascending id. A row changed while we waited
    is checked against the guard again before it is locked, as the DELETE alone would do.

    Whether the DELETE takes a row is the column ``take``, not a condition of the DELETE: a
    condition that does not depend on the row (the shared key) becomes a gate in front of the
    DELETE's join, and then nothing reads this CTE and nothing is locked.
    """
    return (
        select(
            jobs_hot.c.id,
            *(firsts.c[name] for name in _ITEM_COLUMNS),
            take.label("take"),
        )
        .where(*_guard(jobs_hot, firsts), *routed_here)
        .order_by(jobs_hot.c.id)
        .with_for_update(of=jobs_hot)
        .cte("locked")
        .prefix_with("MATERIALIZED")
    )


def _scalar(head: CTE, name: str) -> Any:
    return select(head.c[name]).scalar_subquery()


# --- per-row successor values -------------------------------------------------------------


def _is(taken: CTE, tag: KindTag) -> ColumnElement[bool]:
    return taken.c.tag == literal_column(f"'{tag}'")


def _successor_state(taken: CTE) -> ColumnElement[Any]:
    return case((_is(taken, "snooze"), _state("scheduled")), else_=_state("retryable"))


def _successor_attempt(taken: CTE) -> ColumnElement[Any]:
    """The snoozed attempt does not count: one less, but never below smallint's floor.

    Awa takes one off with a saturating subtraction, so -32768 stays -32768 where ``attempt
    - 1`` would leave smallint (22003).
    """
    one_less = func.greatest(taken.c.attempt - literal_column("1"), literal_column("-32768"))
    return case((_is(taken, "snooze"), cast(one_less, SmallInteger)), else_=taken.c.attempt)


def _finalized_at(taken: CTE, snoozed: ColumnElement[Any]) -> ColumnElement[Any]:
    """``now()`` for a retry; *snoozed* (the branch's Snooze value) otherwise."""
    return case((_is(taken, "snooze"), snoozed), else_=func.now())


def _run_at(taken: CTE) -> ColumnElement[Any]:
    # smallint arguments: the function has no int4 overload (docs/contract.md#backoff). CASE
    # evaluates only the matching branch, so the volatile backoff runs for retry_backoff rows alone.
    backoff = func.awa.backoff_duration(
        cast(taken.c.attempt, SmallInteger),
        cast(taken.c.max_attempts, SmallInteger),
        type_=INTERVAL,
    )
    zero = _ZERO
    delay = func.make_interval(zero, zero, zero, zero, zero, zero, taken.c.delay, type_=INTERVAL)
    return func.now() + case((_is(taken, "retry_backoff"), backoff), else_=delay)


_PYTHON_RANGE = (
    cast(literal_column("'0001-01-02 00:00:00+00'"), Timestamp),
    cast(literal_column("'9999-12-30 00:00:00+00'"), Timestamp),
)
"""Where a timestamptz still loads as a Python datetime in any session time zone."""


def _representable(run_at: ColumnElement[Any]) -> ColumnElement[Any]:
    """*run_at* unchanged, or SQLSTATE 22008 when a Python datetime cannot hold it.

    ``awa.backoff_duration`` overflows silently from attempt 44 and can yield a run_at that
    PostgreSQL stores (a BC date, say) but the driver cannot read back. Failing inside the
    statement keeps the write from ever happening; shifting an out-of-range value by 300000
    years is PostgreSQL's own "timestamp out of range". *run_at* must be a stored or computed
    column, not the volatile expression itself, which would be evaluated twice.
    """
    low, high = _PYTHON_RANGE
    inside = (run_at >= low) & (run_at < high)
    years = case((inside, _ZERO), else_=literal_column("300000"))
    return run_at + func.make_interval(years, type_=INTERVAL)


def _errors_after(taken: CTE) -> ColumnElement[Any]:
    """``taken.errors`` with the item's error appended as one element; NULL stays NULL without."""
    error = cast(taken.c.error, JSONB)
    return case(
        (taken.c.error.is_(None), taken.c.errors),
        else_=func.array_append(taken.c.errors, error, type_=ARRAY(JSONB)),
    )


# --- routing, on the path after the one statement ----------------------------------------


@_statement
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


def _head(*columns: ColumnElement[Any]) -> CTE:
    """The first result row: read once, before anything is taken, whatever the plan."""
    return select(*columns).cte("head").prefix_with("MATERIALIZED")


def _head_then(head: CTE, rows: Any, *columns: Any) -> Select[Any]:
    """The head row joined to *rows*: one row even when *rows* is empty, NULLs then."""
    return select(*head.c, *columns).select_from(head.outerjoin(rows, true()))


def _routing_read(routed: bool) -> ColumnElement[Any]:
    """The queue-storage schema routing points at, read by this statement; NULL unrouted."""
    if routed:
        return func.awa.active_queue_storage_schema(type_=Text)
    return cast(null(), Text)


def _scheduled_successor(taken: CTE) -> list[ColumnElement[Any]]:
    """The successor row, column for column in ``scheduled_jobs`` order, same id."""
    changed: dict[str, ColumnElement[Any]] = {
        "state": _successor_state(taken),
        "attempt": _successor_attempt(taken),
        "run_at": _run_at(taken),
        "heartbeat_at": cast(null(), Timestamp),
        "deadline_at": cast(null(), Timestamp),
        "finalized_at": _finalized_at(taken, taken.c.finalized_at),
        "errors": _errors_after(taken),
        "progress": cast(taken.c.new_progress, JSONB),
    }
    # Labelled with the column each fills, so the compiled text (``awa-sa sql``) reads as such.
    return [
        changed[c.name].label(c.name) if c.name in changed else taken.c[c.name]
        for c in scheduled_jobs.c
    ]


def _insert_scheduled(taken: CTE) -> CTE:
    """INSERT the successors into ``scheduled_jobs``, returning what the outcome reports."""
    target = scheduled_jobs.c
    return (
        insert(scheduled_jobs)
        .from_select([c.name for c in target], select(*_scheduled_successor(taken)))
        .returning(target.id, target.run_lease, target.run_at, target.attempt)
        .cte("moved")
    )


def _moved(
    firsts: CTE, head: CTE, *, batch: bool, routed_here: list[ColumnElement[bool]]
) -> Select[Any]:
    """The guarded move where *routed_here* holds: the head, then ``(id, run_lease, run_at,
    attempt)`` per moved job."""
    moved = _insert_scheduled(_take(firsts, head, batch=batch, routed_here=routed_here))
    return _head_then(
        head,
        moved,
        moved.c.id,
        moved.c.run_lease,
        _representable(moved.c.run_at).label("run_at"),
        moved.c.attempt,
    )


@_statement
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
    touched either (see ``_shared_key``). Then one row per moved job ``(id, run_lease, run_at,
    attempt)``, which ``(id, run_lease)`` maps back to the first item asking for it; the first
    row carries NULLs there when nothing moved.
    """
    firsts = _firsts(batch)
    routing_schema = _routing_read(routed).label("routing_schema")
    head = _head(routing_schema, _shared_key(firsts, batch).label("shared_key"))
    routed_here = _scalar(head, "routing_schema").is_(None)
    return _moved(firsts, head, batch=batch, routed_here=[routed_here])


# --- the one statement: routing from the locked row, guarded, then the move ----------------


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
    state = storage_transition_state
    return (
        select(_active_engine(state).label("engine"))
        .where(state.c.singleton)
        .with_for_update(read=True)
        .cte("routing")
        .prefix_with("MATERIALIZED")
    )


def _body_is(function: str, md5: str) -> ColumnElement[bool]:
    body = (
        select(func.md5(pg_proc.c.prosrc, type_=Text))
        .where(pg_proc.c.oid == func.to_regprocedure(literal_column(f"'{function}'")))
        .scalar_subquery()
    )
    return body == literal_column(f"'{md5}'")


def _bodies_known() -> ColumnElement[bool]:
    """Are the installed routing functions the ones :func:`_active_engine` copies?

    Checked in every call, so a migration that replaced either is seen by connections that
    sat in a pool meanwhile. A missing function hashes to NULL, which is not known either.
    """
    known = and_(*(_body_is(name, md5) for name, md5 in ROUTING_BODY_MD5.items()))
    return func.coalesce(known, false())


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
            _shared_key(firsts, batch).label("shared_key"),
        )
        .select_from(one.outerjoin(routing, true()))
        .cte("head")
        .prefix_with("MATERIALIZED")
    )


@_statement
def move_if_canonical(*, batch: bool) -> Select[Any]:
    """The canonical reschedule in one statement: lock, route, guard, move (docs/contract.md).

    Routing comes from the singleton row this statement share-locks, not from the function
    (see ``_locked_routing``), and only while the installed routing bodies are the known ones.
    The move is :func:`canonical_move`'s, column for column. The first row says whether the
    call must go on: ``queue_storage`` (routing points there), ``guarded`` false (unknown
    routing bodies) or ``shared_key`` (see ``_shared_key``) -- then nothing was touched. Then
    one row per moved job ``(id, run_lease, run_at, attempt)``, as for ``canonical_move``.
    """
    firsts = _firsts(batch)
    head = _routed_head(_locked_routing(), firsts, batch)
    routed_here = [~_scalar(head, "queue_storage"), _scalar(head, "guarded")]
    return _moved(firsts, head, batch=batch, routed_here=routed_here)


# --- queue-storage branch -----------------------------------------------------------------


def _payload(taken: CTE) -> ColumnElement[Any]:
    """The compacted queue-storage payload (docs/contract.md#payload), NULL when empty."""
    errors = func.coalesce(_errors_after(taken), _EMPTY_ERRORS, type_=ARRAY(JSONB))
    progress = cast(taken.c.new_progress, JSONB)

    def entry(key: str, present: ColumnElement[bool], value: ColumnElement[Any]) -> Any:
        obj = func.jsonb_build_object(literal_column(f"'{key}'"), value, type_=JSONB)
        return case((present, obj), else_=_EMPTY_OBJECT)

    composed = _concat(
        entry("metadata", taken.c.metadata != _EMPTY_OBJECT, taken.c.metadata),
        entry("tags", func.cardinality(taken.c.tags) > _ZERO, func.to_jsonb(taken.c.tags)),
        entry("errors", func.cardinality(errors) > _ZERO, func.to_jsonb(errors)),
        entry("progress", progress.is_not(None), progress),
    )
    return func.nullif(composed, _EMPTY_OBJECT, type_=JSONB)


def _callbacks_unwired() -> list[ColumnElement[bool]]:
    """A row waiting on a callback stays canonical: the canonical move takes it instead."""
    return [jobs_hot.c[name].is_(None) for name in CALLBACK_COLUMNS]


def _timed(taken: CTE) -> CTE:
    """The taken rows with their new run_at, in a CTE so the volatile backoff runs once a row."""
    return select(taken, _run_at(taken).label("new_run_at")).cte("timed")


def _fresh_id(metadata_type: ColumnElement[Any]) -> ColumnElement[Any]:
    """``nextval`` of the schema's sequence, only for a row whose metadata is a JSON object.

    Any other row is refused right after (docs/contract.md#payload), and should not burn an id.
    """
    new_id = cast(qs.job_id_seq.next_value(), BigInteger)
    return case((metadata_type == literal_column("'object'"), new_id))


def _allocated_successors(timed: CTE) -> Any:
    """One row per taken job, named like the ``deferred_jobs`` columns, in the caller's order.

    JSON and timestamps travel as text (see the module docstring); ``ord`` and
    ``metadata_type`` tell the flow which item each row answers and why it has no id.
    """
    metadata_type = func.jsonb_typeof(timed.c.metadata, type_=Text)
    finalized_at = _finalized_at(timed, cast(null(), Timestamp))
    return (
        select(
            # run_at first: PostgreSQL evaluates the list in order, so an out-of-range run_at
            # (22008) fails before nextval and burns no id.
            _representable(timed.c.new_run_at).label("run_at"),
            _fresh_id(metadata_type).label("job_id"),
            timed.c.kind,
            timed.c.queue,
            cast(timed.c.args, Text).label("args"),
            cast(_successor_state(timed), Text).label("state"),
            timed.c.priority,
            _successor_attempt(timed).label("attempt"),
            timed.c.run_lease,
            timed.c.max_attempts,
            cast(timed.c.attempted_at, Text).label("attempted_at"),
            cast(finalized_at, Text).label("finalized_at"),
            cast(timed.c.created_at, Text).label("created_at"),
            timed.c.unique_key,
            cast(timed.c.unique_states, Text).label("unique_states"),
            cast(_payload(timed), Text).label("payload"),
            metadata_type.label("metadata_type"),
            timed.c.ord,
        )
        .order_by(timed.c.ord)
        .subquery("successor")
    )


@_statement
def take_and_allocate(*, batch: bool) -> Select[Any]:
    """Take the canonical rows and allocate their successors, one statement (docs/contract.md#take).

    Awa's two statements merged: ``nextval`` sits in the select list over the deleted rows,
    so it runs only for a taken row -- a stale attempt consumes no sequence value -- and only
    when that row's metadata is a JSON object, because such a job is refused right after
    (docs/contract.md#payload) and should not burn an id either. The list is evaluated after the
    ``ORDER BY ord``, so fresh ids follow the caller's order, as one call after another would.

    Returns a first row whose ``shared_key`` says whether anything was taken (see
    ``_shared_key``), then one row per taken job, named like the ``deferred_jobs`` columns plus
    ``ord`` and ``metadata_type`` (``job_id`` NULL when metadata is not an object). An item
    without a row (callback wiring, a guard miss) falls through to the canonical move.
    """
    firsts = _firsts(batch)
    head = _head(_shared_key(firsts, batch).label("shared_key"))
    taken = _take(firsts, head, batch=batch, eligible=_callbacks_unwired())
    successors = _allocated_successors(_timed(taken))
    return _head_then(head, successors, successors)


SUCCESSOR_FIELDS = tuple(c.name for c in qs.deferred_jobs.c)
"""The ``take_and_allocate`` columns that make up the successor, in ``deferred_jobs`` order."""

_CARRIED_AS_TEXT: dict[str, Any] = {
    "args": JSONB,
    "state": job_state,
    "attempted_at": Timestamp,
    "finalized_at": Timestamp,
    "created_at": Timestamp,
    "payload": JSONB,
}
"""Successor fields that travel as text and are cast back on insert."""


def _carried(column: Any, value: ColumnElement[Any]) -> ColumnElement[Any]:
    """*value*, typed as *column*: cast back for the fields that travel as text."""
    if column.name in _CARRIED_AS_TEXT:
        return cast(value, _CARRIED_AS_TEXT[column.name])
    return value


def _value(column: Any) -> ColumnElement[Any]:
    """The scalar ``:b_<column>`` parameter, cast to the column's type."""
    if column.name in _CARRIED_AS_TEXT:
        return _carried(column, bindparam(f"b_{column.name}", type_=Text))
    return cast(bindparam(f"b_{column.name}", type_=column.type), column.type)


@_statement
def insert_deferred(*, batch: bool) -> Insert:
    """The successors as deferred jobs: all 16 columns explicit (docs/contract.md#deferred).

    ``b_<column>`` scalars for one row, or arrays with one element per row for a batch.
    """
    table = qs.deferred_jobs
    transport = [Text if c.name in _CARRIED_AS_TEXT else c.type for c in table.c]
    fields = [(f"b_{c.name}", c.name, t) for c, t in zip(table.c, transport, strict=True)]
    rows = _bound_rows("successor", fields, batch)
    values = select(*(_carried(c, rows.c[c.name]) for c in table.c))
    return insert(table).from_select([c.name for c in table.c], values)


@_statement
def claim_unique_keys(*, batch: bool) -> Insert:
    """Acquire each ``(key, job)`` unless another job id holds the key (docs/contract.md#claims).

    On conflict a row is "updated" to itself only when it already names this job, so the
    returned ``job_id`` values are the claims acquired and a missing one is held by someone
    else. The keys of one call must be distinct: ON CONFLICT DO UPDATE cannot touch a row twice.
    """
    fields = [("b_unique_key", "unique_key", LargeBinary), ("b_job_id", "job_id", BigInteger)]
    rows = _bound_rows("claim", fields, batch)
    stmt = pg_insert(job_unique_claims).from_select(
        ["unique_key", "job_id"], select(rows.c.unique_key, rows.c.job_id)
    )
    return stmt.on_conflict_do_update(
        index_elements=[job_unique_claims.c.unique_key],
        set_={"job_id": stmt.excluded.job_id},
        where=job_unique_claims.c.job_id == stmt.excluded.job_id,
    ).returning(job_unique_claims.c.job_id)


@_statement
def ring_cursor() -> Select[Any]:
    """The v040 ring cursor: a plain read, no lock, as in Awa 0.6 (docs/contract.md#cancelled)."""
    ring = qs.queue_ring_state
    return select(ring.c.current_slot, ring.c.generation).where(ring.c.singleton)


@_statement
def lane_lock() -> Select[Any]:
    """Lane step 1: serialise lane creation on ``hashtextextended('S:queue:priority:0', 0)``."""
    key = bindparam("b_lane_key", type_=Text)
    return select(func.pg_advisory_xact_lock(func.hashtextextended(key, literal_column("0"))))


def _lane_values() -> dict[str, ColumnElement[Any]]:
    return {
        "queue": bindparam("b_queue", type_=Text),
        "priority": cast(bindparam("b_priority", type_=SmallInteger), SmallInteger),
    }


@_statement
def ensure_lane_row() -> Insert:
    """Lane step 2: ``S.queue_lanes``; the head rows below need it for nothing but parity."""
    return (
        pg_insert(qs.queue_lanes)
        .values(_lane_values())
        .on_conflict_do_nothing(index_elements=["queue", "priority"])
        .inline()
    )


@_statement
def ensure_lane_head(*, table: Literal["enqueue", "claim"]) -> Insert:
    """Lane steps 3/4: the head row of shard 0; its BEFORE INSERT trigger creates the sequence.

    The trigger fires even when ON CONFLICT then skips the row; it only moves sequences forward.
    """
    target = qs.queue_enqueue_heads if table == "enqueue" else qs.queue_claim_heads
    return (
        pg_insert(target)
        .values({**_lane_values(), "enqueue_shard": _SHARD0})
        .on_conflict_do_nothing(index_elements=["queue", "priority", "enqueue_shard"])
        .inline()
    )


@_statement
def ensure_lane_sequences() -> Select[Any]:
    """Lane step 5: ``S.ensure_lane_sequences(queue, priority::smallint, 0::smallint)``."""
    values = _lane_values()
    return select(qs.ensure_lane_sequences(values["queue"], values["priority"], _SHARD0))


@_statement
def clock() -> Select[Any]:
    """The wall clock after lane ensuring: the cancelled row's ``finalized_at``.

    See docs/contract.md#cancelled.
    """
    return select(cast(func.clock_timestamp(), Text))


def _payload_with_lifecycle_error() -> ColumnElement[Any]:
    """``b_payload`` (NULL meaning empty) with ``b_lifecycle_error`` appended to its errors."""
    payload = _jsonb_param("b_payload")
    previous = payload.op("->", return_type=JSONB)(literal_column("'errors'"))
    errors = _concat(
        func.coalesce(previous, _EMPTY_ARRAY),
        func.jsonb_build_array(_jsonb_param("b_lifecycle_error"), type_=JSONB),
    )
    return _concat(
        func.coalesce(payload, _EMPTY_OBJECT),
        func.jsonb_build_object(literal_column("'errors'"), errors, type_=JSONB),
    )


def _insert_done_entry() -> CTE:
    """INSERT the cancelled ``done_entries`` row, returning its terminal-count key."""
    done = qs.done_entries
    new_id = bindparam("b_job_id", type_=BigInteger)
    values: dict[str, ColumnElement[Any]] = {
        "ready_slot": bindparam("b_ready_slot", type_=done.c.ready_slot.type),
        "ready_generation": bindparam("b_ready_generation", type_=BigInteger),
        "state": _state("cancelled"),
        "lane_seq": -new_id,
        "enqueue_shard": _SHARD0,
        "run_at": bindparam("b_run_at", type_=Timestamp),
        "finalized_at": _text_param_as("b_finalized_at", Timestamp),
        "payload": _payload_with_lifecycle_error(),
    }
    return (
        insert(done)
        .values({c.name: values.get(c.name, _value(c)) for c in done.c})
        .returning(
            done.c.ready_slot,
            done.c.ready_generation,
            done.c.queue,
            done.c.priority,
            done.c.enqueue_shard,
            done.c.job_id,
        )
        .cte("done")
    )


_TERMINAL_BUCKETS: ColumnElement[Any] = literal_column("256")


def _counter_bucket(job_id: ColumnElement[Any]) -> ColumnElement[Any]:
    """``job_id`` modulo 256, Euclidean (ids are positive, but the bucket must never be)."""
    n = _TERMINAL_BUCKETS
    return cast(((job_id % n) + n) % n, SmallInteger)


def _insert_terminal_delta(done: CTE) -> CTE:
    """INSERT the ``+1`` terminal-count delta of the row *done* inserted."""
    deltas = qs.queue_terminal_count_deltas
    key = ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard"]
    return (
        insert(deltas)
        .from_select(
            [*key, "counter_bucket", "terminal_delta"],
            select(
                *(done.c[name] for name in key),
                _counter_bucket(done.c.job_id).label("counter_bucket"),
                cast(literal_column("1"), BigInteger).label("terminal_delta"),
            ),
        )
        .returning(deltas.c.ready_slot)
        .cte("delta")
    )


@_statement
def insert_cancelled() -> Select[Any]:
    """The cancelled terminal row and its ``+1`` terminal-count delta, in one statement.

    Awa's two inserts (docs/contract.md#done-row, #terminal-delta) as one data-modifying CTE:
    the delta is built from the row actually inserted, and both still sit inside the
    cancelled-row savepoint.
    The payload is the deferred payload with the lifecycle error appended, composed in SQL. The
    last-resort insert is this statement with ``b_unique_key``/``b_unique_states`` bound to
    NULL. One row per call: a cancelled duplicate is the per-attempt fallback of a batch.
    """
    done = _insert_done_entry()
    delta = _insert_terminal_delta(done)
    return select(done.c.job_id).select_from(done.join(delta, true()))


def all_builders() -> list[partial[Any]]:
    """Every distinct statement as a zero-argument call: what ``awa-sa sql`` lists and tests use.

    Derived from the builders: each registered one, called with every value its ``bool`` and
    ``Literal`` parameters allow, so a new builder or argument cannot be left out of either.
    """
    return [partial(builder, **args) for builder in _BUILDERS for args in _argument_sets(builder)]


def _argument_sets(builder: Callable[..., Any]) -> list[dict[str, object]]:
    func = inspect.unwrap(builder)
    hints = get_type_hints(func)
    names = list(inspect.signature(func).parameters)
    choices = []
    for name in names:
        hint = hints.get(name)
        if hint is bool:
            choices.append((False, True))
        elif get_origin(hint) is Literal:
            choices.append(get_args(hint))
        else:
            raise TypeError(f"{func.__name__}: cannot enumerate parameter {name!r}")
    return [dict(zip(names, values, strict=True)) for values in product(*choices)]
