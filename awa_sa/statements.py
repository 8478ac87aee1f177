"""Pure statement builders for the reschedule: each returns one Core statement and does no I/O.

Every builder is memoised, so one statement object per shape exists for the life of the process
and SQLAlchemy's compiled cache hits on every call; values travel only as bind parameters, and the
queue-storage schema only through ``schema_translate_map`` (see :mod:`awa_sa.queue_storage`).

JSON columns (args, metadata, errors, progress, payload) never pass through Python values between
statements: they are returned as text and cast back to jsonb, or composed in SQL, so numbers such
as ``1e400`` or long decimals survive exactly. Timestamps taken from a row are carried as text
for the same reason (``infinity`` and dates outside Python's range are legal in PostgreSQL).

Bind names carry a prefix (``guard_``, ``b_``) because SQLAlchemy reserves a column's own name for
its VALUES/SET parameter in ``insert()``/``update()``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial, reduce
from typing import Any, Literal

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Double,
    Float,
    Insert,
    Select,
    SmallInteger,
    Text,
    bindparam,
    case,
    cast,
    delete,
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
    scheduled_jobs,
    storage_transition_state,
)

KindTag = Literal["snooze", "retry_after", "retry_backoff"]
"""The statement-shaping part of a kind; the delay itself is a bind parameter."""

CLAIM_CONSTRAINT = "idx_awa_jobs_unique"
"""The arbiter index of ``awa.job_unique_claims``, and the name Awa reports on a conflict."""

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


def _successor_state(tag: KindTag) -> str:
    return "scheduled" if tag == "snooze" else "retryable"


def _successor_attempt(taken: CTE, tag: KindTag) -> ColumnElement[Any]:
    # The snoozed attempt does not count.
    if tag == "snooze":
        return cast(taken.c.attempt - literal_column("1"), SmallInteger)
    return taken.c.attempt


def _run_at(taken: CTE, tag: KindTag) -> ColumnElement[Any]:
    if tag == "retry_backoff":
        # smallint arguments: the function has no int4 overload (spec §2.1).
        delay = func.awa.backoff_duration(
            cast(taken.c.attempt, SmallInteger),
            cast(taken.c.max_attempts, SmallInteger),
            type_=INTERVAL,
        )
    else:
        zero = _ZERO
        secs = cast(bindparam("b_delay", type_=Float), Double)
        delay = func.make_interval(zero, zero, zero, zero, zero, zero, secs, type_=INTERVAL)
    return func.now() + delay


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
    """``taken.errors`` with ``:b_error`` appended as one element; NULL stays NULL without one."""
    error = _jsonb_param("b_error")
    return case(
        (error.is_(None), taken.c.errors),
        else_=func.array_append(taken.c.errors, error, type_=ARRAY(JSONB)),
    )


def _guard() -> list[ColumnElement[bool]]:
    return [
        jobs_hot.c.id == bindparam("guard_id", type_=BigInteger),
        jobs_hot.c.state == literal_column("'running'"),
        jobs_hot.c.run_lease == bindparam("guard_lease", type_=BigInteger),
    ]


# --- routing ------------------------------------------------------------------------------


@cache
def routing_lock() -> Select[Any]:
    """Statement 1: share-lock the transition singleton; no row means canonical routing.

    Every storage transition locks this row exclusively first, so holding it to the end of the
    transaction keeps routing fixed until the write commits (spec §3.2).
    """
    return (
        select(literal_column("1"))
        .select_from(storage_transition_state)
        .where(storage_transition_state.c.singleton)
        .with_for_update(read=True)
    )


@cache
def canonical_move(tag: KindTag, routed: bool) -> Select[Any]:
    """Statement 2: read routing afresh and, only if it is NULL, move the row (spec §3.3, §4).

    One round trip after the lock. The routing read is a new statement, so under READ COMMITTED
    its snapshot postdates the lock and cannot miss a transition that committed while we waited.
    The move is the spec's single DELETE...INSERT CTE: same id, built only from the deleted row.

    Returns columns ``(s, id, run_at, attempt)``. ``routed=True`` yields exactly one row: ``s`` is
    the routing schema (non-NULL means nothing was touched), ``id`` is NULL when the guard matched
    nothing. ``routed=False`` skips the routing read (missing singleton, or the queue-storage
    fall-through) and yields a row only when the guard matched.
    """
    routing = (
        select(func.awa.active_queue_storage_schema(type_=Text).label("s"))
        .cte("routing")
        .prefix_with("MATERIALIZED")
    )
    where = _guard()
    if routed:
        where.append(select(routing.c.s).scalar_subquery().is_(None))
    taken = delete(jobs_hot).where(*where).returning(*jobs_hot.c).cte("taken")
    retryable = tag != "snooze"
    successor: dict[str, ColumnElement[Any]] = {
        "state": _state(_successor_state(tag)),
        "attempt": _successor_attempt(taken, tag),
        "run_at": _run_at(taken, tag),
        "heartbeat_at": cast(null(), Timestamp),
        "deadline_at": cast(null(), Timestamp),
        "finalized_at": func.now() if retryable else taken.c.finalized_at,
        "errors": _errors_after(taken),
        "progress": _jsonb_param("b_progress"),
    }
    columns = [c.name for c in scheduled_jobs.c]
    moved = (
        insert(scheduled_jobs)
        .from_select(columns, select(*(successor.get(n, taken.c[n]) for n in columns)))
        .returning(scheduled_jobs.c.id, scheduled_jobs.c.run_at, scheduled_jobs.c.attempt)
        .cte("moved")
    )
    out = (moved.c.id, _representable(moved.c.run_at).label("run_at"), moved.c.attempt)
    if routed:
        return select(routing.c.s, *out).select_from(routing.outerjoin(moved, true()))
    return select(cast(null(), Text).label("s"), *out)


# --- queue-storage branch -----------------------------------------------------------------


def _payload(taken: CTE) -> ColumnElement[Any]:
    """The compacted queue-storage payload (queue_storage.md §4), SQL NULL when empty."""
    errors = func.coalesce(_errors_after(taken), _EMPTY_ERRORS, type_=ARRAY(JSONB))
    progress = _jsonb_param("b_progress")

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


@cache
def take_and_allocate(tag: KindTag) -> Select[Any]:
    """Take the canonical row (spec §5.1) and allocate the successor (§5.3) in one statement.

    The spec's two statements merged: ``nextval`` sits in the select list over the deleted rows,
    so it runs only when a row was taken -- a stale call consumes no sequence value -- and only
    when that row's metadata is a JSON object, because such a job is refused right after
    (queue_storage.md §4) and should not burn an id either.

    Returns one row, named like the ``deferred_jobs`` columns, that is the successor itself
    (``job_id`` NULL when metadata is not an object; see ``metadata_type``), or no row: callback
    wiring or a guard miss, both of which fall through to the canonical move.
    """
    taken = (
        delete(jobs_hot)
        .where(*_guard(), *(jobs_hot.c[n].is_(None) for n in CALLBACK_COLUMNS))
        .returning(*jobs_hot.c)
        .cte("taken")
    )
    # A CTE, so the volatile backoff is evaluated once however often run_at is referenced.
    row = select(taken, _run_at(taken, tag).label("new_run_at")).cte("timed")
    metadata_type = func.jsonb_typeof(row.c.metadata, type_=Text)
    new_id = cast(qs.job_id_seq.next_value(), BigInteger)
    retryable = tag != "snooze"
    # run_at first: PostgreSQL evaluates the list in order, so an out-of-range run_at (22008)
    # fails before nextval and burns no id.
    return select(
        _representable(row.c.new_run_at).label("run_at"),
        case((metadata_type == literal_column("'object'"), new_id)).label("job_id"),
        row.c.kind,
        row.c.queue,
        cast(row.c.args, Text).label("args"),
        literal_column(f"'{_successor_state(tag)}'", Text).label("state"),
        row.c.priority,
        _successor_attempt(row, tag).label("attempt"),
        row.c.run_lease,
        row.c.max_attempts,
        cast(row.c.attempted_at, Text).label("attempted_at"),
        (cast(func.now(), Text) if retryable else cast(null(), Text)).label("finalized_at"),
        cast(row.c.created_at, Text).label("created_at"),
        row.c.unique_key,
        cast(row.c.unique_states, Text).label("unique_states"),
        cast(_payload(row), Text).label("payload"),
        metadata_type.label("metadata_type"),
    )


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


def _value(column: Any) -> ColumnElement[Any]:
    """The ``:b_<column>`` parameter, cast to the column's type."""
    param = f"b_{column.name}"
    if column.name in _CARRIED_AS_TEXT:
        return _text_param_as(param, _CARRIED_AS_TEXT[column.name])
    return cast(bindparam(param, type_=column.type), column.type)


