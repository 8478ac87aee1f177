"""The open receipts of named jobs: ``attempt_of``'s lookup and the bare-pair check.

The receipts are those of :func:`~awa_sa.settle.statements.receipts.open_receipts`, by the same
evidence; only the shape differs, because these statements run on a service's main path (an
awa-pg handler's ``attempt_of``, a canonical call's bare-pair check) and nearly all of their
cost is PostgreSQL planning them, not running them. Every source and every piece of evidence is
a partitioned table (8 or 16 partitions each), and the planner works per partition: with one
leg per source, each joined to ``ready_entries`` and checked against six kinds of evidence, a
lookup named some 170 partitions and cost about 10 ms of the server's CPU a call on a warm
backend (about 30 on a new one), under 1 ms of it running the plan. Here the sources are
filtered by the job first and unioned, the union is checked against the evidence once, in one
subquery that PostgreSQL plans once and probes per receipt (a set operation, which it neither
pulls up into a join nor hashes), and joined to ``ready_entries`` once: about half the
partitions, and under half the CPU (docs/performance.md#open-receipts). A subquery probed per
receipt suits a job's few receipts; the listing of every receipt keeps the legs that let
PostgreSQL hash the evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import array
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause

from awa_sa.core.registry import Query, statement
from awa_sa.core.sql import bound_rows, rows_as_binds
from awa_sa.settle.statements.receipts import (
    SETTLED_BY,
    batch_items,
    heartbeat,
    no_value,
    ready_of,
)
from awa_sa.tables.canonical import Timestamp, jobs_hot
from awa_sa.tables.queue_storage import (
    lease_claim_batches,
    lease_claim_closure_batches,
    lease_claim_closures,
    lease_claims,
    leases,
    ready_entries,
)

PLACE = ("ready_slot", "ready_generation", "enqueue_shard", "lane_seq")
"""Where a receipt's job sits in its lane, beside its queue: what finds its ``ready_entries``
row."""


def _claims(job: ColumnElement[Any], outer: tuple[FromClause, ...]) -> Select[Any]:
    """The job's row and compact receipts that no evidence closes, with their places."""
    c = lease_claims.alias("claim")
    rows = (
        select(
            c.c.job_id,
            c.c.run_lease,
            c.c.queue,
            c.c.attempt,
            c.c.max_attempts,
            c.c.claimed_at.label("attempted_at"),
            c.c.claimed_at.label("beat_since"),
            c.c.deadline_at,
            c.c.claim_slot,
            c.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
            *(c.c[name] for name in PLACE),
        )
        .where(c.c.closed_at.is_(None), c.c.job_id == job)
        .correlate(*outer)
    )
    b = lease_claim_batches.alias("batch")
    items = batch_items(b)
    i = items.c
    compact = (
        select(
            i.job_id,
            i.run_lease,
            b.c.queue,
            i.attempt,
            i.max_attempts,
            b.c.claimed_at.label("attempted_at"),
            b.c.claimed_at.label("beat_since"),
            b.c.deadline_at,
            b.c.claim_slot,
            i.receipt_id,
            b.c.batch_id.label("claim_batch_id"),
            cast(i.position, Integer).label("claim_batch_index"),
            b.c.ready_slot,
            b.c.ready_generation,
            b.c.enqueue_shard,
            i.lane_seq,
        )
        .select_from(b.join(items, true()))
        .where(b.c.job_ids.op("@>", return_type=Boolean)(array([job])), i.job_id == job)
        .correlate(*outer)
    )
    claims = union_all(rows, compact).subquery("claims")
    return select(claims).where(~_closed(claims.c))


