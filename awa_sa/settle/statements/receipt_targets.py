"""Which receipt a queue-storage settle closes, and what it makes of it.

The caller's parameters as one row (:class:`ReceiptItem`, :func:`asked_row`), and
:func:`open_receipt`: the receipt exactly as named (a ``lease_claims`` row, locked; or one
position of a compact ``lease_claim_batches`` row, which only ``cancel_job`` closes: ``settle``
refuses it), taken only while no closure evidence of the six kinds the runtime anti-joins names
it and no materialised lease holds it (docs/contract.md#receipts), or the running lease a
callback materialised it into, deleted (:mod:`~awa_sa.settle.statements.lease_targets`),
joined to the job's ``ready_entries`` row and checked against the caller's kind, queue and
attempt; with the state the job goes to, whether a completion takes the runtime's compact
path, the claim time it carries and the settle's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    Boolean,
    ColumnElement,
    Double,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    false,
    func,
    literal_column,
    not_,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from awa_sa.core.sql import (
    EMPTY_ARRAY,
    EMPTY_OBJECT,
)
from awa_sa.tables import queue_storage as qs

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


COMPACT_METADATA_KEYS = ("_awa_original_priority", "_awa_original_queue")
"""The metadata keys a bare job's completion may carry and still take the compact path."""


class ReceiptItem(NamedTuple):
    """The parameters of one queue-storage attempt's settle."""

    job_id: int
    run_lease: int
    claim_slot: int
    receipt_id: int
    batch_id: int | None
    """The compact receipt's ``lease_claim_batches`` row, or None for a ``lease_claims`` row.
    Only ``cancel_job``'s ``admin_cancel`` names a compact receipt: ``settle`` refuses one."""
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
    ready_slot: int | None = None
    """The receipt's ready slot where the caller found it (``attempt_of``), or None: bound so
    that PostgreSQL reads only that slot's partitions (:data:`SettleShape` ``row_in_slot``)."""


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


SettleShape = Literal["row", "row_in_slot", "compact", "lease"]
"""The settle's statement for a receipt: a ``lease_claims`` row, the same with its ready slot
known (every table keyed by ready slot read in that slot only), a compact receipt (a
``lease_claim_batches`` position: ``cancel_job``'s alone), or a ``lease_claims`` receipt that
``register_callback`` materialised into a running ``leases`` row (the settle's second statement,
once the first found the lease: :mod:`~awa_sa.settle.statements.lease_targets`)."""


def shape_of(item: ReceiptItem) -> SettleShape:
    if item.batch_id is not None:
        return "compact"
    return "row" if item.ready_slot is None else "row_in_slot"


def binds(item: ReceiptItem) -> Mapping[str, Any]:
    values = dict(zip((bind for bind, _, _ in _FIELDS), item, strict=False))
    values["b_ready_slot"] = item.ready_slot
    return values


def claim_slot_bind() -> ColumnElement[Any]:
    """The asked claim slot as the statement's own parameter, not read through ``asked``: a
    partition key PostgreSQL prunes by when it plans (custom plan) or starts (generic plan)."""
    return cast(bindparam("b_claim_slot", type_=Integer), Integer)


def ready_slot_bind() -> ColumnElement[Any]:
    """The asked ready slot, likewise (the ``row_in_slot`` shape only)."""
    return cast(bindparam("b_ready_slot", type_=Integer), Integer)


def asked_row() -> CTE:
    row = [cast(bindparam(b, type_=t), t).label(c) for b, c, t in _FIELDS]
    return select(*row).cte("asked")


def text_literal(value: str) -> ColumnElement[Any]:
    return literal_column(f"'{value}'", Text)


def tagged(row: Any, *tags: ReceiptTag) -> ColumnElement[bool]:
    tagged: ColumnElement[bool] = row.c.tag.in_([text_literal(tag) for tag in tags])
    return tagged


def json_key(document: ColumnElement[Any], key: str, empty: ColumnElement[Any]) -> Any:
    """``document -> 'key'``, or *empty* where it is missing."""
    value = document.op("->", return_type=JSONB)(text_literal(key))
    return func.coalesce(value, empty, type_=JSONB)


def _evidence(
    claim_slot: Any, job_id: Any, run_lease: Any, receipt_id: Any, ready_slot: Any
) -> list[ColumnElement[bool]]:
    """No closure evidence names the receipt: the six kinds the runtime anti-joins, the closure
    row and closure batch in the receipt's claim slot (where the runtime writes them, and where
    its fast completion looks), ``done_entries`` in its ready slot where known. A materialised
    lease (a callback wait's) is the head's check, read once (see :class:`Settled`)."""
    closures = qs.lease_claim_closures.alias("closure")
    ranges = qs.lease_claim_closure_batches.alias("closed")
    in_range = ranges.c.receipt_ranges.op("@>", return_type=Boolean)(receipt_id)
    done = qs.done_entries
    found = [
        exists().where(
            closures.c.claim_slot == claim_slot,
            closures.c.job_id == job_id,
            closures.c.run_lease == run_lease,
        ),
        exists().where(in_range, ranges.c.claim_slot == claim_slot),
        exists().where(
            done.c.job_id == job_id,
            done.c.run_lease == run_lease,
            *([] if ready_slot is None else [done.c.ready_slot == ready_slot]),
        ),
    ]
    for table in (qs.deferred_jobs, qs.dlq_entries):
        found.append(exists().where(table.c.job_id == job_id, table.c.run_lease == run_lease))
    return [not_(evidence) for evidence in found]


