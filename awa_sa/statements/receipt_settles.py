"""The settle of a queue-storage attempt: its receipt closed, and the job's next row written.

What Awa 0.6.9's runtime writes when a receipt-claimed attempt ends (docs/contract.md#receipts),
reproduced from outside because v040 has no SQL function for it. Two statements, as the
runtime sends them:

1. :func:`receipt_lock`: the transaction-scoped advisory lock on
   ``hashtextextended('awa.receipt.complete:<job_id>:<run_lease>', 0)`` that every settle of the
   attempt takes first (the runtime's completions, failures, retries, rescues), so that whoever
   waits takes its statement snapshot after the first settle committed and sees its evidence.
2. :func:`settle_receipt`: one data-modifying statement that finds the receipt still open (no
   closure evidence of any of the six kinds, no materialised lease), closes it, and writes the
   job's next row from its ``ready_entries`` row, which a claim leaves as it was:

   * a completion of a bare job (no unique key, tags or errors; metadata at most Awa's own
     ``_awa_original_*`` keys): a ``receipt_completion_batches`` row and a closure batch, and no
     ``done_entries`` row (the runtime's fast path);
   * any other ending: a closure, a ready-backed ``done_entries`` row (no args, run_at,
     created_at or unique columns: ``terminal_jobs`` joins them back from ``ready_entries``),
     its ``+1`` terminal-count delta, and the unique claim released where the mask says;
   * a re-schedule (Snooze, RetryAfter, RetryBackoff, a retryable failure with attempts left):
     a closure and a ``deferred_jobs`` row under the **same** job id and lease.

   A receipt of a queue with a deadline is a ``lease_claims`` row and is closed by a
   ``lease_claim_closures`` row plus its ``closed_at``; a compact receipt (a queue without a
   deadline) is one position of a ``lease_claim_batches`` row and is closed by a closure batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    Boolean,
    ColumnElement,
    Double,
    Insert,
    Integer,
    Select,
    SmallInteger,
    Table,
    Text,
    and_,
    bindparam,
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
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, INT8MULTIRANGE, INTERVAL, JSONB
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa import queue_storage as qs
from awa_sa.statements.duplicate import insert_terminal_delta
from awa_sa.statements.endings import rfc3339
from awa_sa.statements.registry import Query, Rows, statement
from awa_sa.statements.sql import (
    EMPTY_ARRAY,
    EMPTY_OBJECT,
    bound_rows,
    concat,
    head_row,
    head_then,
    rows_as_binds,
)
from awa_sa.tables import JOB_STATES, Timestamp, job_state, job_unique_claims

ReceiptTag = Literal[
    "complete",
    "cancel",
    "fail",
    "fail_terminal",
    "snooze",
    "retry_after",
    "retry_backoff",
    "admin_cancel",
]
"""A result as the statement sees it. ``admin_cancel`` is awa-pg's ``Client.cancel`` of a
running attempt (docs/administer.md): cancelled with no error entry, the payload left to the
ready row, ``attempt_state`` kept."""

LOCK_PREFIX = "awa.receipt.complete:"
"""The advisory-lock key text, before ``<job_id>:<run_lease>``, as the runtime spells it."""

COMPACT_METADATA_KEYS = ("_awa_original_priority", "_awa_original_queue")
"""The metadata keys a bare job's completion may carry and still take the compact path."""


class ReceiptItem(NamedTuple):
    """The parameters of one queue-storage attempt's settle."""

    job_id: int
    run_lease: int
    claim_slot: int
    receipt_id: int
    batch_id: int | None
    """The compact receipt's ``lease_claim_batches`` row, or None for a ``lease_claims`` row."""
    batch_index: int | None
    """Its 1-based position in that row."""
    tag: ReceiptTag
    message: str | None
    """The cancel reason or the failure's text; None otherwise."""
    error: str | None
    """JSON text of an error entry a re-schedule appends, or None."""
    progress: str | None
    """JSON text of the progress to write; None keeps what the attempt last flushed."""
    delay: float | None
    """Seconds, for Snooze and RetryAfter."""
    kind: str
    queue: str
    attempt: int
    """The identity the caller read, checked against the receipt and its ready row."""


