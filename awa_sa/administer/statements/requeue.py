"""A job enqueued again on queue storage under its own id, as awa-pg 0.6.9's retries write it.

Every path of awa-pg that takes a job back to work without a new id (a retry of a failed or
cancelled job, of a callback wait, ``retry_external``, a DLQ retry) ends in the same insert of
existing rows: per lane, the next numbers reserved by the schema's own ``S.reserve_enqueue_seq``
(which holds the lane's reservation lock to the end of the transaction), the ready rows at the
ring cursor with ``attempt = 0`` and ``run_at`` now, their ``ready_segments`` entries, and one
NOTIFY per queue. This is that insert as CTEs, for a statement that first produces the rows.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Integer,
    SmallInteger,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    func,
    insert,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.sql import EMPTY_OBJECT, SHARD0
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp
from awa_sa.tables.runtime import ready_segments

SEGMENT_KEY = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard")


def enqueued_again(
    proj: CTE,
    *,
    attempted: bool = False,
    order: str = "job_id",
    one_insert: bool = False,
    sharded: bool = False,
) -> tuple[CTE, list[CTE], Any]:
    """Each job of *proj* enqueued again on its lane at the ring cursor (``b_ready_slot``,
    ...), ``attempt = 0`` and ``run_at`` now, under its own id and run lease: the new ready
    rows, the CTEs that write their segments, and the count of queues told (their NOTIFYs).
    ``attempted_at`` is NULL, or with *attempted* the one of *proj* (awa-pg's
    ``retry_external`` keeps the wait's). The lane's shard is 0, or with *sharded* the one
    bound for the job (``b_shard_ids`` with ``b_shards``; 0 for a job not named there).

    The lane numbers follow the jobs' ids, or *order* (the name of a column of *proj*).
    awa-pg's retries go job by job: a clock and a segment per job, each queue told when its
    first job (by id) is written. With *one_insert*, as awa-pg's DLQ retry writes all its rows
    in one insert: one clock for every row, one segment per lane, the queues told in name
    order (its sorted set of channels)."""
    if sharded:
        proj = _placed(proj)
    shard = proj.c.enqueue_shard if sharded else SHARD0
    lane = [proj.c.queue, proj.c.priority, *([shard] if sharded else [])]
    lanes_cte = select(*lane, func.count().label("n")).group_by(*lane).cte("lanes")
    lane_shard = lanes_cte.c.enqueue_shard if sharded else SHARD0
    first = qs.reserve_enqueue_seq(
        lanes_cte.c.queue, lanes_cte.c.priority, lane_shard, lanes_cte.c.n
    )
    reserved = (
        select(
            *(lanes_cte.c[c.name] for c in lane),
            cast(first, BigInteger).label("first_seq"),
        )
        .cte("reserved")
        .prefix_with("MATERIALIZED")
    )
    ready = qs.ready_entries
    numbered = func.row_number().over(partition_by=lane, order_by=proj.c[order])
    now = select(func.clock_timestamp()).scalar_subquery() if one_insert else func.clock_timestamp()
    payload = case((proj.c.payload == EMPTY_OBJECT, None), else_=proj.c.payload)
    values: dict[str, ColumnElement[Any]] = {
        "ready_slot": cast(bindparam("b_ready_slot", type_=Integer), Integer),
        "ready_generation": bindparam("b_ready_generation", type_=BigInteger),
        "job_id": proj.c.job_id,
        "kind": proj.c.kind,
        "queue": proj.c.queue,
        "args": proj.c.args,
        "priority": proj.c.priority,
        "attempt": cast(literal_column("0"), SmallInteger),
        "run_lease": proj.c.run_lease,
        "max_attempts": proj.c.max_attempts,
        "lane_seq": reserved.c.first_seq + numbered - literal_column("1"),
        "enqueue_shard": shard,
        "run_at": now,
        "attempted_at": proj.c.attempted_at if attempted else cast(None, Timestamp),
        "created_at": proj.c.created_at,
        "unique_key": proj.c.unique_key,
        "unique_states": proj.c.unique_states,
        "payload": cast(payload, JSONB),
    }
    source = select(*(values[c.name].label(c.name) for c in ready.c)).select_from(
        proj.join(reserved, and_(*(reserved.c[c.name] == c for c in lane)))
    )
    enqueued = (
        insert(ready)
        .from_select([c.name for c in ready.c], source)
        .returning(*ready.c)
        .cte("enqueued")
    )
    segments = ready_segments
    effects = [
        pg_insert(segments)
        .from_select(
            [c.name for c in segments.c if c.name != "created_at"], _segments(enqueued, one_insert)
        )
        .on_conflict_do_nothing(index_elements=[*SEGMENT_KEY, "first_lane_seq"])
        .cte("segments")
    ]
    queues = (
        select(enqueued.c.queue)
        .group_by(enqueued.c.queue)
        .order_by(enqueued.c.queue if one_insert else func.min(enqueued.c.job_id))
        .subquery("queues")
    )
    channel = literal_column("'awa:'", Text) + queues.c.queue
    notified = select(func.pg_notify(channel, literal_column("''"))).select_from(queues)
    told = select(func.count()).select_from(notified.subquery("notified")).scalar_subquery()
    return enqueued, effects, told


def _segments(enqueued: CTE, per_lane: bool) -> Any:
    """The ``ready_segments`` rows of the new ready rows: one per row, or one per lane (its
    numbers are one reserved block, its rows share one clock)."""
    e = enqueued.c
    key = [e[name] for name in SEGMENT_KEY]
    if not per_lane:
        return select(
            *key, e.lane_seq, (e.lane_seq + literal_column("1")).label("next_lane_seq"), e.run_at
        )
    return select(
        *key,
        func.min(e.lane_seq).label("first_lane_seq"),
        (func.max(e.lane_seq) + literal_column("1")).label("next_lane_seq"),
        func.min(e.run_at).label("first_run_at"),
    ).group_by(*key)


def _placed(proj: CTE) -> CTE:
    """*proj* with each job's new ``enqueue_shard`` (in place of its old one, where it has
    one): the one bound for it, else 0."""
    ids = bindparam("b_shard_ids", type_=ARRAY(BigInteger))
    shards = bindparam("b_shards", type_=ARRAY(SmallInteger))
    picks = func.unnest(ids, shards).table_valued(
        column("job_id", BigInteger), column("enqueue_shard", SmallInteger)
    )
    bound = picks.render_derived(name="picks")
    shard = func.coalesce(bound.c.enqueue_shard, SHARD0, type_=SmallInteger)
    return (
        select(*(c for c in proj.c if c.name != "enqueue_shard"), shard.label("enqueue_shard"))
        .select_from(proj.outerjoin(bound, bound.c.job_id == proj.c.job_id))
        .cte("placed")
    )
