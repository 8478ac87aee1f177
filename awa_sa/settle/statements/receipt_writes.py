"""The rows a queue-storage settle writes, each a data-modifying CTE of its one statement.

The receipt's closure (a closure row and ``closed_at``, or a closure batch; every
``lease_claims`` receipt sealed, docs/contract.md#sealed-receipts), the runtime's compact
completion, the ready-backed ``done_entries`` row, the ``deferred_jobs`` row of a re-schedule,
and the unique claim released or taken as the mask says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Insert,
    Select,
    Table,
    case,
    cast,
    delete,
    exists,
    func,
    insert,
    literal_column,
    not_,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import INT8MULTIRANGE, INTERVAL, JSONB
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.sql import (
    EMPTY_OBJECT,
)
from awa_sa.settle.statements.receipt_targets import (
    claim_slot_bind,
    tagged,
    text_literal,
)
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import JOB_STATES, Timestamp, job_state, job_unique_claims

ONE: ColumnElement[Any] = literal_column("1")


def is_terminal(shaped: CTE) -> ColumnElement[bool]:
    return shaped.c.next_state.in_([text_literal(s) for s in ("completed", "cancelled", "failed")])


def rows_of(values: Mapping[str, ColumnElement[Any]], *where: ColumnElement[bool]) -> Select[Any]:
    """The rows an INSERT takes, each value labelled as the column it fills."""
    return select(*(value.label(name) for name, value in values.items())).where(*where)


def insert_rows(
    table: Table, values: Mapping[str, ColumnElement[Any]], *where: ColumnElement[bool]
) -> Insert:
    return insert(table).from_select(list(values), rows_of(values, *where))


def claims_in(unique_states: Any, state_name: str | ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether the mask claims the key in *state_name* (its bit, leftmost first): a state the
    statement names, or one it reads from a row."""
    position: ColumnElement[Any]
    if isinstance(state_name, str):
        position = literal_column(str(JOB_STATES.index(state_name) + 1))
    else:
        position = case(
            *(
                (state_name == text_literal(name), literal_column(str(bit + 1)))
                for bit, name in enumerate(JOB_STATES)
            ),
        )
    return func.substr(unique_states, position, ONE) == text_literal("1")


def closing_rows(shaped: CTE, *, lease: bool = False) -> list[CTE]:
    """The receipt closed: a closure row and ``closed_at`` for a ``lease_claims`` receipt, a
    closure batch for every compact completion and for a compact receipt (which only
    ``cancel_job`` closes: ``settle`` refuses it). The receipt of a deleted *lease* closes as
    the runtime closes it then: ``completed`` after a completion, ``rescue`` after any other
    ending (the outcome it writes for every lease it deletes and reads back)."""
    s = shaped.c
    outcome: ColumnElement[Any] = s.next_state
    if lease:
        outcome = case(
            (tagged(shaped, "complete"), text_literal("completed")), else_=text_literal("rescue")
        )
    closures = qs.lease_claim_closures
    key: dict[str, ColumnElement[Any]] = {
        "claim_slot": s.claim_slot,
        "job_id": s.job_id,
        "run_lease": s.run_lease,
    }
    closed: dict[str, ColumnElement[Any]] = {
        **key,
        "outcome": outcome,
        "closed_at": func.clock_timestamp(),
    }
    row_closure = (
        pg_insert(closures)
        .from_select(list(closed), rows_of(closed, s.batch_id.is_(None), not_(s.fast)))
        .on_conflict_do_nothing(index_elements=list(key))
        .returning(*(closures.c[name] for name in (*key, "closed_at")))
        .cte("closure")
    )
    # ``closed_at`` on every ``lease_claims`` receipt, the fast path's too, where the runtime
    # leaves it NULL: a rescue whose snapshot predates this settle re-reads only the receipt row
    # it locks, so this is the one evidence it sees (docs/contract.md#sealed-receipts).
    claims = qs.lease_claims
    closed_at = func.coalesce(select(row_closure.c.closed_at).scalar_subquery(), s.settled_at)
    marked = (
        update(claims)
        .where(
            claims.c.claim_slot == claim_slot_bind(),
            *(claims.c[name] == value for name, value in key.items()),
            s.batch_id.is_(None),
        )
        .values(closed_at=func.coalesce(claims.c.closed_at, closed_at))
        .returning(claims.c.job_id)
        .cte("marked")
    )
    batches = qs.lease_claim_closure_batches
    receipt = s.receipt_id
    ranges = func.int8multirange(
        func.int8range(receipt, receipt + ONE, text_literal("[)")), type_=INT8MULTIRANGE
    )
    batch: dict[str, ColumnElement[Any]] = {
        "claim_slot": s.claim_slot,
        "ready_slot": s.ready_slot,
        "ready_generation": s.ready_generation,
        "outcome": s.next_state,
        "closed_count": ONE,
        "receipt_ids": pg_array([receipt]),
        "receipt_ranges": ranges,
        # A compact completion closes with its completion's clock, as the runtime's batch does.
        "closed_at": case((s.fast, s.settled_at), else_=func.clock_timestamp()),
    }
    batch_closure = (
        insert_rows(batches, batch, or_(s.batch_id.is_not(None), s.fast))
        .returning(batches.c.claim_slot)
        .cte("closed_batch")
    )
    return [row_closure, marked, batch_closure]