_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("b_job_id", "job_id", BigInteger),
    ("b_run_lease", "run_lease", BigInteger),
    ("b_claim_slot", "claim_slot", Integer),
    ("b_receipt_id", "receipt_id", BigInteger),
    ("b_batch_id", "batch_id", BigInteger),
    ("b_batch_index", "batch_index", Integer),
    ("b_tag", "tag", Text),
    ("b_message", "message", Text),
    ("b_error", "error", Text),
    ("b_progress", "new_progress", Text),
    ("b_delay", "delay", Double),
    ("b_kind", "want_kind", Text),
    ("b_queue", "want_queue", Text),
    ("b_attempt", "want_attempt", SmallInteger),
)


def _binds(item: ReceiptItem) -> Mapping[str, Any]:
    return dict(zip((bind for bind, _, _ in _FIELDS), item, strict=True))


def _asked() -> CTE:
    row = [cast(bindparam(b, type_=t), t).label(c) for b, c, t in _FIELDS]
    return select(*row).cte("asked")


def _text(value: str) -> ColumnElement[Any]:
    return literal_column(f"'{value}'", Text)


@statement
def receipt_lock(*, batch: bool) -> Select[Any]:
    """The runtime's advisory lock on each attempt's receipt, held to the end of the
    transaction; a batch takes them in one statement, distinct and in ascending key order, as
    the runtime's batched completion does, so that the two cannot deadlock."""
    fields = [("b_job_id", "job_id", BigInteger), ("b_run_lease", "run_lease", BigInteger)]
    pairs = bound_rows("pairs", fields, batch)
    # ``format('...%s:%s', ...)`` as the runtime spells it, without a ``%`` in the text: the
    # same key for bigints, and no literal a driver's paramstyle could take for a placeholder.
    key = (
        _text(LOCK_PREFIX) + cast(pairs.c.job_id, Text) + _text(":") + cast(pairs.c.run_lease, Text)
    )
    lock_key = func.pg_catalog.hashtextextended(key, literal_column("0"), type_=BigInteger)
    keys = select(lock_key.label("lock_key")).distinct().order_by(lock_key)
    ordered = keys.cte("locks").prefix_with("MATERIALIZED")
    locked = func.pg_catalog.pg_advisory_xact_lock(ordered.c.lock_key, type_=Text)
    return select(locked.label("locked"))


def _is(row: Any, *tags: ReceiptTag) -> ColumnElement[bool]:
    tagged: ColumnElement[bool] = row.c.tag.in_([_text(tag) for tag in tags])
    return tagged


def _evidence(
    claim_slot: Any, job_id: Any, run_lease: Any, receipt_id: Any, *, in_slot: bool
) -> list[ColumnElement[bool]]:
    """No closure evidence names the receipt: the six kinds the runtime anti-joins, and no
    materialised lease (a callback wait's; that branch is refused, see :class:`Settled`)."""
    closures = qs.lease_claim_closures.alias("closure")
    ranges = qs.lease_claim_closure_batches.alias("closed")
    in_range = ranges.c.receipt_ranges.op("@>", return_type=Boolean)(receipt_id)
    found = [
        exists().where(
            closures.c.claim_slot == claim_slot,
            closures.c.job_id == job_id,
            closures.c.run_lease == run_lease,
        ),
        exists().where(in_range, *([ranges.c.claim_slot == claim_slot] if in_slot else [])),
    ]
    for table in (qs.done_entries, qs.deferred_jobs, qs.dlq_entries, qs.leases):
        found.append(exists().where(table.c.job_id == job_id, table.c.run_lease == run_lease))
    return [not_(evidence) for evidence in found]


