"""awa-pg 0.6.9's ``current_jobs``: the jobs its listing and queue overviews start from.

On queue storage awa-pg's ``list_jobs`` and ``queue_stats`` do not read a job as ``get_job``
does. They start from a union (awa-model's ``queue_storage_current_jobs_cte``) that names each
job by one row of one table, with a state of its own:

1. a ``ready_entries`` row its lane's claim cursor has not passed (at or past
   ``S.sequence_next_value`` of the lane's ``queue_claim_heads`` sequence), with no
   ``ready_tombstones`` row: ``available``;
2. a ``deferred_jobs`` row, its own state;
3. a ``leases`` row (a callback wait, or a heartbeat that materialised it) with its ready row,
   the lease's state;
4. a ``terminal_jobs`` row: a ``done_entries`` row, its state, or a compact completion's
   position not tombstoned, with its ready row: ``completed``;
5. a ``dlq_entries`` row: ``failed``.

A job claimed by a receipt (``lease_claims``, ``lease_claim_batches``) that no lease
materialised has none of these rows: 0.6.9 lists it nowhere and counts it nowhere, though
``get_job`` finds it running. awa-sa answers the same (docs/reading.md#listing).

Only what the answers read is given: ``job_id``, ``kind``, ``queue``, ``state``, ``run_at``
where the row is available (awa-pg's lag) and ``finalized_at`` where it is terminal.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, cast, column, exists, func, literal_column, null, select, union_all
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Select, Subquery

from awa_sa.core.sql import state
from awa_sa.read.statements.candidates import Tables, lane_match
from awa_sa.tables.canonical import Timestamp
from awa_sa.tables.queue_storage import sequence_next_value


def _nothing() -> ColumnElement[Any]:
    return cast(null(), Timestamp)


_COLUMNS = ("job_id", "kind", "queue", "state", "run_at", "finalized_at")


def _current(*values: Any) -> list[Any]:
    """A listing row: the values of :data:`_COLUMNS`, in that order, labelled."""
    return [value.label(name) for value, name in zip(values, _COLUMNS, strict=True)]


def available(t: Tables) -> Select[Any]:
    ready = t["ready_entries"].alias("ready")
    heads = t["queue_claim_heads"].alias("claims")
    tomb = t["ready_tombstones"].alias("tomb")
    r, h = ready.c, heads.c
    same_lane = and_(*(h[name] == r[name] for name in ("queue", "priority", "enqueue_shard")))
    buried = exists().where(*(tomb.c[name] == r[name] for name in _LANE_ROW))
    columns = _current(r.job_id, r.kind, r.queue, state("available"), r.run_at, _nothing())
    return (
        select(*columns)
        .select_from(ready.join(heads, same_lane))
        .where(r.lane_seq >= sequence_next_value(h.seq_name), ~buried)
    )


_LANE_ROW = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "lane_seq")


def deferred(t: Tables) -> Select[Any]:
    d = t["deferred_jobs"].c
    return select(*_current(d.job_id, d.kind, d.queue, d.state, _nothing(), _nothing()))


def leased(t: Tables) -> Select[Any]:
    lease = t["leases"].alias("lease")
    ready = t["ready_entries"].alias("ready")
    ls = lease.c
    joined = lease.join(
        ready, lane_match(ready, lease, ls.lane_seq) & (ready.c.priority == ls.priority)
    )
    columns = _current(ls.job_id, ready.c.kind, ls.queue, ls.state, _nothing(), _nothing())
    return select(*columns).select_from(joined)


def done(t: Tables) -> Select[Any]:
    d = t["done_entries"].c
    return select(*_current(d.job_id, d.kind, d.queue, d.state, _nothing(), d.finalized_at))


def completed(t: Tables) -> Select[Any]:
    """A compact completion's positions, as ``terminal_jobs`` expands them."""
    batch = t["receipt_completion_batches"].alias("batch")
    ready = t["ready_entries"].alias("ready")
    tomb = t["receipt_completion_tombstones"].alias("tomb")
    b, r = batch.c, ready.c
    items = (
        func.unnest(b.job_ids, b.run_leases, b.lane_seqs)
        .table_valued(column("job_id"), column("run_lease"), column("lane_seq"))
        .render_derived(name="item")
    )
    i = items.c
    joined = batch.join(items, literal_column("true")).join(
        ready,
        and_(
            r.ready_slot == b.ready_slot,
            r.ready_generation == b.ready_generation,
            r.queue == b.queue,
            r.priority == b.priority,
            r.enqueue_shard == b.enqueue_shard,
            r.lane_seq == i.lane_seq,
            r.job_id == i.job_id,
        ),
    )
    buried = exists().where(
        tomb.c.ready_slot == b.ready_slot,
        tomb.c.ready_generation == b.ready_generation,
        tomb.c.job_id == i.job_id,
        tomb.c.run_lease == i.run_lease,
    )
    columns = _current(i.job_id, r.kind, b.queue, state("completed"), _nothing(), b.finalized_at)
    return select(*columns).select_from(joined).where(~buried)


def in_dlq(t: Tables) -> Select[Any]:
    d = t["dlq_entries"].c
    return select(*_current(d.job_id, d.kind, d.queue, state("failed"), _nothing(), d.finalized_at))


def current_jobs(t: Tables) -> Subquery:
    """Every job's listing row, as awa-pg 0.6.9's ``current_jobs`` names it (one row per row
    of the tables above: a job is listed as often as they hold it)."""
    legs = (available, deferred, leased, done, completed, in_dlq)
    return union_all(*(leg(t) for leg in legs)).subquery("current_jobs")