def completion_batch(shaped: CTE) -> CTE:
    """A bare job's completion, as the runtime records it on its compact path."""
    s = shaped.c
    batches = qs.receipt_completion_batches
    values: dict[str, ColumnElement[Any]] = {
        name: s[name] for name in ("ready_slot", "ready_generation", "claim_slot", "queue")
    }
    # The runtime's completions carry the lane's priority (its claim reference's), which
    # ``terminal_jobs`` joins the ready row by; an aged claim's own priority is lower.
    values["priority"] = s.lane_priority
    values["enqueue_shard"] = s.enqueue_shard
    values["completed_count"] = ONE
    for column, name in (
        ("job_ids", "job_id"),
        ("run_leases", "run_lease"),
        ("lane_seqs", "lane_seq"),
        ("attempts", "attempt"),
        ("attempted_ats", "ended_attempted_at"),
    ):
        values[column] = pg_array([s[name]])
    values["finalized_at"] = s.settled_at
    return (
        insert_rows(batches, values, s.fast).returning(batches.c.ready_slot).cte("completion_batch")
    )


_DONE_CARRIED = (
    "ready_slot",
    "ready_generation",
    "job_id",
    "kind",
    "queue",
    "priority",
    "attempt",
    "run_lease",
    "lane_seq",
    "enqueue_shard",
)
"""What a ready-backed ``done_entries`` row carries from the receipt and its ready row."""


def done_row(shaped: CTE) -> CTE:
    """The ready-backed terminal row: the columns ``terminal_jobs`` cannot join back, and the
    payload only where it differs from the ready row's."""
    s = shaped.c
    done = qs.done_entries
    stored = case(
        (or_(s.payload == EMPTY_OBJECT, s.payload == s.ready_payload), cast(null(), JSONB)),
        (tagged(shaped, "admin_cancel"), cast(null(), JSONB)),
        else_=s.payload,
    )
    values: dict[str, ColumnElement[Any]] = {name: s[name] for name in _DONE_CARRIED}
    # Keyed by its ready row's lane position, whose priority is the lane's: an aged claim's
    # lower one would join no ready row and could take another lane's key.
    values["priority"] = s.lane_priority
    values |= {
        "attempted_at": s.ended_attempted_at,
        "state": cast(s.next_state, job_state),
        "finalized_at": func.clock_timestamp(),
        "payload": stored,
    }
    key = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "job_id")
    return (
        insert_rows(done, values, is_terminal(shaped), not_(s.fast))
        .returning(*(done.c[name] for name in key))
        .cte("done")
    )


_DEFERRED_CARRIED = (
    "job_id",
    "kind",
    "queue",
    "args",
    "priority",
    "run_lease",
    "max_attempts",
    "attempted_at",
    "created_at",
    "unique_key",
    "unique_states",
)


def deferred_row(shaped: CTE) -> CTE:
    """The job's next run, under the same id and lease: a snooze gives its attempt back."""
    s = shaped.c
    deferred = qs.deferred_jobs
    snoozed = s.next_state == text_literal("scheduled")
    seconds = func.make_interval(*([literal_column("0")] * 6), s.delay, type_=INTERVAL)
    # A delay counts from the settle's clock, which a retry's finalized_at is too; a backoff
    # from a clock of its own, as the runtime reads it in a statement of its own.
    backoff = func.clock_timestamp() + func.awa.backoff_duration(
        s.attempt, s.max_attempts, type_=INTERVAL
    )
    run_at = case((tagged(shaped, "snooze", "retry_after"), s.settled_at + seconds), else_=backoff)
    values: dict[str, ColumnElement[Any]] = {name: s[name] for name in _DEFERRED_CARRIED}
    values |= {
        "state": cast(s.next_state, job_state),
        "attempt": case((snoozed, s.attempt - ONE), else_=s.attempt),
        "run_at": run_at,
        "finalized_at": case((snoozed, cast(null(), Timestamp)), else_=s.settled_at),
        "payload": func.nullif(s.payload, EMPTY_OBJECT, type_=JSONB),
    }
    return (
        insert_rows(deferred, values, not_(is_terminal(shaped)))
        .returning(deferred.c.job_id, deferred.c.run_at, deferred.c.attempt)
        .cte("deferred")
    )


def unique_claim_sync(shaped: CTE) -> list[CTE]:
    """The key's claim released or taken as the mask says for running and the next state."""
    s = shaped.c
    claims = job_unique_claims
    held = claims_in(s.unique_states, text_literal("running"))
    wanted = claims_in(s.unique_states, s.next_state)
    released = (
        delete(claims)
        .where(claims.c.unique_key == s.unique_key, claims.c.job_id == s.job_id, held, ~wanted)
        .returning(claims.c.job_id)
        .cte("released")
    )
    # A key another job holds makes this INSERT fail on the claims' primary key: the runtime's
    # UniqueConflict, and nothing of the settle is kept.
    mine = exists().where(claims.c.unique_key == s.unique_key, claims.c.job_id == s.job_id)
    values: dict[str, ColumnElement[Any]] = {"unique_key": s.unique_key, "job_id": s.job_id}
    taken = (
        insert_rows(claims, values, s.unique_key.is_not(None), ~held, wanted, ~mine)
        .returning(claims.c.job_id)
        .cte("claimed")
    )
    return [released, taken]