_TARGET = (
    "claim_slot",
    "batch_id",
    "receipt_id",
    "ready_slot",
    "ready_generation",
    "job_id",
    "queue",
    "priority",
    "attempt",
    "run_lease",
    "max_attempts",
    "lane_seq",
    "enqueue_shard",
    "attempted_at",
)


def _row_target(asked: CTE) -> Select[Any]:
    claims = qs.lease_claims.alias("claims")
    c = claims.c
    return (
        select(
            c.claim_slot,
            cast(null(), BigInteger).label("batch_id"),
            c.receipt_id,
            c.ready_slot,
            c.ready_generation,
            c.job_id,
            c.queue,
            c.priority,
            c.attempt,
            c.run_lease,
            c.max_attempts,
            c.lane_seq,
            c.enqueue_shard,
            c.claimed_at.label("attempted_at"),
        )
        .select_from(claims)
        .join(
            asked,
            and_(
                c.claim_slot == asked.c.claim_slot,
                c.job_id == asked.c.job_id,
                c.run_lease == asked.c.run_lease,
                c.receipt_id == asked.c.receipt_id,
                asked.c.batch_id.is_(None),
            ),
        )
        .where(
            c.closed_at.is_(None),
            *_evidence(c.claim_slot, c.job_id, c.run_lease, c.receipt_id, in_slot=False),
        )
        .with_for_update(of=claims)
    )


def _batch_target(asked: CTE) -> Select[Any]:
    batches = qs.lease_claim_batches.alias("claim_batches")
    b = batches.c
    i = asked.c.batch_index

    def at(array: Any) -> ColumnElement[Any]:
        item: ColumnElement[Any] = array[i]
        return item

    return (
        select(
            b.claim_slot,
            b.batch_id,
            at(b.receipt_ids).label("receipt_id"),
            b.ready_slot,
            b.ready_generation,
            at(b.job_ids).label("job_id"),
            b.queue,
            b.priority,
            at(b.attempts).label("attempt"),
            at(b.run_leases).label("run_lease"),
            at(b.max_attempts).label("max_attempts"),
            at(b.lane_seqs).label("lane_seq"),
            b.enqueue_shard,
            b.claimed_at.label("attempted_at"),
        )
        .select_from(batches)
        .join(asked, and_(b.claim_slot == asked.c.claim_slot, b.batch_id == asked.c.batch_id))
        .where(
            i.between(literal_column("1"), b.claimed_count),
            at(b.job_ids) == asked.c.job_id,
            at(b.run_leases) == asked.c.run_lease,
            at(b.receipt_ids) == asked.c.receipt_id,
            *_evidence(
                b.claim_slot, asked.c.job_id, asked.c.run_lease, asked.c.receipt_id, in_slot=True
            ),
        )
        # Not locked: the batch row is append-only and holds its siblings' receipts too, whose
        # settles by the runtime's slow path lock it; the receipt's advisory lock already
        # serialises every settle of this attempt.
    )


def _claim_time(target: Any, lane_priority: ColumnElement[Any]) -> ColumnElement[Any]:
    """The ``attempted_at`` a completion writes: the job row a claim returns carries the claim's
    own clock (kept in ``ready_claim_attempt_batches``; the receipt's ``claimed_at`` is a later
    one) for a receipt of a queue with a deadline, and NULL for a compact receipt."""
    claims = qs.ready_claim_attempt_batches.alias("claim_attempts")
    c = claims.c
    lane_seq = func.int8range(target.lane_seq, target.lane_seq + literal_column("1"))
    claimed = (
        select(func.max(c.claimed_at))
        .where(
            c.ready_slot == target.ready_slot,
            c.ready_generation == target.ready_generation,
            c.queue == target.queue,
            c.priority == lane_priority,
            c.enqueue_shard == target.enqueue_shard,
            c.claim_slot == target.claim_slot,
            c.lane_ranges.op("@>", return_type=Boolean)(lane_seq),
        )
        .scalar_subquery()
    )
    return case(
        (target.batch_id.is_(None), func.coalesce(claimed, target.attempted_at)),
        else_=cast(null(), Timestamp),
    )


