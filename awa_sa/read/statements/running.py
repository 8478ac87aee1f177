"""The candidates of a running attempt: a lease, an open receipt, an open compact receipt.

Candidates 3 to 5 of :mod:`awa_sa.read.statements.candidates`, read as awa-pg 0.6.9's
``load_job`` reads them: each joined to its ready row (a receipt's by its claim's priority,
as awa-pg joins it), with its ``attempt_state``; a receipt only while no closure evidence
closes it and no lease materialised it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    SmallInteger,
    and_,
    any_,
    column,
    exists,
    func,
    or_,
    select,
    true,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Select

from awa_sa.core.sql import state
from awa_sa.read.statements.candidates import (
    Tables,
    lane_match,
    of_ready,
    ready_anchor,
    row,
    with_attempt,
)


def leases_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    lease = t["leases"].alias("lease")
    ready = t["ready_entries"].alias("ready")
    attempt = t["attempt_state"].alias("attempt")
    ls, a = lease.c, attempt.c
    values = {**of_ready(ready), **with_attempt(ready.c.payload, attempt)}
    values |= {name: ls[name] for name in ("state", "priority", "attempt", "run_lease")}
    values |= {name: ls[name] for name in ("max_attempts", "deadline_at", "attempted_at")}
    values |= {"callback_id": ls.callback_id, "callback_timeout_at": ls.callback_timeout_at}
    values |= {"queue": ls.queue, "heartbeat_at": func.coalesce(a.heartbeat_at, ls.heartbeat_at)}
    joined = lease.join(
        ready, lane_match(ready, lease, ls.lane_seq) & (ready.c.priority == ls.priority)
    ).outerjoin(attempt, and_(a.job_id == ls.job_id, a.run_lease == ls.run_lease))
    return select(*row(values, ready_anchor(ready), 3)).select_from(joined).where(ls.job_id == job)


def _settled(t: Tables, job_id: Any, run_lease: Any) -> list[ColumnElement[bool]]:
    """Evidence a receipt has ended: a row of the job's next table under its lease."""
    return [
        exists().where(tab.c.job_id == job_id, tab.c.run_lease == run_lease)
        for tab in (t["done_entries"], t["deferred_jobs"], t["dlq_entries"])
    ]


def _materialised(t: Tables, job_id: Any, run_lease: Any) -> ColumnElement[bool]:
    lease = t["leases"]
    return exists().where(lease.c.job_id == job_id, lease.c.run_lease == run_lease)


def claims_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    claim = t["lease_claims"].alias("claims")
    ready = t["ready_entries"].alias("ready")
    attempt = t["attempt_state"].alias("attempt")
    c, a = claim.c, attempt.c
    closures = t["lease_claim_closures"].alias("closure")
    ranges = t["lease_claim_closure_batches"].alias("closed")
    closed = or_(
        c.closed_at.is_not(None),
        exists().where(
            closures.c.claim_slot == c.claim_slot,
            closures.c.job_id == c.job_id,
            closures.c.run_lease == c.run_lease,
        ),
        exists().where(ranges.c.receipt_ranges.op("@>")(c.receipt_id)),
        *_settled(t, c.job_id, c.run_lease),
    )
    values = {**of_ready(ready), **with_attempt(ready.c.payload, attempt)}
    values |= {"state": state("running"), "heartbeat_at": a.heartbeat_at}
    values |= {name: c[name] for name in ("priority", "attempt", "run_lease", "max_attempts")}
    values |= {"deadline_at": c.deadline_at, "attempted_at": c.claimed_at}
    joined = claim.join(
        ready, lane_match(ready, claim, c.lane_seq) & (ready.c.priority == c.priority)
    ).outerjoin(attempt, and_(a.job_id == c.job_id, a.run_lease == c.run_lease))
    return (
        select(*row(values, ready_anchor(ready), 4))
        .select_from(joined)
        .where(c.job_id == job, ~closed, ~_materialised(t, c.job_id, c.run_lease))
    )


def batch_claims_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    """The compact receipts: found from each of the job's ready rows, the claim batches of its
    ready slot and generation (``lease_claim_batches`` has no index by job), each tested for
    the job before it is expanded."""
    batch = t["lease_claim_batches"].alias("claim")
    ready = t["ready_entries"].alias("ready")
    attempt = t["attempt_state"].alias("attempt")
    b, a = batch.c, attempt.c
    items = (
        func.unnest(b.job_ids, b.run_leases, b.receipt_ids, b.lane_seqs, b.attempts, b.max_attempts)
        .table_valued(
            column("job_id", BigInteger),
            column("run_lease", BigInteger),
            column("receipt_id", BigInteger),
            column("lane_seq", BigInteger),
            column("attempt", SmallInteger),
            column("max_attempts", SmallInteger),
        )
        .render_derived(name="items")
    )
    i = items.c
    closures = t["lease_claim_closures"].alias("closure")
    ranges = t["lease_claim_closure_batches"].alias("closed")
    closed = or_(
        exists().where(
            closures.c.claim_slot == b.claim_slot,
            closures.c.job_id == i.job_id,
            closures.c.run_lease == i.run_lease,
        ),
        exists().where(
            ranges.c.claim_slot == b.claim_slot, ranges.c.receipt_ranges.op("@>")(i.receipt_id)
        ),
        _materialised(t, i.job_id, i.run_lease),
        *_settled(t, i.job_id, i.run_lease),
    )
    position = (
        select(
            b.priority,
            b.deadline_at,
            b.claimed_at,
            *(i[name] for name in ("job_id", "attempt", "run_lease", "max_attempts")),
        )
        .select_from(batch.join(items, true()))
        .where(
            b.ready_slot == ready.c.ready_slot,
            b.ready_generation == ready.c.ready_generation,
            b.queue == ready.c.queue,
            b.enqueue_shard == ready.c.enqueue_shard,
            ready.c.job_id == any_(b.job_ids),
            i.lane_seq == ready.c.lane_seq,
            i.job_id == ready.c.job_id,
            ~closed,
        )
        .lateral("position")
    )
    p = position.c
    values = {**of_ready(ready), **with_attempt(ready.c.payload, attempt)}
    values |= {"state": state("running"), "heartbeat_at": a.heartbeat_at, "priority": p.priority}
    values |= {name: p[name] for name in ("attempt", "run_lease", "max_attempts")}
    values |= {"deadline_at": p.deadline_at, "attempted_at": p.claimed_at}
    joined = ready.join(position, true()).outerjoin(
        attempt, and_(a.job_id == p.job_id, a.run_lease == p.run_lease)
    )
    return (
        select(*row(values, ready_anchor(ready), 5))
        .select_from(joined)
        .where(ready.c.job_id == job)
    )
