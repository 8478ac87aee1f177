"""A batch's lanes: counted by the client, then ensured on the server before any write.

The client knows every job of a batch, so it counts each lane's ready jobs and the order the
ids will be drawn in (:func:`plan`) before any statement; the statements take the lanes as
four arrays (:func:`bound_lanes`) rather than reading the batch's JSON again to find them.
:func:`bulk_lanes` runs before the write, since ``S.reserve_enqueue_seq`` cannot see rows a
CTE of its own statement inserts.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    BigInteger,
    Select,
    SmallInteger,
    Text,
    bindparam,
    column,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.registry import Query, statement
from awa_sa.core.sql import SHARD0, ZERO
from awa_sa.enqueue.statements import Batch
from awa_sa.tables import queue_storage as qs


def bound_lanes() -> Any:
    """The batch's lanes as the client counted them from its ready jobs, in the order awa-pg
    takes them (queue bytes, then priority): each lane's queue, priority, number of ready jobs
    and the draw index (from 1) of its first, in ``lane`` order. Bound as four arrays, so no
    statement reads the batch's JSON only to find its lanes."""
    return (
        func.unnest(
            bindparam("b_lane_queues", type_=ARRAY(Text)),
            bindparam("b_lane_priorities", type_=ARRAY(SmallInteger)),
            bindparam("b_lane_counts", type_=ARRAY(BigInteger)),
            bindparam("b_lane_starts", type_=ARRAY(BigInteger)),
        )
        .table_valued(
            column("queue", Text),
            column("priority", SmallInteger),
            column("n", BigInteger),
            column("start", BigInteger),
            with_ordinality="lane",
        )
        .render_derived(name="lanes")
    )


@statement
def bulk_lanes() -> Select[Any]:
    """Each lane of the batch's ready jobs (:func:`bound_lanes`) ensured as awa-pg ensures it,
    in lane order: its advisory lock (``S:queue:priority:0``, ``b_schema`` being ``S``), then
    its ``queue_lanes`` row and both head rows where missing. Answers the number of lanes."""
    given = bound_lanes()
    lanes = (
        select(given.c.queue, given.c.priority)
        .order_by(given.c.lane)
        .cte("lanes")
        .prefix_with("MATERIALIZED")
    )
    key = func.concat_ws(
        literal_column("':'"),
        bindparam("b_schema", type_=Text),
        lanes.c.queue,
        lanes.c.priority,
        ZERO,
    )
    locked = (
        select(func.pg_advisory_xact_lock(func.hashtextextended(key, ZERO)).label("held"))
        .select_from(lanes)
        .cte("locked")
        .prefix_with("MATERIALIZED")
    )
    after = select(func.count()).select_from(locked).scalar_subquery() >= ZERO
    writes = []
    for table, name in (
        (qs.queue_lanes, "lane_rows"),
        (qs.queue_enqueue_heads, "enqueue_heads"),
        (qs.queue_claim_heads, "claim_heads"),
    ):
        columns = [lanes.c.queue, lanes.c.priority]
        if "enqueue_shard" in table.c:
            columns.append(SHARD0.label("enqueue_shard"))
        source = select(*columns).where(after)
        write = (
            pg_insert(table)
            .from_select([c.name for c in columns], source)
            .on_conflict_do_nothing()
            .returning(table.c.queue)
            .cte(name)
        )
        writes.append(write)
        if name == "lane_rows":
            # The head rows' triggers create the lane's sequences: a lane row another
            # transaction has not committed yet is waited for first, as awa's own enqueue
            # waits on it, rather than failing on that transaction's new sequences.
            after = select(func.count()).select_from(write).scalar_subquery() >= ZERO
    query = select(func.count()).select_from(lanes)
    for write in writes:
        query = query.add_cte(write)
    return query


Kinds = Literal["ready", "scheduled", "both"]
"""Which rows a batch writes: ready jobs alone, scheduled alone, or both."""


class Plan(NamedTuple):
    """What the client knows of a batch's writes before any statement.

    ``lanes`` are :func:`~awa_sa.enqueue.bulk.bound_lanes`' four arrays; ``order`` the
    positions in the order the ids are drawn (None: input order), ``kinds`` which rows.
    """

    lanes: Lanes
    order: list[int] | None
    kinds: Kinds


def plan(batch: Batch) -> Plan:
    """The lanes and the draw order of *batch*, as the statements count and draw them: ready
    jobs first, lane by lane (queue by code point, which is UTF-8's byte order, then
    priority), a lane's jobs with an ordering key before the others, then scheduled jobs,
    each group in input order."""
    jobs = batch.jobs
    ready = [job.run_at is None for job in jobs]
    if batch.shape != "objects":  # one job's values, shared: one lane, drawn in input order
        job = jobs[0]
        n = len(jobs)
        if job.run_at is not None:
            return Plan(([], [], [], []), None, "scheduled")
        return Plan(([job.queue], [job.priority], [n], [1]), None, "ready")
    keys = [
        (0, job.queue, job.priority, job.ordering_key is None, position)
        if is_ready
        else (1, "", 0, False, position)
        for position, (job, is_ready) in enumerate(zip(jobs, ready, strict=True))
    ]
    order = sorted(range(len(jobs)), key=keys.__getitem__)
    counts: dict[tuple[str, int], int] = {}
    for job, is_ready in zip(jobs, ready, strict=True):
        if is_ready:
            lane = (job.queue, job.priority)
            counts[lane] = counts.get(lane, 0) + 1
    queues, priorities, ns, starts = [], [], [], []
    start = 1
    for (queue, priority), n in sorted(counts.items()):
        queues.append(queue)
        priorities.append(priority)
        ns.append(n)
        starts.append(start)
        start += n
    any_ready, any_scheduled = bool(counts), start <= len(jobs)
    kinds: Kinds = "both" if any_ready and any_scheduled else "ready" if any_ready else "scheduled"
    in_order = all(position == drawn for position, drawn in enumerate(order))
    return Plan((queues, priorities, ns, starts), None if in_order else order, kinds)


Lanes = tuple[list[str], list[int], list[int], list[int]]
""":func:`bound_lanes`' four arrays: queues, priorities, ready jobs, first draw indexes."""


def lanes_binds(lanes: Lanes) -> dict[str, Any]:
    queues, priorities, counts, starts = lanes
    return {
        "b_lane_queues": queues,
        "b_lane_priorities": priorities,
        "b_lane_counts": counts,
        "b_lane_starts": starts,
    }


BULK_LANES: Query[tuple[Lanes, str], int] = Query(
    shape=lambda _: bulk_lanes(),
    binds=lambda given: {**lanes_binds(given[0]), "b_schema": given[1]},
    read=lambda rows: int(rows[0][0]),
)
"""The batch's lanes and its routing schema in; how many lanes were ensured out."""