def _taken(asked: CTE) -> CTE:
    """The open receipt, its ready row, and what the settle makes of it, guarded by identity."""
    # FOR UPDATE is not allowed under UNION: each shape locks in a CTE of its own.
    row_target = _row_target(asked).cte("row_target")
    batch_target = _batch_target(asked).cte("batch_target")
    target = select(row_target).union_all(select(batch_target)).cte("target")
    ready = qs.ready_entries
    t, r = target.c, ready.c
    payload = func.coalesce(r.payload, EMPTY_OBJECT, type_=JSONB)
    exhausted = t.attempt >= t.max_attempts
    next_state = case(
        (_is(asked, "complete"), _text("completed")),
        (_is(asked, "cancel", "admin_cancel"), _text("cancelled")),
        (_is(asked, "fail_terminal"), _text("failed")),
        (_is(asked, "fail") & exhausted, _text("failed")),
        (_is(asked, "snooze"), _text("scheduled")),
        else_=_text("retryable"),
    )
    metadata = _key(payload, "metadata", EMPTY_OBJECT)
    compact_metadata = metadata.op("-", return_type=JSONB)(
        cast(literal_column(f"'{{{','.join(COMPACT_METADATA_KEYS)}}}'"), ARRAY(Text))
    )
    bare = and_(
        r.unique_key.is_(None),
        _key(payload, "tags", EMPTY_ARRAY) == EMPTY_ARRAY,
        _key(payload, "errors", EMPTY_ARRAY) == EMPTY_ARRAY,
        compact_metadata == EMPTY_OBJECT,
    )
    return (
        select(
            *target.c,
            r.kind,
            r.args,
            r.run_at.label("ready_run_at"),
            r.created_at,
            r.unique_key,
            r.unique_states,
            payload.label("ready_payload"),
            next_state.label("next_state"),
            (_is(asked, "complete") & bare).label("fast"),
            case((_is(asked, "complete"), _claim_time(t, r.priority)), else_=t.attempted_at).label(
                "ended_attempted_at"
            ),
            func.clock_timestamp().label("settled_at"),
            *(asked.c[name] for name in ("tag", "message", "error", "new_progress", "delay")),
        )
        .select_from(target)
        .join(
            ready,
            and_(
                r.ready_slot == t.ready_slot,
                r.ready_generation == t.ready_generation,
                r.queue == t.queue,
                r.enqueue_shard == t.enqueue_shard,
                r.lane_seq == t.lane_seq,
                r.job_id == t.job_id,
            ),
        )
        .join(asked, true())
        .where(
            r.kind == asked.c.want_kind,
            t.queue == asked.c.want_queue,
            t.attempt == asked.c.want_attempt,
        )
        .cte("taken")
    )


