"""The open receipts of a queue-storage schema: its running attempts, and the bare-pair check.

A queue-storage attempt is an open receipt of the routing schema: a ``lease_claims`` row (a
queue with a deadline), one position of a compact ``lease_claim_batches`` row (a queue without
one), or a ``leases`` row a callback wait materialised, while it is ``running``. A receipt is
open while no closure evidence names it, as Awa's own runtime enumerates them
(docs/attempts.md). Kind, args and created_at come from the job's ``ready_entries`` row, which
a claim leaves as it was. The statements reach their schema only through
``schema_translate_map``; :mod:`~awa_sa.statements.listings` lists them with the canonical
attempts, and :func:`open_claims` checks a canonical call's bare pairs against them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    Select,
    SmallInteger,
    Subquery,
    and_,
    bindparam,
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
from sqlalchemy.dialects.postgresql import array
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.queue_storage import (
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
from awa_sa.statements.registry import Query, statement
from awa_sa.statements.sql import bound_rows, rows_as_binds
from awa_sa.tables import jobs_hot

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


def _settled(
    job_id: ColumnElement[Any], run_lease: ColumnElement[Any]
) -> list[ColumnElement[bool]]:
    """Evidence under the attempt's ``(job_id, run_lease)`` that it has ended."""
    return [
        exists().where(table.c.job_id == job_id, table.c.run_lease == run_lease)
        for table in (done_entries, deferred_jobs, dlq_entries, leases)
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


def _ready_of(place: Any, lane_seq: Any, job_id: Any) -> ColumnElement[bool]:
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


def _heartbeat(
    job_id: ColumnElement[Any], run_lease: ColumnElement[Any], fallback: ColumnElement[Any]
) -> ColumnElement[Any]:
    beat = (
        select(attempt_state.c.heartbeat_at)
        .where(attempt_state.c.job_id == job_id, attempt_state.c.run_lease == run_lease)
        .scalar_subquery()
    )
    return func.coalesce(beat, fallback).label("heartbeat_at")


@cache
def open_receipts(*, job_id: str | None = None) -> Subquery:
    """Every open receipt of one queue-storage schema, one row each, in :data:`COLUMNS`.

    *job_id* names a ``BIGINT`` bind: then each leg reads only that job's receipts, before
    anything is joined (a compact batch by ``job_ids @> ARRAY[job_id]`` before it is
    unnested), so an identity lookup stays a small plan on a cluster with thousands of
    settled receipts; without it, the estimate of unnesting every batch had PostgreSQL
    JIT-compile the plan, half a second a call. One leg per source keeps each leg's evidence
    exactly the runtime's, and its cost low enough that PostgreSQL does not JIT it on a fresh
    cluster (a single union of the sources, checked once, did: 2.4 s on empty tables).
    """
    job = None if job_id is None else cast(bindparam(job_id, type_=BigInteger), BigInteger)
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
            _heartbeat(c.c.job_id, c.c.run_lease, c.c.claimed_at),
            c.c.deadline_at,
            c.c.claim_slot,
            c.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
        )
        .select_from(
            c.join(
                ready,
                _ready_of(c.c, c.c.lane_seq, c.c.job_id),
            )
        )
        .where(
            c.c.closed_at.is_(None),
            *([] if job is None else [c.c.job_id == job]),
            ~_closed(c.c.claim_slot, c.c.job_id, c.c.run_lease, c.c.receipt_id, in_slot=False),
        )
    )

    b = lease_claim_batches.alias("batch")
    items = (
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
            _heartbeat(i.job_id, i.run_lease, b.c.claimed_at),
            b.c.deadline_at,
            b.c.claim_slot,
            i.receipt_id,
            b.c.batch_id.label("claim_batch_id"),
            cast(i.position, Integer).label("claim_batch_index"),
        )
        .select_from(
            b.join(items, true()).join(
                ready,
                _ready_of(b.c, i.lane_seq, i.job_id),
            )
        )
        .where(
            *(
                []
                if job is None
                else [b.c.job_ids.op("@>", return_type=Boolean)(array([job])), i.job_id == job]
            ),
            ~_closed(b.c.claim_slot, i.job_id, i.run_lease, i.receipt_id, in_slot=True),
        )
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
            _heartbeat(lease.c.job_id, lease.c.run_lease, lease.c.heartbeat_at),
            lease.c.deadline_at,
            receipt.c.claim_slot,
            receipt.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
        )
        .select_from(
            lease.join(
                ready,
                _ready_of(lease.c, lease.c.lane_seq, lease.c.job_id),
            ).outerjoin(
                receipt,
                and_(
                    receipt.c.job_id == lease.c.job_id,
                    receipt.c.run_lease == lease.c.run_lease,
                ),
            )
        )
        .where(
            lease.c.state == literal_column("'running'"),
            *([] if job is None else [lease.c.job_id == job]),
        )
    )
    return union_all(row_receipts, compact_receipts, materialised).subquery("attempts")


@statement
def open_claims(*, batch: bool) -> Select[Any]:
    """The asked ``(job_id, run_lease)`` pairs that name an open claim of the schema, each
    with whether a running canonical row has that pair too.

    What a canonical call checks in the queue-storage branch before it takes anything: there
    the two planes' pairs collide, and a bare pair that also names a queue-storage claim may
    not mean the canonical row (docs/contract.md#bare-pair).
    """
    attempts = open_receipts(job_id=None if batch else _PAIR[0])
    a = attempts.c
    hot = jobs_hot.c
    canonical_too = exists().where(
        hot.id == a.job_id, hot.run_lease == a.run_lease, hot.state == literal_column("'running'")
    )
    claimed = select(a.job_id, a.run_lease, canonical_too.label("canonical_too")).distinct()
    if not batch:
        job_id, lease = (cast(bindparam(n, type_=BigInteger), BigInteger) for n in _PAIR)
        return claimed.where(a.job_id == job_id, a.run_lease == lease)
    fields = [(_PAIR[0], "job_id", BigInteger), (_PAIR[1], "lease", BigInteger)]
    asked = bound_rows("asked", fields, batch)
    return claimed.join_from(
        attempts, asked, and_(a.job_id == asked.c.job_id, a.run_lease == asked.c.lease)
    )


_PAIR = ("guard_id", "guard_lease")


class Pair(Protocol):
    """What names a claim: every attempt's parameters have it."""

    @property
    def job_id(self) -> int: ...
    @property
    def run_lease(self) -> int: ...


def _pair_binds(items: Sequence[Pair]) -> Mapping[str, Any]:
    return rows_as_binds([dict(zip(_PAIR, (i.job_id, i.run_lease), strict=True)) for i in items])


OPEN_CLAIMS: Query[Sequence[Pair], dict[tuple[int, int], bool]] = Query(
    lambda items: open_claims(batch=len(items) > 1),
    _pair_binds,
    lambda rows: {(row.job_id, row.run_lease): bool(row.canonical_too) for row in rows},
)
"""The asked pairs an open claim of the schema holds: pair -> whether canonical has it too."""
