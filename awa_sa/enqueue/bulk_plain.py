"""A plain batch on queue storage in one statement: no unique job, nothing read back but ids.

Most batches have no unique job, and their args and metadata are values :func:`plain`
admits (stored as written, read back as sent). For those the write of
:mod:`awa_sa.enqueue.bulk` does more than the rows need: no claim to take, so nothing to
keep apart, and nothing the client does not already know to send back but each job's id,
the one clock reading and a scheduled job's ``run_at``. :func:`bulk_plain` writes the same
rows (ids drawn in awa-pg's order, one reservation and one segment per lane, NOTIFYs) with the
lanes the client counted (:func:`awa_sa.enqueue.bulk_lanes.bound_lanes`) and answers one row:
the ids as text, which sorted are the order they were drawn in, which the client maps back to
its positions (:func:`awa_sa.enqueue.bulk_lanes.plan`). A batch of ready jobs alone, the
common one, reads its JSON once, straight into ``ready_entries``; only a batch of ready and
scheduled jobs keeps its numbered jobs for both inserts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Select,
    SmallInteger,
    Text,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal_column,
    not_,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, aggregate_order_by
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.core.registry import Query, statement
from awa_sa.core.sql import SHARD0, ZERO
from awa_sa.core.unique_keys import plain
from awa_sa.enqueue.bulk import _jobs, _payload, scheduled_row
from awa_sa.enqueue.bulk_lanes import Kinds, Plan, bound_lanes, lanes_binds
from awa_sa.enqueue.statements import Batch, Shape, insert_binds
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp
from awa_sa.tables.runtime import ready_segments


def is_plain(batch: Batch) -> bool:
    """Whether *batch* can go as :func:`bulk_plain`: no unique job, and every job's args and
    metadata read back as sent (args sent as a value, metadata a :func:`plain` one)."""
    seen: set[str] = set()
    for job in batch.jobs:
        if job.unique_key is not None or job.args_text is not None:
            return False
        text = job.metadata
        if text != "{}" and text not in seen:
            if not plain(json.loads(text)):
                return False
            seen.add(text)
    return True


def _numbered(shape: Shape) -> Any:
    """Each job with its id and its draw index (from 1), drawn in the order
    :func:`~awa_sa.enqueue.bulk_lanes.plan` expects."""
    jobs = _jobs(shape)
    ordered = select(jobs)
    if shape == "objects":
        ready = jobs.c.ready
        ordered = ordered.order_by(
            not_(ready),
            case((ready, jobs.c.queue), else_=null()).collate("C"),
            case((ready, jobs.c.priority), else_=null()),
            case((ready, not_(jobs.c.keyed)), else_=null()),
            jobs.c.position,
        )
    subquery = ordered.subquery("ordered")
    o = subquery.c
    return select(
        o.kind,
        o.queue,
        o.args,
        o.ready,
        o.priority,
        o.max_attempts,
        o.run_at,
        cast(qs.job_id_seq.next_value(), BigInteger).label("job_id"),
        func.row_number().over().label("draw"),
        _payload(subquery).label("payload"),
    )


@statement
def bulk_plain(*, shape: Shape, kinds: Kinds) -> Select[Any]:
    """A plain batch written after :func:`~awa_sa.enqueue.bulk_lanes.bulk_lanes`: ids, each lane's
    reservation, ready rows, one segment per lane, deferred rows, NOTIFYs. One row: the clock
    reading, the ready and the scheduled jobs' ids as comma-separated text (the scheduled in
    draw order), and the scheduled jobs' ``run_at`` in that order."""
    numbered: Any = _numbered(shape)
    numbered = (
        numbered.cte("numbered").prefix_with("MATERIALIZED")
        if kinds == "both"
        else numbered.subquery("numbered")
    )
    k = numbered.c
    clock = select(func.clock_timestamp().label("now")).cte("clock").prefix_with("MATERIALIZED")
    # The batch's one scan reads nothing else: a join would let the planner scan it again,
    # drawing its ids again. The clock, the ring and each lane's offset come as InitPlans.
    now = select(clock.c.now).scalar_subquery()
    none = cast(null(), Timestamp)
    answer_columns: list[ColumnElement[Any]] = [clock.c.now.label("created_at")]
    writes: list[Any] = []
    told: ColumnElement[bool] = true()
    if kinds == "scheduled":
        answer_columns.append(cast(null(), Text).label("ready_ids"))
    else:
        lanes = bound_lanes()
        first = qs.reserve_enqueue_seq(lanes.c.queue, lanes.c.priority, SHARD0, lanes.c.n)
        reserved = (
            select(lanes.c.queue, lanes.c.priority, lanes.c.n, lanes.c.start, lanes.c.lane)
            .add_columns(cast(first, BigInteger).label("first_seq"))
            .order_by(lanes.c.lane)
            .cte("reserved")
            .prefix_with("MATERIALIZED")
        )
        r = reserved.c
        ring = (
            select(qs.queue_ring_state.c.current_slot, qs.queue_ring_state.c.generation)
            .where(qs.queue_ring_state.c.singleton)
            .cte("ring")
        )
        offsets = select(
            func.array_agg(aggregate_order_by(r.first_seq - r.start, r.lane))
        ).scalar_subquery()
        lane_of = func.width_bucket(k.draw, bindparam("b_lane_starts", type_=ARRAY(BigInteger)))
        values: dict[str, ColumnElement[Any]] = {
            "ready_slot": select(ring.c.current_slot).scalar_subquery(),
            "ready_generation": select(ring.c.generation).scalar_subquery(),
            "job_id": k.job_id,
            "kind": k.kind,
            "queue": k.queue,
            "args": k.args,
            "priority": k.priority,
            "attempt": cast(ZERO, SmallInteger),
            "run_lease": cast(ZERO, BigInteger),
            "max_attempts": k.max_attempts,
            "lane_seq": k.draw + offsets[lane_of],
            "enqueue_shard": SHARD0,
            "run_at": now,
            "attempted_at": none,
            "created_at": now,
            "unique_key": null(),
            "unique_states": cast(null(), Text),
            "payload": k.payload,
        }
        source = select(*(values[c.name].label(c.name) for c in qs.ready_entries.c)).select_from(
            numbered
        )
        if kinds == "both":
            source = source.where(k.ready)
        ready = (
            insert(qs.ready_entries)
            .from_select(list(values), source)
            .returning(qs.ready_entries.c.job_id)
            .cte("ready")
        )
        segment = select(
            ring.c.current_slot,
            ring.c.generation,
            r.queue,
            r.priority,
            SHARD0.label("enqueue_shard"),
            r.first_seq,
            (r.first_seq + r.n).label("next_lane_seq"),
            clock.c.now.label("first_run_at"),
        ).select_from(reserved.join(ring, true()).join(clock, true()))
        segment_key = ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard"]
        writes.append(
            pg_insert(ready_segments)
            .from_select([c.name for c in ready_segments.c if c.name != "created_at"], segment)
            .on_conflict_do_nothing(index_elements=[*segment_key, "first_lane_seq"])
            .cte("segments")
        )
        channel = (literal_column("'awa:'", Text) + r.queue).collate("C").label("channel")
        channels = select(channel).distinct().order_by(channel).subquery("channels")
        notified = (
            select(func.pg_notify(channels.c.channel, literal_column("''")).label("told"))
            .select_from(channels)
            .cte("notified")
        )
        told = select(func.count()).select_from(notified).scalar_subquery() >= ZERO
        answer_columns.append(_ids(ready.c.job_id, ready, ordered=False).label("ready_ids"))
    if kinds == "ready":
        answer_columns += [cast(null(), Text).label("scheduled_ids"), null().label("run_ats")]
    else:
        deferred = _deferred(numbered, now, kinds)
        answer_columns.append(
            _ids(deferred.c.job_id, deferred, ordered=True).label("scheduled_ids")
        )
        run_ats = func.array_agg(aggregate_order_by(deferred.c.run_at, deferred.c.job_id))
        answer_columns.append(select(run_ats).scalar_subquery().label("run_ats"))
    answer = select(*answer_columns).select_from(clock).where(told)
    for write in writes:
        answer = answer.add_cte(write)
    return answer