def _claims(unique_states: Any, state_name: ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether the mask claims the key in *state_name* (its bit, leftmost first)."""
    position = case(
        *(
            (state_name == _text(name), literal_column(str(bit + 1)))
            for bit, name in enumerate(JOB_STATES)
        ),
    )
    return func.substr(unique_states, position, _ONE) == _text("1")


def _key(document: ColumnElement[Any], key: str, empty: ColumnElement[Any]) -> Any:
    """``document -> 'key'``, or *empty* where it is missing."""
    value = document.op("->", return_type=JSONB)(_text(key))
    return func.coalesce(value, empty, type_=JSONB)


def _entry(taken: CTE) -> ColumnElement[Any]:
    """The error entry the settle appends, or NULL: the runtime's for a cancel or a failure
    (``"terminal": true`` when it ends the job), the caller's for a re-schedule."""
    t = taken.c
    text = case((_is(taken, "cancel"), _text("cancelled: ") + t.message), else_=t.message)
    built = func.jsonb_build_object(
        _text("error"),
        text,
        _text("attempt"),
        t.attempt,
        _text("at"),
        rfc3339(func.now()),
        type_=JSONB,
    )
    terminal = func.jsonb_build_object(_text("terminal"), true(), type_=JSONB)
    flag = case((t.next_state == _text("failed"), terminal), else_=EMPTY_OBJECT)
    return case(
        (_is(taken, "cancel", "fail", "fail_terminal"), concat(built, flag)),
        else_=cast(t.error, JSONB),
    )


def _shaped(taken: CTE, flushed: CTE) -> CTE:
    """*taken* with the payload of the job's next row: the runtime's metadata, tags, errors
    and progress, each only when not empty (a completion drops the progress)."""
    entered = (
        select(*taken.c, _entry(taken).label("entry"), flushed.c.progress.label("flushed"))
        .select_from(taken.outerjoin(flushed, true()))
        .subquery("entered")
    )
    e = entered.c
    errors = case(
        (e.entry.is_(None), _key(e.ready_payload, "errors", EMPTY_ARRAY)),
        else_=concat(
            _key(e.ready_payload, "errors", EMPTY_ARRAY),
            func.jsonb_build_array(e.entry, type_=JSONB),
        ),
    )
    given = func.nullif(cast(e.new_progress, JSONB), cast(_text("null"), JSONB), type_=JSONB)
    progress = case(
        (_is(entered, "complete"), cast(null(), JSONB)),
        else_=func.coalesce(given, e.flushed, type_=JSONB),
    )
    metadata = _key(e.ready_payload, "metadata", EMPTY_OBJECT)
    tags = _key(e.ready_payload, "tags", EMPTY_ARRAY)

    def part(key: str, value: ColumnElement[Any], empty: ColumnElement[Any]) -> Any:
        obj = func.jsonb_build_object(_text(key), value, type_=JSONB)
        return case((func.coalesce(value, empty, type_=JSONB) != empty, obj), else_=EMPTY_OBJECT)

    parts = select(
        *(c for c in entered.c if c.name != "entry"),
        metadata.label("p_metadata"),
        tags.label("p_tags"),
        errors.label("p_errors"),
        progress.label("p_progress"),
    ).subquery("parts")
    p = parts.c
    payload = concat(
        part("metadata", p.p_metadata, EMPTY_OBJECT),
        part("tags", p.p_tags, EMPTY_ARRAY),
        part("errors", p.p_errors, EMPTY_ARRAY),
        part("progress", p.p_progress, cast(_text("null"), JSONB)),
    )
    keep = [c for c in parts.c if not c.name.startswith("p_")]
    return select(*keep, payload.label("payload")).cte("shaped")


def _terminal(shaped: CTE) -> ColumnElement[bool]:
    return shaped.c.next_state.in_([_text(s) for s in ("completed", "cancelled", "failed")])


def _rows(values: Mapping[str, ColumnElement[Any]], *where: ColumnElement[bool]) -> Select[Any]:
    """The rows an INSERT takes, each value labelled as the column it fills."""
    return select(*(value.label(name) for name, value in values.items())).where(*where)


def _into(
    table: Table, values: Mapping[str, ColumnElement[Any]], *where: ColumnElement[bool]
) -> Insert:
    return insert(table).from_select(list(values), _rows(values, *where))


_ONE: ColumnElement[Any] = literal_column("1")


def _closures(shaped: CTE) -> list[CTE]:
    """The receipt closed: a closure row and ``closed_at`` for a ``lease_claims`` receipt, a
    closure batch for a compact one and for every compact completion."""
    s = shaped.c
    closures = qs.lease_claim_closures
    key: dict[str, ColumnElement[Any]] = {
        "claim_slot": s.claim_slot,
        "job_id": s.job_id,
        "run_lease": s.run_lease,
    }
    closed: dict[str, ColumnElement[Any]] = {
        **key,
        "outcome": s.next_state,
        "closed_at": func.clock_timestamp(),
    }
    row_closure = (
        pg_insert(closures)
        .from_select(list(closed), _rows(closed, s.batch_id.is_(None), not_(s.fast)))
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
        .where(*(claims.c[name] == value for name, value in key.items()), s.batch_id.is_(None))
        .values(closed_at=func.coalesce(claims.c.closed_at, closed_at))
        .returning(claims.c.job_id)
        .cte("marked")
    )
    batches = qs.lease_claim_closure_batches
    receipt = s.receipt_id
    ranges = func.int8multirange(
        func.int8range(receipt, receipt + _ONE, _text("[)")), type_=INT8MULTIRANGE
    )
    batch: dict[str, ColumnElement[Any]] = {
        "claim_slot": s.claim_slot,
        "ready_slot": s.ready_slot,
        "ready_generation": s.ready_generation,
        "outcome": s.next_state,
        "closed_count": _ONE,
        "receipt_ids": pg_array([receipt]),
        "receipt_ranges": ranges,
        # A compact completion closes with its completion's clock, as the runtime's batch does.
        "closed_at": case((s.fast, s.settled_at), else_=func.clock_timestamp()),
    }
    batch_closure = (
        _into(batches, batch, or_(s.batch_id.is_not(None), s.fast))
        .returning(batches.c.claim_slot)
        .cte("closed_batch")
    )
    return [row_closure, marked, batch_closure]


def _completion_batch(shaped: CTE) -> CTE:
    """A bare job's completion, as the runtime records it on its compact path."""
    s = shaped.c
    batches = qs.receipt_completion_batches
    values: dict[str, ColumnElement[Any]] = {
        name: s[name]
        for name in ("ready_slot", "ready_generation", "claim_slot", "queue", "priority")
    }
    values["enqueue_shard"] = s.enqueue_shard
    values["completed_count"] = _ONE
    for column, name in (
        ("job_ids", "job_id"),
        ("run_leases", "run_lease"),
        ("lane_seqs", "lane_seq"),
        ("attempts", "attempt"),
        ("attempted_ats", "ended_attempted_at"),
    ):
        values[column] = pg_array([s[name]])
    values["finalized_at"] = s.settled_at
    return _into(batches, values, s.fast).returning(batches.c.ready_slot).cte("completion_batch")


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


def _done(shaped: CTE) -> CTE:
    """The ready-backed terminal row: the columns ``terminal_jobs`` cannot join back, and the
    payload only where it differs from the ready row's."""
    s = shaped.c
    done = qs.done_entries
    stored = case(
        (or_(s.payload == EMPTY_OBJECT, s.payload == s.ready_payload), cast(null(), JSONB)),
        (_is(shaped, "admin_cancel"), cast(null(), JSONB)),
        else_=s.payload,
    )
    values: dict[str, ColumnElement[Any]] = {name: s[name] for name in _DONE_CARRIED}
    values |= {
        "attempted_at": s.ended_attempted_at,
        "state": cast(s.next_state, job_state),
        "finalized_at": func.clock_timestamp(),
        "payload": stored,
    }
    key = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "job_id")
    return (
        _into(done, values, _terminal(shaped), not_(s.fast))
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


def _deferred(shaped: CTE) -> CTE:
    """The job's next run, under the same id and lease: a snooze gives its attempt back."""
    s = shaped.c
    deferred = qs.deferred_jobs
    snoozed = s.next_state == _text("scheduled")
    seconds = func.make_interval(*([literal_column("0")] * 6), s.delay, type_=INTERVAL)
    # A delay counts from the settle's clock, which a retry's finalized_at is too; a backoff
    # from a clock of its own, as the runtime reads it in a statement of its own.
    backoff = func.clock_timestamp() + func.awa.backoff_duration(
        s.attempt, s.max_attempts, type_=INTERVAL
    )
    run_at = case((_is(shaped, "snooze", "retry_after"), s.settled_at + seconds), else_=backoff)
    values: dict[str, ColumnElement[Any]] = {name: s[name] for name in _DEFERRED_CARRIED}
    values |= {
        "state": cast(s.next_state, job_state),
        "attempt": case((snoozed, s.attempt - _ONE), else_=s.attempt),
        "run_at": run_at,
        "finalized_at": case((snoozed, cast(null(), Timestamp)), else_=s.settled_at),
        "payload": func.nullif(s.payload, EMPTY_OBJECT, type_=JSONB),
    }
    return (
        _into(deferred, values, not_(_terminal(shaped)))
        .returning(deferred.c.job_id, deferred.c.run_at, deferred.c.attempt)
        .cte("deferred")
    )


def _unique_claims(shaped: CTE) -> list[CTE]:
    """The key's claim released or taken as the mask says for running and the next state."""
    s = shaped.c
    claims = job_unique_claims
    held = _claims(s.unique_states, _text("running"))
    wanted = _claims(s.unique_states, s.next_state)
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
        _into(claims, values, s.unique_key.is_not(None), ~held, wanted, ~mine)
        .returning(claims.c.job_id)
        .cte("claimed")
    )
    return [released, taken]


