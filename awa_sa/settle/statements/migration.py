"""The queue-storage branch's statements: take and allocate, deferred rows, unique claims.

Awa's migration of a canonical attempt into queue storage (docs/contract.md#take onwards): the
canonical rows are taken and their successors allocated fresh ids in one statement, then the
successors' unique keys are claimed and the deferred rows inserted. JSON and timestamps travel
between these statements as text and are cast back in SQL, so they arrive exactly as stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Insert,
    LargeBinary,
    Select,
    Text,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal_column,
    null,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import (
    EMPTY_ERRORS,
    EMPTY_OBJECT,
    ZERO,
    bound_rows,
    concat,
    head_row,
    head_then,
    representable,
    rows_as_binds,
)
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
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import CALLBACK_COLUMNS, Timestamp, job_state, job_unique_claims


def _payload(taken: CTE) -> ColumnElement[Any]:
    """The compacted queue-storage payload (docs/contract.md#payload), NULL when empty."""
    errors = func.coalesce(errors_after(taken), EMPTY_ERRORS, type_=ARRAY(JSONB))
    progress = cast(taken.c.new_progress, JSONB)

    def entry(key: str, present: ColumnElement[bool], value: ColumnElement[Any]) -> Any:
        obj = func.jsonb_build_object(literal_column(f"'{key}'"), value, type_=JSONB)
        return case((present, obj), else_=EMPTY_OBJECT)

    composed = concat(
        entry("metadata", taken.c.metadata != EMPTY_OBJECT, taken.c.metadata),
        entry("tags", func.cardinality(taken.c.tags) > ZERO, func.to_jsonb(taken.c.tags)),
        entry("errors", func.cardinality(errors) > ZERO, func.to_jsonb(errors)),
        entry("progress", progress.is_not(None), progress),
    )
    return func.nullif(composed, EMPTY_OBJECT, type_=JSONB)


def _callbacks_unwired(row: Any) -> list[ColumnElement[bool]]:
    """A row waiting on a callback stays canonical: the canonical move takes it instead."""
    return [row.c[name].is_(None) for name in CALLBACK_COLUMNS]


def _timed(taken: CTE) -> CTE:
    """The taken rows with their new run_at, in a CTE so the volatile backoff runs once a row."""
    return select(taken, run_at(taken).label("new_run_at")).cte("timed")


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
    finalized = finalized_at(timed, cast(null(), Timestamp))
    return (
        select(
            # run_at first: PostgreSQL evaluates the list in order, so an out-of-range run_at
            # (22008) fails before nextval and burns no id.
            representable(timed.c.new_run_at).label("run_at"),
            _fresh_id(metadata_type).label("job_id"),
            timed.c.kind,
            timed.c.queue,
            cast(timed.c.args, Text).label("args"),
            cast(successor_state(timed), Text).label("state"),
            timed.c.priority,
            successor_attempt(timed).label("attempt"),
            timed.c.run_lease,
            timed.c.max_attempts,
            cast(timed.c.attempted_at, Text).label("attempted_at"),
            cast(finalized, Text).label("finalized_at"),
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


@statement
def take_and_allocate(*, batch: bool) -> Select[Any]:
    """Take the canonical rows and allocate their successors, one statement (docs/contract.md#take).

    Awa's two statements merged: ``nextval`` sits in the select list over the deleted rows,
    so it runs only for a taken row -- a stale attempt consumes no sequence value -- and only
    when that row's metadata is a JSON object, because such a job is refused right after
    (docs/contract.md#payload) and should not burn an id either. The list is evaluated after the
    ``ORDER BY ord``, so fresh ids follow the caller's order, as one call after another would.

    Returns a first row whose ``shared_key`` says whether anything was taken (see
    ``shared_key``), then one row per taken job, named like the ``deferred_jobs`` columns plus
    ``ord`` and ``metadata_type`` (``job_id`` NULL when metadata is not an object). An item
    without a row (callback wiring, a guard miss) falls through to the canonical move.
    """
    firsts = attempt_rows(batch)
    head = head_row(shared_key(firsts, batch).label("shared_key"))
    taken = take(firsts, head, batch=batch, eligible=_callbacks_unwired)
    successors = _allocated_successors(_timed(taken))
    return head_then(head, successors, successors)


CARRIED_AS_TEXT: dict[str, Any] = {
    "args": JSONB,
    "state": job_state,
    "attempted_at": Timestamp,
    "finalized_at": Timestamp,
    "created_at": Timestamp,
    "payload": JSONB,
}
"""Successor fields that travel as text and are cast back on insert."""


def carried(column: Any, value: ColumnElement[Any]) -> ColumnElement[Any]:
    """*value*, typed as *column*: cast back for the fields that travel as text."""
    if column.name in CARRIED_AS_TEXT:
        return cast(value, CARRIED_AS_TEXT[column.name])
    return value


def column_value(column: Any) -> ColumnElement[Any]:
    """The scalar ``:b_<column>`` parameter, cast to the column's type."""
    if column.name in CARRIED_AS_TEXT:
        return carried(column, bindparam(f"b_{column.name}", type_=Text))
    return cast(bindparam(f"b_{column.name}", type_=column.type), column.type)


@statement
def insert_deferred(*, batch: bool) -> Insert:
    """The successors as deferred jobs: all 16 columns explicit (docs/contract.md#deferred).

    ``b_<column>`` scalars for one row, or arrays with one element per row for a batch.
    """
    table = qs.deferred_jobs
    transport = [Text if c.name in CARRIED_AS_TEXT else c.type for c in table.c]
    fields = [(f"b_{c.name}", c.name, t) for c, t in zip(table.c, transport, strict=True)]
    rows = bound_rows("successor", fields, batch)
    values = select(*(carried(c, rows.c[c.name]) for c in table.c))
    return insert(table).from_select([c.name for c in table.c], values)


@statement
def claim_unique_keys(*, batch: bool) -> Insert:
    """Acquire each ``(key, job)`` unless another job id holds the key (docs/contract.md#claims).

    On conflict a row is "updated" to itself only when it already names this job, so the
    returned ``job_id`` values are the claims acquired and a missing one is held by someone
    else. The keys of one call must be distinct: ON CONFLICT DO UPDATE cannot touch a row twice.
    """
    fields = [("b_unique_key", "unique_key", LargeBinary), ("b_job_id", "job_id", BigInteger)]
    rows = bound_rows("claim", fields, batch)
    stmt = pg_insert(job_unique_claims).from_select(
        ["unique_key", "job_id"], select(rows.c.unique_key, rows.c.job_id)
    )
    return stmt.on_conflict_do_update(
        index_elements=[job_unique_claims.c.unique_key],
        set_={"job_id": stmt.excluded.job_id},
        where=job_unique_claims.c.job_id == stmt.excluded.job_id,
    ).returning(job_unique_claims.c.job_id)


# --- parameters and rows -------------------------------------------------------------------


class Successor(NamedTuple):
    """A taken job's successor: its ``deferred_jobs`` row, field for column, in table order.

    ``args``, ``state``, ``attempted_at``, ``finalized_at``, ``created_at`` and ``payload``
    are the text PostgreSQL returned (:data:`CARRIED_AS_TEXT`).
    """

    job_id: int
    kind: str
    queue: str
    args: str
    state: str
    priority: int
    attempt: int
    run_lease: int
    max_attempts: int
    run_at: datetime
    attempted_at: str | None
    finalized_at: str | None
    created_at: str
    unique_key: bytes | None
    unique_states: str | None
    payload: str | None


def successor_binds(successor: Successor) -> dict[str, Any]:
    """The ``b_<column>`` binds of one successor row."""
    return {f"b_{name}": value for name, value in zip(Successor._fields, successor, strict=True)}


@dataclass(frozen=True, slots=True, eq=False)
class TakenJob:
    """A canonical row taken for queue storage, and its successor; compared by identity."""

    index: int
    """The position of the item it answers in the call's list."""
    successor: Successor


@dataclass(frozen=True, slots=True)
class Taken:
    """What the take did: the jobs it took, the items refused for their metadata, or nothing
    at all because two of the batch's rows share a unique key."""

    jobs: list[TakenJob]
    shared_key: bool
    not_objects: list[tuple[int, str]]
    """``(index, jsonb_typeof)`` of taken items whose metadata is not a JSON object."""

    @classmethod
    def read(cls, rows: Rows) -> Taken:
        jobs, not_objects = [], []
        for r in rows:
            if r.ord is None:
                continue  # the flags row, joined to nothing
            if r.job_id is None:
                not_objects.append((r.ord - 1, str(r.metadata_type)))
                continue
            successor = Successor(*(getattr(r, name) for name in Successor._fields))
            jobs.append(TakenJob(r.ord - 1, successor))
        return cls(jobs, bool(rows[0].shared_key), not_objects)


class Claim(NamedTuple):
    """A unique key to claim for a job."""

    unique_key: bytes
    job_id: int


def _claim_binds(claims: Sequence[Claim]) -> Any:
    return rows_as_binds([{"b_unique_key": c.unique_key, "b_job_id": c.job_id} for c in claims])


def _batch(rows: Sequence[object]) -> bool:
    return len(rows) > 1


TAKE_AND_ALLOCATE: Query[Sequence[MoveItem], Taken] = Query(
    lambda items: take_and_allocate(batch=_batch(items)), item_binds, Taken.read
)
INSERT_DEFERRED: Query[Sequence[Successor], None] = Query(
    lambda rows: insert_deferred(batch=_batch(rows)),
    lambda rows: rows_as_binds([successor_binds(row) for row in rows]),
    lambda _: None,
)
CLAIM_UNIQUE_KEYS: Query[Sequence[Claim], set[int]] = Query(
    lambda claims: claim_unique_keys(batch=_batch(claims)),
    _claim_binds,
    lambda rows: {row[0] for row in rows},
)
"""The job ids whose claims were acquired; a missing one is held by another job."""
