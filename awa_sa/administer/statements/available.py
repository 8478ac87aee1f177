"""Cancelling an available job of a queue-storage schema, in the caller's transaction.

An available job is a ``ready_entries`` row the lane's claim cursor has not passed. Awa
cancels it in place, as awa-pg 0.6.9's ``Client.cancel`` and Awa's transactional
``cancel_tx`` both write it: a ``ready_tombstones`` row (the claim skips a tombstoned lane
number), and a ``cancelled`` ``done_entries`` row of its own under the ready row's own slot,
generation, lane and number, with the ready row's columns and no payload of its own (the
ready row keeps it), and a ``+1`` terminal-count delta; before them the unique claim moves
from ``available`` to ``cancelled`` where the mask says (:func:`available_claims`). awa-pg then
moves the claim cursor past the row after its commit when the row was the lane's head;
``cancel_tx`` does not, and neither does this: a sequence cannot be rolled back with the
caller's transaction (docs/contract.md#cancel).

One thing is read that awa-pg's target does not read: whether a claim already spent the row
(its ``ready_claim_attempt_batches`` range, or a receipt or lease of the next run lease). A
claim commits before the runtime moves the cursor; awa-pg's cancel in that window tombstones a
job that is running. The flow locks the lane's ``queue_claim_heads`` row (the row every claim
locks) and then reads, so a claim either committed first, and is seen here, or waits for the
caller's commit, and then skips the tombstone.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    LargeBinary,
    Select,
    Text,
    and_,
    bindparam,
    exists,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.administer.statements.failed_retry import claims_moved
from awa_sa.core.internals import SchemaTranslatedFunction
from awa_sa.core.registry import statement
from awa_sa.core.sql import state
from awa_sa.settle.statements.duplicate import insert_terminal_delta
from awa_sa.settle.statements.receipt_writes import ONE
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.runtime import ready_tombstones

LANE = ("queue", "priority", "enqueue_shard")
LANE_ROW = ("ready_slot", "ready_generation", *LANE, "lane_seq")


class sequence_next_value(SchemaTranslatedFunction):
    """``S.sequence_next_value(seq_name)``: the number a lane sequence hands out next (a
    claim head's: the lane's claim cursor)."""

    inherit_cache = True
    name = "sequence_next_value"
    schema = qs.QS_PLACEHOLDER


def _unclaimed(ready: Any) -> ColumnElement[bool]:
    """Awa's own test of an available lane row: at or past its lane's claim cursor, and not
    tombstoned."""
    heads, tomb = qs.queue_claim_heads.c, ready_tombstones.c
    cursor = (
        select(sequence_next_value(heads.seq_name))
        .where(*(heads[n] == ready.c[n] for n in LANE))
        .scalar_subquery()
    )
    return and_(
        ready.c.lane_seq >= cursor,
        ~exists().where(*(tomb[n] == ready.c[n] for n in LANE_ROW)),
    )


def _not_spent(ready: Any) -> ColumnElement[bool]:
    """No claim spent the row: no claim-attempt range covers its number, and no receipt or
    lease of its next run lease exists (the evidence Awa's claim itself checks)."""
    batches = qs.ready_claim_attempt_batches.alias("attempts").c
    covered = exists().where(
        *(batches[n] == ready.c[n] for n in ("ready_slot", "ready_generation", *LANE)),
        batches.first_lane_seq <= ready.c.lane_seq,
        batches.next_lane_seq > ready.c.lane_seq,
        batches.lane_ranges.contains(
            func.int8range(ready.c.lane_seq, ready.c.lane_seq + ONE, literal_column("'[)'"))
        ),
    )
    following = [
        exists().where(
            table.c.job_id == ready.c.job_id, table.c.run_lease == ready.c.run_lease + ONE
        )
        for table in (qs.lease_claims.alias("receipts"), qs.leases.alias("leased"))
    ]
    return ~or_(covered, *following)


def _available(ready: Any) -> ColumnElement[bool]:
    return and_(
        ready.c.job_id == bindparam("b_job_id", type_=BigInteger),
        _unclaimed(ready),
        _not_spent(ready),
    )


@statement
def available_lane() -> Select[Any]:
    """The job's lane while it looks available, unlocked: the flow then locks the lane's claim
    head, moves the claim and cancels."""
    ready = qs.ready_entries.alias("ready")
    r = ready.c
    return (
        select(r.queue, r.priority, r.enqueue_shard)
        .where(_available(ready))
        .order_by(r.lane_seq.desc())
        .limit(ONE)
    )


@statement
def claim_head_lock() -> Select[Any]:
    """Lock the lane's claim head, the row each claim of the lane locks first (``FOR UPDATE
    ... SKIP LOCKED``): no claim of the lane runs until the caller's transaction ends."""
    heads = qs.queue_claim_heads.alias("claims")
    h = heads.c
    lane: dict[str, Any] = {
        "queue": bindparam("b_queue"),
        "priority": bindparam("b_priority"),
        "enqueue_shard": bindparam("b_shard"),
    }
    return (
        select(h.queue)
        .where(*(h[n] == value for n, value in lane.items()))
        .with_for_update(of=heads)
    )


def _target() -> CTE:
    """The job's available ready row, locked (``SKIP LOCKED``: a row another cancel holds is
    gone for this one)."""
    ready = qs.ready_entries.alias("ready")
    return (
        select(ready)
        .where(_available(ready))
        .order_by(ready.c.lane_seq.desc())
        .limit(ONE)
        .with_for_update(of=ready, skip_locked=True)
        .cte("target")
    )


@statement
def available_claims() -> Select[Any]:
    """The available job's claim as it becomes ``cancelled``, as awa-pg's ``sync_unique_claim``
    moves it before the cancelled row (``failed_retry.claims_moved``: ``taken`` short of
    ``wanted`` when another job holds the key)."""
    t = _target().c
    targets = select(t.job_id, state("available").label("state"), t.unique_key, t.unique_states)
    return claims_moved(targets.cte("targets"), ("available",), "cancelled")


@statement
def cancel_available() -> Select[Any]:
    """Tombstone the job's available ready row and file it cancelled, with its delta (its
    claim moved first: :func:`available_claims`); answers the row written with the ready
    row's payload, or no row when the job was no longer available."""
    target = _target()
    t = target.c
    tomb_columns = [*LANE_ROW, "job_id"]
    tombstone = (
        pg_insert(ready_tombstones)
        .from_select(tomb_columns, select(*(t[n] for n in tomb_columns)))
        .on_conflict_do_nothing()
        .cte("tombstone")
    )
    done = qs.done_entries
    values: dict[str, ColumnElement[Any]] = {
        "state": state("cancelled"),
        "finalized_at": func.clock_timestamp(),
        "payload": null(),
    }
    columns = [values[c.name].label(c.name) if c.name in values else t[c.name] for c in done.c]
    written = (
        insert(done)
        .from_select([c.name for c in done.c], select(*columns).select_from(target))
        .returning(*done.c)
        .cte("written")
    )
    delta = insert_terminal_delta(written)
    w = written.c
    return (
        select(*(w[c.name] for c in done.c if c.name != "payload"), t.payload)
        .select_from(written.join(delta, true()).join(target, t.job_id == w.job_id))
        .add_cte(tombstone)
    )


@statement
def unique_candidate() -> Select[Any]:
    """awa-pg 0.6.9's pick of the job to cancel by key ``b_unique_key`` on queue storage: the
    lowest id among the available lane rows, the deferred jobs and the leases' jobs with it."""
    key = bindparam("b_unique_key", type_=LargeBinary)
    ready, leases = qs.ready_entries, qs.leases
    leased = ready.alias("leased")
    candidates = union_all(
        select(ready.c.job_id).where(ready.c.unique_key == key, _unclaimed(ready)),
        select(qs.deferred_jobs.c.job_id).where(qs.deferred_jobs.c.unique_key == key),
        select(leases.c.job_id)
        .select_from(leases.join(leased, and_(*(leased.c[n] == leases.c[n] for n in LANE_ROW))))
        .where(leased.c.unique_key == key),
    ).subquery("candidates")
    return select(candidates.c.job_id).order_by(candidates.c.job_id).limit(ONE)


@statement
def drain_targets() -> Select[Any]:
    """awa-pg 0.6.9's drain of queue ``b_key`` on queue storage: the ids of its available lane
    rows, deferred jobs and callback waits (``leases`` rows ``waiting_external``), by id."""
    key = bindparam("b_key", type_=Text)
    ready, deferred, leases = qs.ready_entries, qs.deferred_jobs, qs.leases
    waiting = leases.c.state == state("waiting_external")
    ids = union_all(
        select(ready.c.job_id).where(ready.c.queue == key, _unclaimed(ready)),
        select(deferred.c.job_id).where(deferred.c.queue == key),
        select(leases.c.job_id).where(leases.c.queue == key, waiting),
    ).subquery("pending")
    return select(ids.c.job_id).order_by(ids.c.job_id)
