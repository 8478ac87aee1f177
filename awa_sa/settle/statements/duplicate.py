"""The cancelled duplicate: a successor whose unique key a newer job holds, recorded cancelled.

The single-attempt path of docs/contract.md#cancelled: read the ring cursor, ensure the lane
(advisory lock, lane row, both head rows, the lane sequences), read the clock, then insert the
cancelled ``done_entries`` row and its terminal-count delta.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Insert,
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    insert,
    literal_column,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.registry import Query, Rows, no_binds, statement
from awa_sa.core.sql import (
    EMPTY_ARRAY,
    EMPTY_OBJECT,
    SHARD0,
    concat,
    jsonb_param,
    state,
    text_param_as,
)
from awa_sa.settle.statements.migration import Successor, column_value, successor_binds
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp

LIFECYCLE_DUPLICATE = "rescheduled as duplicate: unique claim held by a newer job"


@statement
def ring_cursor() -> Select[Any]:
    """The v040 ring cursor: a plain read, no lock, as in Awa 0.6 (docs/contract.md#cancelled)."""
    ring = qs.queue_ring_state
    return select(ring.c.current_slot, ring.c.generation).where(ring.c.singleton)


@statement
def lane_lock() -> Select[Any]:
    """Lane step 1: serialise lane creation on ``hashtextextended('S:queue:priority:0', 0)``."""
    key = bindparam("b_lane_key", type_=Text)
    return select(func.pg_advisory_xact_lock(func.hashtextextended(key, literal_column("0"))))


def _lane_values() -> dict[str, ColumnElement[Any]]:
    return {
        "queue": bindparam("b_queue", type_=Text),
        "priority": cast(bindparam("b_priority", type_=SmallInteger), SmallInteger),
    }


@statement
def ensure_lane_row() -> Insert:
    """Lane step 2: ``S.queue_lanes``; the head rows below need it for nothing but parity."""
    return (
        pg_insert(qs.queue_lanes)
        .values(_lane_values())
        .on_conflict_do_nothing(index_elements=["queue", "priority"])
        .inline()
    )


@statement
def ensure_lane_head(*, table: Literal["enqueue", "claim"]) -> Insert:
    """Lane steps 3/4: the head row of shard 0; its BEFORE INSERT trigger creates the sequence.

    The trigger fires even when ON CONFLICT then skips the row; it only moves sequences forward.
    """
    target = qs.queue_enqueue_heads if table == "enqueue" else qs.queue_claim_heads
    return (
        pg_insert(target)
        .values({**_lane_values(), "enqueue_shard": SHARD0})
        .on_conflict_do_nothing(index_elements=["queue", "priority", "enqueue_shard"])
        .inline()
    )


@statement
def ensure_lane_sequences() -> Select[Any]:
    """Lane step 5: ``S.ensure_lane_sequences(queue, priority::smallint, 0::smallint)``."""
    values = _lane_values()
    return select(qs.ensure_lane_sequences(values["queue"], values["priority"], SHARD0))


@statement
def clock() -> Select[Any]:
    """The wall clock after lane ensuring: the cancelled row's ``finalized_at``.

    See docs/contract.md#cancelled.
    """
    return select(cast(func.clock_timestamp(), Text))


def _payload_with_lifecycle_error() -> ColumnElement[Any]:
    """``b_payload`` (NULL meaning empty) with ``b_lifecycle_error`` appended to its errors."""
    payload = jsonb_param("b_payload")
    previous = payload.op("->", return_type=JSONB)(literal_column("'errors'"))
    errors = concat(
        func.coalesce(previous, EMPTY_ARRAY),
        func.jsonb_build_array(jsonb_param("b_lifecycle_error"), type_=JSONB),
    )
    return concat(
        func.coalesce(payload, EMPTY_OBJECT),
        func.jsonb_build_object(literal_column("'errors'"), errors, type_=JSONB),
    )


def _insert_done_entry() -> CTE:
    """INSERT the cancelled ``done_entries`` row, returning its terminal-count key."""
    done = qs.done_entries
    new_id = bindparam("b_job_id", type_=BigInteger)
    values: dict[str, ColumnElement[Any]] = {
        "ready_slot": bindparam("b_ready_slot", type_=done.c.ready_slot.type),
        "ready_generation": bindparam("b_ready_generation", type_=BigInteger),
        "state": state("cancelled"),
        "lane_seq": -new_id,
        "enqueue_shard": SHARD0,
        "run_at": bindparam("b_run_at", type_=Timestamp),
        "finalized_at": text_param_as("b_finalized_at", Timestamp),
        "payload": _payload_with_lifecycle_error(),
    }
    return (
        insert(done)
        .values({c.name: values.get(c.name, column_value(c)) for c in done.c})
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


def counter_bucket(job_id: ColumnElement[Any]) -> ColumnElement[Any]:
    """``job_id`` modulo 256, Euclidean (ids are positive, but the bucket must never be)."""
    n = _TERMINAL_BUCKETS
    return cast(((job_id % n) + n) % n, SmallInteger)


def insert_terminal_delta(done: CTE) -> CTE:
    """INSERT the ``+1`` terminal-count delta of the row *done* inserted."""
    deltas = qs.queue_terminal_count_deltas
    key = ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard"]
    return (
        insert(deltas)
        .from_select(
            [*key, "counter_bucket", "terminal_delta"],
            select(
                *(done.c[name] for name in key),
                counter_bucket(done.c.job_id).label("counter_bucket"),
                cast(literal_column("1"), BigInteger).label("terminal_delta"),
            ),
        )
        .returning(deltas.c.ready_slot)
        .cte("delta")
    )


@statement
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
    delta = insert_terminal_delta(done)
    return select(done.c.job_id).select_from(done.join(delta, true()))


# --- parameters and rows -------------------------------------------------------------------


class Ring(NamedTuple):
    """The ring cursor: where a terminal row is filed."""

    current_slot: int
    generation: int


class Lane(NamedTuple):
    """The lane a cancelled row is filed under: shard 0 of ``(queue, priority)`` in *schema*."""

    schema: str
    queue: str
    priority: int


def _lane_binds(lane: Lane) -> dict[str, Any]:
    return {"b_queue": lane.queue, "b_priority": lane.priority}


def _lane_key_binds(lane: Lane) -> dict[str, Any]:
    """The advisory-lock key Awa serialises lane creation on."""
    return {"b_lane_key": f"{lane.schema}:{lane.queue}:{lane.priority}:0"}


class CancelledRow(NamedTuple):
    """The cancelled ``done_entries`` row: the successor, filed in the ring, with its error."""

    successor: Successor
    ring: Ring
    finalized_at: str
    """The clock's text, cast back in SQL."""
    lifecycle_error: str
    """JSON text of the error entry appended to the payload's errors."""


def _cancelled_binds(row: CancelledRow) -> dict[str, Any]:
    return {
        **successor_binds(row.successor),
        "b_ready_slot": row.ring.current_slot,
        "b_ready_generation": row.ring.generation,
        "b_finalized_at": row.finalized_at,
        "b_lifecycle_error": row.lifecycle_error,
    }


def _ring(rows: Rows) -> Ring | None:
    return Ring(rows[0].current_slot, rows[0].generation) if rows else None


def _nothing(_: object) -> None:
    return None


RING_CURSOR: Query[None, Ring | None] = Query(lambda _: ring_cursor(), no_binds, _ring)
LANE_LOCK: Query[Lane, None] = Query(lambda _: lane_lock(), _lane_key_binds, _nothing)
ENSURE_LANE_ROW: Query[Lane, None] = Query(lambda _: ensure_lane_row(), _lane_binds, _nothing)
ENSURE_ENQUEUE_HEAD: Query[Lane, None] = Query(
    lambda _: ensure_lane_head(table="enqueue"), _lane_binds, _nothing
)
ENSURE_CLAIM_HEAD: Query[Lane, None] = Query(
    lambda _: ensure_lane_head(table="claim"), _lane_binds, _nothing
)
ENSURE_LANE_SEQUENCES: Query[Lane, None] = Query(
    lambda _: ensure_lane_sequences(), _lane_binds, _nothing
)
CLOCK: Query[None, str] = Query(lambda _: clock(), no_binds, lambda rows: rows[0][0])
INSERT_CANCELLED: Query[CancelledRow, None] = Query(
    lambda _: insert_cancelled(), _cancelled_binds, _nothing
)