@cache
def insert_deferred() -> Insert:
    """The successor as a deferred job: all 16 columns explicit (queue_storage.md §3)."""
    table = qs.deferred_jobs
    return insert(table).values({c.name: _value(c) for c in table.c}).inline()


@cache
def claim_unique_key() -> Insert:
    """Acquire ``(key, job)`` unless another job id holds the key (queue_storage.md §5.2).

    On conflict the row is "updated" to itself only when it already names this job, so a
    returned row means acquired and no row means held by someone else.
    """
    stmt = pg_insert(job_unique_claims).values(
        unique_key=bindparam("b_unique_key"),
        job_id=bindparam("b_job_id", type_=BigInteger),
    )
    return stmt.on_conflict_do_update(
        index_elements=[job_unique_claims.c.unique_key],
        set_={"job_id": stmt.excluded.job_id},
        where=job_unique_claims.c.job_id == stmt.excluded.job_id,
    ).returning(literal_column("1"))


@cache
def ring_cursor() -> Select[Any]:
    """The v040 ring cursor: a plain read, no lock, exactly as Awa 0.6 (queue_storage.md §6.1)."""
    ring = qs.queue_ring_state
    return select(ring.c.current_slot, ring.c.generation).where(ring.c.singleton)


@cache
def lane_lock() -> Select[Any]:
    """Lane step 1: serialise lane creation on ``hashtextextended('S:queue:priority:0', 0)``."""
    key = bindparam("b_lane_key", type_=Text)
    return select(func.pg_advisory_xact_lock(func.hashtextextended(key, literal_column("0"))))