def _closed(claim: Any) -> ColumnElement[bool]:
    """Whether any evidence closes the receipt *claim*: one subquery over every kind.

    A row receipt's closure batch is found by its ``receipt_id`` alone, a compact receipt's
    within its claim slot, as Awa's runtime looks them up.
    """
    one: ColumnElement[Any] = literal_column("1")
    closures = lease_claim_closures.alias("closure")
    ranges = lease_claim_closure_batches.alias("closed")
    in_range = ranges.c.receipt_ranges.op("@>", return_type=Boolean)(claim.receipt_id)
    by_pair = [
        select(one).where(table.c.job_id == claim.job_id, table.c.run_lease == claim.run_lease)
        for table in SETTLED_BY
    ]
    return exists(
        union_all(
            select(one).where(
                closures.c.claim_slot == claim.claim_slot,
                closures.c.job_id == claim.job_id,
                closures.c.run_lease == claim.run_lease,
            ),
            select(one).where(
                in_range,
                or_(claim.claim_batch_id.is_(None), ranges.c.claim_slot == claim.claim_slot),
            ),
            *by_pair,
        )
    )


def receipts_of(job: ColumnElement[Any], *outer: FromClause) -> Select[Any]:
    """The open receipts of the job *job* names (a bind, or a column of the *outer* row of a
    lateral join), one row each in :data:`~awa_sa.settle.statements.receipts.COLUMNS`.

    A receipt a callback wait materialised is listed from its running ``leases`` row, which no
    evidence is checked against; that lease is itself evidence closing the job's
    ``lease_claims`` row, so the receipt is listed once.
    """
    lease = leases
    receipt = lease_claims.alias("receipt")
    materialised = (
        select(
            lease.c.job_id,
            lease.c.run_lease,
            lease.c.queue,
            lease.c.attempt,
            lease.c.max_attempts,
            lease.c.attempted_at,
            lease.c.heartbeat_at.label("beat_since"),
            lease.c.deadline_at,
            receipt.c.claim_slot,
            receipt.c.receipt_id,
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
            *(lease.c[name] for name in PLACE),
        )
        .select_from(
            lease.outerjoin(
                receipt,
                and_(
                    receipt.c.job_id == lease.c.job_id,
                    receipt.c.run_lease == lease.c.run_lease,
                ),
            )
        )
        .where(lease.c.state == literal_column("'running'"), lease.c.job_id == job)
        .correlate(*outer)
    )
    found = union_all(_claims(job, outer), materialised).subquery("receipts")
    f = found.c
    ready = ready_entries.c
    return select(
        f.job_id,
        f.run_lease,
        ready.kind,
        f.queue,
        ready.args,
        ready.created_at,
        f.attempt,
        f.max_attempts,
        f.attempted_at,
        heartbeat(f.job_id, f.run_lease, f.beat_since),
        f.deadline_at,
        f.claim_slot,
        f.receipt_id,
        f.claim_batch_id,
        f.claim_batch_index,
    ).select_from(found.join(ready_entries, ready_of(f, f.lane_seq, f.job_id)))


@statement
def open_claims(*, batch: bool) -> Select[Any]:
    """The asked ``(job_id, run_lease)`` pairs that name an open claim of the schema, each
    with whether a running canonical row has that pair too.

    What a canonical call checks in the queue-storage branch before it takes anything: there
    the two planes' pairs collide, and a bare pair that also names a queue-storage claim may
    not mean the canonical row (docs/contract.md#bare-pair). A batch reads each asked job's
    receipts (a lateral :func:`receipts_of` per asked pair), never every receipt.
    """
    attempts: FromClause
    if batch:
        fields = [(_PAIR[0], "job_id", BigInteger), (_PAIR[1], "lease", BigInteger)]
        asked = bound_rows("asked", fields, batch)
        lease = asked.c.lease
        attempts = receipts_of(asked.c.job_id, asked).lateral("attempts")
    else:
        job, lease = (cast(bindparam(n, type_=BigInteger), BigInteger) for n in _PAIR)
        attempts = receipts_of(job).subquery("attempts")
    a = attempts.c
    hot = jobs_hot.c
    canonical_too = exists().where(
        hot.id == a.job_id, hot.run_lease == a.run_lease, hot.state == literal_column("'running'")
    )
    claimed = select(a.job_id, a.run_lease, canonical_too.label("canonical_too")).distinct()
    if not batch:
        return claimed.where(a.run_lease == lease)
    return claimed.select_from(asked.join(attempts, a.run_lease == lease))


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