@statement
def settle_receipt() -> Select[Any]:
    """Settle one open receipt as asked (module docstring), in one statement.

    Returns one row: ``materialised`` (a callback wait made the attempt a ``leases`` row: then
    nothing was written), and, when the receipt was open and is now closed, the job id, the
    state its next row has, and for a re-schedule the new ``run_at`` and ``attempt``.
    """
    asked = _asked()
    taken = _taken(asked)
    state_rows = qs.attempt_state
    flushed = (
        delete(state_rows)
        .where(
            state_rows.c.job_id == taken.c.job_id,
            state_rows.c.run_lease == taken.c.run_lease,
            ~_is(taken, "admin_cancel"),
        )
        .returning(state_rows.c.progress)
        .cte("flushed")
    )
    shaped = _shaped(taken, flushed)
    done = _done(shaped)
    writes = [
        *_closures(shaped),
        _completion_batch(shaped),
        done,
        insert_terminal_delta(done),
        *_unique_claims(shaped),
    ]
    deferred = _deferred(shaped)
    lease = qs.leases
    materialised = exists().where(
        lease.c.job_id == asked.c.job_id, lease.c.run_lease == asked.c.run_lease
    )
    head = head_row(materialised.label("materialised"))
    written = [select(func.count()).select_from(w).scalar_subquery() for w in writes]
    answer = (
        select(
            shaped.c.job_id,
            shaped.c.next_state,
            deferred.c.run_at,
            deferred.c.attempt,
            (sum(written[1:], written[0])).label("writes"),
        )
        .select_from(shaped.outerjoin(deferred, true()))
        .subquery("answer")
    )
    a = answer.c
    return head_then(head, answer, a.job_id, a.next_state, a.run_at, a.attempt, a.writes)


class Settled(NamedTuple):
    """What :func:`settle_receipt` did."""

    materialised: bool
    """A callback wait had materialised the attempt into a ``leases`` row: nothing written."""
    job_id: int | None
    """None: the receipt was not open (settled, rescued), or no longer that attempt: Stale."""
    state: str | None
    """``completed``, ``cancelled``, ``failed``, ``retryable`` or ``scheduled``."""
    run_at: datetime | None
    attempt: int | None
    """The re-scheduled row's ``run_at`` and ``attempt``."""

    @classmethod
    def read(cls, rows: Rows) -> Settled:
        (row,) = rows
        return cls(bool(row.materialised), row.job_id, row.next_state, row.run_at, row.attempt)


def _lock_binds(items: Sequence[ReceiptItem]) -> Mapping[str, Any]:
    return rows_as_binds([{"b_job_id": i.job_id, "b_run_lease": i.run_lease} for i in items])


RECEIPT_LOCKS: Query[Sequence[ReceiptItem], None] = Query(
    lambda items: receipt_lock(batch=len(items) > 1), _lock_binds, lambda _: None
)
SETTLE_RECEIPT: Query[ReceiptItem, Settled] = Query(
    lambda _: settle_receipt(), _binds, Settled.read
)