def _lane_values() -> dict[str, ColumnElement[Any]]:
    return {
        "queue": bindparam("b_queue", type_=Text),
        "priority": cast(bindparam("b_priority", type_=SmallInteger), SmallInteger),
    }


@cache
def ensure_lane_row() -> Insert:
    """Lane step 2: ``S.queue_lanes``; the head rows below need it for nothing but parity."""
    return (
        pg_insert(qs.queue_lanes)
        .values(_lane_values())
        .on_conflict_do_nothing(index_elements=["queue", "priority"])
        .inline()
    )


@cache
def ensure_lane_head(table: Literal["enqueue", "claim"]) -> Insert:
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


@cache
def ensure_lane_sequences() -> Select[Any]:
    """Lane step 5: ``S.ensure_lane_sequences(queue, priority::smallint, 0::smallint)``."""
    values = _lane_values()
    return select(qs.ensure_lane_sequences(values["queue"], values["priority"], _SHARD0))


@cache
def clock() -> Select[Any]:
    """The wall clock after lane ensuring: the cancelled row's ``finalized_at`` (§6.1.4)."""
    return select(cast(func.clock_timestamp(), Text))


@cache
def insert_cancelled() -> Select[Any]:
    """The cancelled terminal row and its ``+1`` terminal-count delta, in one statement.

    The spec's two inserts (queue_storage.md §6.4, §6.5) as one data-modifying CTE: the delta is
    built from the row actually inserted, and both still sit inside savepoint b. The payload is
    the deferred payload with the lifecycle error appended, composed in SQL. The last-resort
    insert is this statement with ``b_unique_key``/``b_unique_states`` bound to NULL.
    """
    done = qs.done_entries
    payload = _jsonb_param("b_payload")
    lifecycle = _jsonb_param("b_lifecycle_error")
    previous = payload.op("->", return_type=JSONB)(literal_column("'errors'"))
    errors = _concat(
        func.coalesce(previous, _EMPTY_ARRAY),
        func.jsonb_build_array(lifecycle, type_=JSONB),
    )
    new_id = bindparam("b_job_id", type_=BigInteger)
    values: dict[str, ColumnElement[Any]] = {
        "ready_slot": bindparam("b_ready_slot", type_=done.c.ready_slot.type),
        "ready_generation": bindparam("b_ready_generation", type_=BigInteger),
        "state": _state("cancelled"),
        "lane_seq": -new_id,
        "enqueue_shard": _SHARD0,
        "run_at": bindparam("b_run_at", type_=Timestamp),
        "finalized_at": _text_param_as("b_finalized_at", Timestamp),
        "payload": _concat(
            func.coalesce(payload, _EMPTY_OBJECT),
            func.jsonb_build_object(literal_column("'errors'"), errors, type_=JSONB),
        ),
    }
    row = (
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
    deltas = qs.queue_terminal_count_deltas
    n: ColumnElement[Any] = literal_column("256")
    bucket = ((row.c.job_id % n) + n) % n  # Euclidean, though ids are positive
    delta = (
        insert(deltas)
        .from_select(
            [
                "ready_slot",
                "ready_generation",
                "queue",
                "priority",
                "enqueue_shard",
                "counter_bucket",
                "terminal_delta",
            ],
            select(
                row.c.ready_slot,
                row.c.ready_generation,
                row.c.queue,
                row.c.priority,
                row.c.enqueue_shard,
                cast(bucket, SmallInteger),
                cast(literal_column("1"), BigInteger),
            ),
        )
        .returning(deltas.c.ready_slot)
        .cte("delta")
    )
    return select(row.c.job_id).select_from(row.join(delta, true()))


def all_builders() -> list[Callable[[], Any]]:
    """Every distinct statement, as zero-argument callables: for compile and cache tests."""
    tags: tuple[KindTag, ...] = ("snooze", "retry_after", "retry_backoff")
    out: list[Callable[[], Any]] = [
        routing_lock,
        insert_deferred,
        claim_unique_key,
        ring_cursor,
        lane_lock,
        ensure_lane_row,
        partial(ensure_lane_head, "enqueue"),
        partial(ensure_lane_head, "claim"),
        ensure_lane_sequences,
        clock,
        insert_cancelled,
    ]
    for tag in tags:
        out.append(partial(take_and_allocate, tag))
        out += [partial(canonical_move, tag, routed) for routed in (True, False)]
    return out