LOOKUP_BINDS = ("b_job_id", "b_attempt", "b_queue", "b_kind", "b_created_at")
"""The binds of :func:`claim_of_job`: the job's identity, every part of it required."""


@statement
def claim_of_job() -> Select[Any]:
    """``attempt_of``'s lookup on queue storage: the job's open ``lease_claims`` receipt, found
    by the job's identity alone (id, attempt and queue on the receipt, kind and ``created_at`` on
    its ``ready_entries`` row), each column of :data:`~awa_sa.settle.statements.receipts.COLUMNS`,
    ``running_for``, and the receipt's ``ready_slot``, which the settle binds so that PostgreSQL
    reads only that slot's partitions.

    The receipt is open as the runtime's own fast completion fences it: no ``closed_at``, no
    closure row and no closure batch holding its ``receipt_id``, both looked up in the receipt's
    claim slot only (the runtime's non-success paths write a closure before they move a job to
    ``done_entries``, ``deferred_jobs`` or the DLQ, so those ledgers are not probed here; the
    settle checks every kind again under the receipt's lock and answers ``Stale``). A receipt a
    callback wait materialised (``materialized_at``) and a compact receipt are not found here:
    ``attempt_of`` then reads :func:`receipts_of`'s listing, as before.

    Every parameter is required and compared for equality, so PostgreSQL's generic plan costs
    what a custom one does and is kept; the claim slot and ready slot come from the receipt row,
    so each evidence table and ``ready_entries`` is probed in one partition only (run-time
    pruning), and nothing read grows with the cluster's finished jobs.
    """
    c = lease_claims.alias("claim")
    r = ready_entries.alias("ready_row")
    one: ColumnElement[Any] = literal_column("1")
    closures = lease_claim_closures.alias("closure")
    ranges = lease_claim_closure_batches.alias("closed")
    types: tuple[Any, ...] = (BigInteger, SmallInteger, Text, Text, Timestamp)
    job, attempt, queue, kind, created_at = (
        cast(bindparam(name, type_=type_), type_)
        for name, type_ in zip(LOOKUP_BINDS, types, strict=True)
    )
    # OFFSET 0: PostgreSQL keeps each NOT EXISTS a subplan probed with the receipt's own claim
    # slot (one partition, pruned as it runs) rather than an anti-join it may hash over every
    # partition's rows of the job.
    closure = (
        select(one)
        .where(
            closures.c.claim_slot == c.c.claim_slot,
            closures.c.job_id == c.c.job_id,
            closures.c.run_lease == c.c.run_lease,
        )
        .offset(literal_column("0"))
    )
    closure_batch = (
        select(one)
        .where(
            ranges.c.claim_slot == c.c.claim_slot,
            ranges.c.receipt_ranges.op("@>", return_type=Boolean)(c.c.receipt_id),
        )
        .offset(literal_column("0"))
    )
    # Its ready row as a lateral subquery (LIMIT 1: never pulled up into a join the planner could
    # hash over every ``ready_entries`` partition): probed by the receipt's slot and lane place.
    ready = (
        select(r.c.kind, r.c.args, r.c.created_at)
        .where(
            r.c.ready_slot == c.c.ready_slot,
            r.c.ready_generation == c.c.ready_generation,
            r.c.queue == c.c.queue,
            r.c.enqueue_shard == c.c.enqueue_shard,
            r.c.lane_seq == c.c.lane_seq,
            r.c.job_id == c.c.job_id,
        )
        .limit(literal_column("1"))
        .lateral("ready")
    )
    return (
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
            (func.now() - c.c.claimed_at).label("running_for"),
            c.c.ready_slot,
        )
        .select_from(c.join(ready, true()))
        .where(
            c.c.job_id == job,
            c.c.attempt == attempt,
            c.c.queue == queue,
            c.c.closed_at.is_(None),
            c.c.materialized_at.is_(None),
            ready.c.kind == kind,
            ready.c.created_at == created_at,
            ~exists(closure),
            ~exists(closure_batch),
        )
    )
