"""The open receipts of a queue-storage schema: its running attempts, and their evidence.

A queue-storage attempt is an open receipt of the routing schema: a ``lease_claims`` row (a
queue with a deadline), one position of a compact ``lease_claim_batches`` row (a queue without
one), or a ``leases`` row a callback wait materialised, while it is ``running``. A receipt is
open while no closure evidence names it, as Awa's own runtime enumerates them
(docs/attempts.md). Kind, args and created_at come from the job's ``ready_entries`` row, which
a claim leaves as it was. The statements reach their schema only through
``schema_translate_map``; :mod:`~awa_sa.settle.statements.listings` lists them with the canonical
attempts. :mod:`~awa_sa.settle.statements.job_receipts` reads one job's receipts by the same
evidence (``attempt_of``, and the bare-pair check of a canonical call) with these pieces.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    SmallInteger,
    Subquery,
    and_,
    cast,
    column,
    exists,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause, TableValuedAlias

from awa_sa.tables.queue_storage import (
    attempt_state,
    deferred_jobs,
    dlq_entries,
    done_entries,
    lease_claim_batches,
    lease_claim_closure_batches,
    lease_claim_closures,
    lease_claims,
    leases,
    ready_entries,
)

COLUMNS = (
    "job_id",
    "run_lease",
    "kind",
    "queue",
    "args",
    "created_at",
    "attempt",
    "max_attempts",
    "attempted_at",
    "heartbeat_at",
    "deadline_at",
    "claim_slot",
    "receipt_id",
    "claim_batch_id",
    "claim_batch_index",
)
"""What every leg selects, in this order (a UNION ALL matches columns by position)."""


def no_value(name: str, type_: Any) -> ColumnElement[Any]:
    return cast(null(), type_).label(name)


def batch_items(b: FromClause) -> TableValuedAlias:
    """A compact batch row's receipts, one row each, with its position in the batch."""
    return (
        func.unnest(
            b.c.job_ids,
            b.c.run_leases,
            b.c.receipt_ids,
            b.c.lane_seqs,
            b.c.attempts,
            b.c.max_attempts,
        )
        .table_valued(
            column("job_id", BigInteger),
            column("run_lease", BigInteger),
            column("receipt_id", BigInteger),
            column("lane_seq", BigInteger),
            column("attempt", SmallInteger),
            column("max_attempts", SmallInteger),
            with_ordinality="position",
        )
        .render_derived(name="items")
    )


SETTLED_BY = (done_entries, deferred_jobs, dlq_entries, leases)
"""The tables whose row under an attempt's ``(job_id, run_lease)`` is evidence it has ended."""


def _settled(
    job_id: ColumnElement[Any], run_lease: ColumnElement[Any]
) -> list[ColumnElement[bool]]:
    return [
        exists().where(table.c.job_id == job_id, table.c.run_lease == run_lease)
        for table in SETTLED_BY
    ]


def _closed(
    claim_slot: ColumnElement[Any],
    job_id: ColumnElement[Any],
    run_lease: ColumnElement[Any],
    receipt_id: ColumnElement[Any],
    *,
    in_slot: bool,
) -> ColumnElement[bool]:
    """Whether a receipt is closed (a materialised lease counts: it is listed from ``leases``).

    A row receipt's closure batch is found by its ``receipt_id`` alone, a compact receipt's
    within its claim slot, as Awa's runtime looks them up.
    """
    closures = lease_claim_closures.alias("closure")
    ranges = lease_claim_closure_batches.alias("closed")
    in_range = ranges.c.receipt_ranges.op("@>", return_type=Boolean)(receipt_id)
    return or_(
        exists().where(
            closures.c.claim_slot == claim_slot,
            closures.c.job_id == job_id,
            closures.c.run_lease == run_lease,
        ),
        exists().where(in_range, *([ranges.c.claim_slot == claim_slot] if in_slot else [])),
        *_settled(job_id, run_lease),
    )


def ready_of(place: Any, lane_seq: Any, job_id: Any) -> ColumnElement[bool]:
    """The job's ``ready_entries`` row, by its place in the lane (*place*: a claim's columns).

    Not by priority: a receipt records the claim's effective (aged) priority, which can differ
    from the lane's; the job id keeps two lanes' equal sequence numbers apart.
    """
    ready = ready_entries.c
    return and_(
        ready.ready_slot == place.ready_slot,
        ready.ready_generation == place.ready_generation,
        ready.queue == place.queue,
        ready.enqueue_shard == place.enqueue_shard,
        ready.lane_seq == lane_seq,
        ready.job_id == job_id,
    )