def _ids(job_id: Any, source: Any, *, ordered: bool) -> Any:
    """The ids as comma-separated text: the ready ones unsorted (the client sorts them, in
    about linear time, as they come nearly in order; 100,000 sorted here spilled to disk),
    the scheduled ones in the order of their ``run_at``'s array."""
    separator: Any = literal_column("','")
    if ordered:
        separator = aggregate_order_by(separator, job_id)
    text = func.string_agg(cast(job_id, Text), separator)
    return select(text).select_from(source).scalar_subquery()


def _deferred(numbered: Any, now: Any, kinds: Kinds) -> Any:
    values = scheduled_row(numbered.c, now, null(), cast(null(), Text))
    source = select(*(v.label(name) for name, v in values.items())).select_from(numbered)
    if kinds == "both":
        source = source.where(not_(numbered.c.ready))
    return (
        insert(qs.deferred_jobs)
        .from_select(list(values), source)
        .returning(qs.deferred_jobs.c.job_id, qs.deferred_jobs.c.run_at)
        .cte("deferred")
    )


class Written(NamedTuple):
    """What :func:`bulk_plain` answered: the clock reading, the ids in draw order, and the
    scheduled jobs' ``run_at`` (those ids' tail) in that order."""

    created_at: datetime
    ids: list[int]
    run_ats: Sequence[datetime]


def _written(rows: Any) -> Written:
    created_at, ready_ids, scheduled_ids, run_ats = rows[0]
    ids = sorted(map(int, ready_ids.split(","))) if ready_ids else []
    if scheduled_ids:
        ids += [int(i) for i in scheduled_ids.split(",")]
    return Written(created_at, ids, run_ats or ())


BULK_PLAIN: Query[tuple[Batch, Plan], Written] = Query(
    shape=lambda given: bulk_plain(shape=given[0].shape, kinds=given[1].kinds),
    binds=lambda given: {**insert_binds(given[0]), **lanes_binds(given[1].lanes)},
    read=_written,
    by_position=True,
)
"""The plain batch and its plan in; the ids (draw order) and the clock reading out."""