def _row_target(asked: CTE, free: ColumnElement[bool], ready_slot: Any) -> Select[Any]:
    claims = qs.lease_claims.alias("claims")
    c = claims.c
    slot = claim_slot_bind()
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
                c.claim_slot == slot,
                c.claim_slot == asked.c.claim_slot,
                c.job_id == asked.c.job_id,
                c.run_lease == asked.c.run_lease,
                c.receipt_id == asked.c.receipt_id,
                asked.c.batch_id.is_(None),
            ),
        )
        .where(
            c.closed_at.is_(None),
            free,
            *(() if ready_slot is None else (c.ready_slot == ready_slot,)),
            *_evidence(slot, c.job_id, c.run_lease, c.receipt_id, ready_slot),
        )
        .with_for_update(of=claims)
    )


def _batch_target(asked: CTE, free: ColumnElement[bool]) -> Select[Any]:
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
            free,
            *_evidence(b.claim_slot, asked.c.job_id, asked.c.run_lease, asked.c.receipt_id, None),
        )
        # Not locked: the batch row is append-only and holds its siblings' receipts too, whose
        # settles by the runtime's slow path lock it; the receipt's advisory lock already
        # serialises every settle of this attempt.
    )


def _claim_time(
    target: Any, lane_priority: ColumnElement[Any], ready_slot: Any
) -> ColumnElement[Any]:
    """The ``attempted_at`` a completion writes: the job row a claim returns carries the claim's
    own clock (kept in ``ready_claim_attempt_batches``; the receipt's ``claimed_at`` is a later
    one). Only a ``lease_claims`` receipt is completed: a compact one is refused before any
    statement (``CompactReceipt``)."""
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
            # Within [first_lane_seq, next_lane_seq), which holds every range of lane_ranges:
            # the lane index finds the claim's batches, not every batch of its claim slot.
            c.first_lane_seq <= target.lane_seq,
            c.next_lane_seq > target.lane_seq,
            c.lane_ranges.op("@>", return_type=Boolean)(lane_seq),
            *(() if ready_slot is None else (c.ready_slot == ready_slot,)),
        )
        .scalar_subquery()
    )
    return func.coalesce(claimed, target.attempted_at)


def open_receipt(
    asked: CTE, free: ColumnElement[bool], shape: SettleShape, lease: CTE | None = None
) -> CTE:
    """The open receipt, its ready row, and what the settle makes of it, guarded by identity.

    *free*: no materialised lease holds the attempt (the head's check, read once). The
    *shape* names the one source the receipt can be in (:data:`SettleShape`); the ``lease``
    shape's is *lease*, the deleted lease in a receipt's row shape
    (:func:`~awa_sa.settle.statements.lease_targets.lease_target`).
    """
    ready_slot = ready_slot_bind() if shape == "row_in_slot" else None
    if lease is not None:
        target = lease
    elif shape == "compact":
        target = _batch_target(asked, free).cte("target")
    else:
        target = _row_target(asked, free, ready_slot).cte("target")
    ready = qs.ready_entries
    t, r = target.c, ready.c
    payload = func.coalesce(r.payload, EMPTY_OBJECT, type_=JSONB)
    exhausted = t.attempt >= t.max_attempts
    next_state = case(
        (tagged(asked, "complete"), text_literal("completed")),
        (tagged(asked, "cancel", "admin_cancel"), text_literal("cancelled")),
        (tagged(asked, "fail_terminal"), text_literal("failed")),
        (tagged(asked, "fail") & exhausted, text_literal("failed")),
        (tagged(asked, "snooze"), text_literal("scheduled")),
        else_=text_literal("retryable"),
    )
    metadata = json_key(payload, "metadata", EMPTY_OBJECT)
    compact_metadata = metadata.op("-", return_type=JSONB)(
        cast(literal_column(f"'{{{','.join(COMPACT_METADATA_KEYS)}}}'"), ARRAY(Text))
    )
    bare = and_(
        r.unique_key.is_(None),
        json_key(payload, "tags", EMPTY_ARRAY) == EMPTY_ARRAY,
        json_key(payload, "errors", EMPTY_ARRAY) == EMPTY_ARRAY,
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
            # The lane's own priority: a claim aged the receipt's (``claims.priority``) below it.
            r.priority.label("lane_priority"),
            payload.label("ready_payload"),
            next_state.label("next_state"),
            # A lease's completion never takes the compact path: the runtime's anti-joins it.
            (false() if shape == "lease" else tagged(asked, "complete") & bare).label("fast"),
            case(
                (tagged(asked, "complete"), _claim_time(t, r.priority, ready_slot)),
                else_=t.attempted_at,
            ).label("ended_attempted_at"),
            func.clock_timestamp().label("settled_at"),
            *(asked.c[name] for name in ("tag", "message", "error", "new_progress", "delay")),
        )
        .select_from(target)
        .join(
            ready,
            and_(
                r.ready_slot == t.ready_slot,
                *(() if ready_slot is None else (r.ready_slot == ready_slot,)),
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