def heartbeat(
    job_id: ColumnElement[Any], run_lease: ColumnElement[Any], fallback: ColumnElement[Any]
) -> ColumnElement[Any]:
    beat = (
        select(attempt_state.c.heartbeat_at)
        .where(attempt_state.c.job_id == job_id, attempt_state.c.run_lease == run_lease)
        .scalar_subquery()
    )
    return func.coalesce(beat, fallback).label("heartbeat_at")


@cache
def open_receipts() -> Subquery:
    """Every open receipt of one queue-storage schema, one row each, in :data:`COLUMNS`.

    One leg per source, each joined to ``ready_entries`` and checked against the closure
    evidence, which PostgreSQL can hash over every receipt at once; each leg's evidence is
    exactly the runtime's. On a new cluster its estimate is over ``jit_above_cost`` all the
    same (some 219,000: every batch unnested, by the planner's default guesses), which is why
    an Engine's listing turns JIT off (:mod:`awa_sa.settle.running`); a single union of the sources,
    checked once, took 2.4 s on empty tables with JIT on. The receipts of one job are read by
    :mod:`~awa_sa.settle.statements.job_receipts` instead.
    """
    ready = ready_entries
    c = lease_claims.alias("claim")
    row_receipts = (
        select(
            c.c.job_id,
            c.c.run_lease,
            ready.c.kind,
            c.c.queue,
            ready.c.args,
            ready.c.created_at,
            c.c.attempt,
            c.c.max_attempts,
            c.c.claimed_at.label("attempted_at"),
            heartbeat(c.c.job_id, c.c.run_lease, c.c.claimed_at),
            c.c.deadline_at,
            c.c.claim_slot,
            c.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
        )
        .select_from(
            c.join(
                ready,
                ready_of(c.c, c.c.lane_seq, c.c.job_id),
            )
        )
        .where(
            c.c.closed_at.is_(None),
            ~_closed(c.c.claim_slot, c.c.job_id, c.c.run_lease, c.c.receipt_id, in_slot=False),
        )
    )

    b = lease_claim_batches.alias("batch")
    items = batch_items(b)
    i = items.c
    compact_receipts = (
        select(
            i.job_id,
            i.run_lease,
            ready.c.kind,
            b.c.queue,
            ready.c.args,
            ready.c.created_at,
            i.attempt,
            i.max_attempts,
            b.c.claimed_at.label("attempted_at"),
            heartbeat(i.job_id, i.run_lease, b.c.claimed_at),
            b.c.deadline_at,
            b.c.claim_slot,
            i.receipt_id,
            b.c.batch_id.label("claim_batch_id"),
            cast(i.position, Integer).label("claim_batch_index"),
        )
        .select_from(
            b.join(items, true()).join(
                ready,
                ready_of(b.c, i.lane_seq, i.job_id),
            )
        )
        .where(~_closed(b.c.claim_slot, i.job_id, i.run_lease, i.receipt_id, in_slot=True))
    )

    lease = leases
    receipt = lease_claims.alias("receipt")
    materialised = (
        select(
            lease.c.job_id,
            lease.c.run_lease,
            ready.c.kind,
            lease.c.queue,
            ready.c.args,
            ready.c.created_at,
            lease.c.attempt,
            lease.c.max_attempts,
            lease.c.attempted_at,
            heartbeat(lease.c.job_id, lease.c.run_lease, lease.c.heartbeat_at),
            lease.c.deadline_at,
            receipt.c.claim_slot,
            receipt.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
        )
        .select_from(
            lease.join(
                ready,
                ready_of(lease.c, lease.c.lane_seq, lease.c.job_id),
            ).outerjoin(
                receipt,
                and_(
                    receipt.c.job_id == lease.c.job_id,
                    receipt.c.run_lease == lease.c.run_lease,
                ),
            )
        )
        .where(lease.c.state == literal_column("'running'"))
    )
    return union_all(row_receipts, compact_receipts, materialised).subquery("attempts")
