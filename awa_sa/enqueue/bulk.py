"""A batch of new jobs written set-based, as awa-pg 0.6.9's ``Client.enqueue_many_copy`` writes it.

Once routing points at a queue-storage schema ``S``, awa-pg's bulk producer does not call
``awa.insert_job_compat`` per job: it draws the ids in its own order, takes the unique claims,
ensures each lane once, reserves each lane's positions in one ``S.reserve_enqueue_seq`` call,
and writes the ready rows, **one** ``ready_segments`` row per lane, the deferred rows and one
NOTIFY per queue, stamped with one clock reading (docs/contract.md#bulk-enqueue says each
step). Three statements whatever the batch's size: :func:`bulk_routing`,
:func:`~awa_sa.enqueue.bulk_lanes.bulk_lanes` (before the write, since the reservation cannot
see rows a CTE of its own statement inserts) and :func:`bulk_write`, which a batch with no
unique job leaves to :func:`~awa_sa.enqueue.bulk_plain.bulk_plain`. The batch is bound as
``insert_jobs`` binds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    literal_column,
    not_,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import EMPTY_OBJECT, SHARD0, ZERO, state
from awa_sa.enqueue.statements import Batch, Shape, bound_jobs, insert_binds
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp, job_unique_claims, storage_transition_state
from awa_sa.tables.runtime import queue_meta, ready_segments

ROUTED_STATES = ("mixed_transition", "active")  # routing points at queue storage
CANONICAL_STATES = ("canonical", "prepared")  # routing is canonical


class Routing(NamedTuple):
    """What :func:`bulk_routing` read: the locked singleton's state, the state the statement's
    snapshot saw (the routing function's view), the routing schema, and whether a queue of the
    batch has more than one enqueue shard."""

    locked_state: str
    seen_state: str | None
    schema: str | None
    sharded: bool

    @property
    def set_based(self) -> str | None:
        """The routing schema when the set-based path may run, else None.

        Both views of the singleton must agree: a transition that committed while the lock
        waited is seen by the locked row but not by the routing function's snapshot.
        """
        agreed = self.locked_state == self.seen_state and self.locked_state in ROUTED_STATES
        return self.schema if agreed and not self.sharded else None

    @property
    def canonical(self) -> bool:
        """Whether both views see routing canonical (``canonical`` or ``prepared``): the
        producer function would write every job to ``awa.jobs_hot`` or ``awa.scheduled_jobs``."""
        agreed = self.locked_state == self.seen_state
        return agreed and self.schema is None and self.locked_state in CANONICAL_STATES


@statement
def bulk_routing() -> Select[Any]:
    """Share-lock the transition singleton; its state, routing, and the batch's sharded queues.

    Held to the end of the transaction, the lock keeps every storage transition (each locks
    the row exclusively first) from committing under the batch: an abort cannot switch off the
    schema the batch writes. ``b_queues`` are the batch's queues: a queue with more than one
    enqueue shard is left to the producer function, which picks its shards by Awa's own rule.
    """
    t = storage_transition_state.alias("transition")
    seen = storage_transition_state.alias("seen")
    seen_state = select(seen.c.state).where(seen.c.singleton).scalar_subquery()
    queues = bindparam("b_queues", type_=ARRAY(Text))
    many = queue_meta.c.enqueue_shards > literal_column("1")
    sharded = exists().where(queue_meta.c.queue == func.any(queues), many)
    return (
        select(
            t.c.state,
            seen_state.label("seen_state"),
            func.awa.active_queue_storage_schema(type_=Text).label("routing"),
            sharded.label("sharded"),
        )
        .where(t.c.singleton)
        .with_for_update(of=t, read=True)
    )


def _jobs(shape: Shape) -> Any:
    """The bound jobs, one row each, with the producer's defaults filled in."""
    rows, a, position = bound_jobs(shape)
    if position is None:  # one job's scalars
        position = ZERO
    kind, queue, args, _state, priority, max_attempts, run_at, metadata, tags = a[:9]
    unique_key, unique_states, ordering_key = a[9:]
    return (
        select(
            position.label("position"),
            kind.label("kind"),
            func.coalesce(queue, literal_column("'default'"), type_=Text).label("queue"),
            args.label("args"),
            (run_at.is_(None)).label("ready"),
            func.coalesce(priority, cast(literal_column("2"), SmallInteger)).label("priority"),
            func.coalesce(max_attempts, cast(literal_column("25"), SmallInteger)).label(
                "max_attempts"
            ),
            run_at.label("run_at"),
            func.coalesce(metadata, EMPTY_OBJECT, type_=JSONB).label("metadata"),
            func.coalesce(tags, cast(literal_column("'{}'"), ARRAY(Text))).label("tags"),
            unique_key.label("unique_key"),
            unique_states.label("unique_bits"),
            ordering_key.isnot(None).label("keyed"),
        )
        .select_from(rows)
        .subquery("jobs")
    )


def scheduled_row(
    k: Any, now: Any, unique_key: ColumnElement[Any], unique_states: ColumnElement[Any]
) -> dict[str, ColumnElement[Any]]:
    """A scheduled job's ``deferred_jobs`` row, as ``enqueue_many_copy`` writes it, from the
    batch's numbered rows *k* and the batch's one clock reading *now*."""
    none = cast(null(), Timestamp)
    return {
        "job_id": k.job_id,
        "kind": k.kind,
        "queue": k.queue,
        "args": k.args,
        "state": state("scheduled"),
        "priority": k.priority,
        "attempt": cast(ZERO, SmallInteger),
        "run_lease": cast(ZERO, BigInteger),
        "max_attempts": k.max_attempts,
        "run_at": k.run_at,
        "attempted_at": none,
        "finalized_at": none,
        "created_at": now,
        "unique_key": unique_key,
        "unique_states": unique_states,
        "payload": k.payload,
    }


def _payload(jobs: Any) -> ColumnElement[Any]:
    """The runtime's storage payload: metadata and tags where not empty; NULL for neither."""
    metadata = case(
        (jobs.c.metadata == EMPTY_OBJECT, EMPTY_OBJECT),
        else_=func.jsonb_build_object(literal_column("'metadata'"), jobs.c.metadata),
    )
    tags = case(
        (func.cardinality(jobs.c.tags) == ZERO, EMPTY_OBJECT),
        else_=func.jsonb_build_object(literal_column("'tags'"), func.to_jsonb(jobs.c.tags)),
    )
    return func.nullif(metadata.op("||")(tags), EMPTY_OBJECT, type_=JSONB)


def _numbered(jobs: Any) -> Any:
    """Each job with its id, drawn in awa-pg's order (module docstring), and whether it takes
    a unique claim (its key, and its first state in its mask)."""
    ready = jobs.c.ready
    ordered = (
        select(jobs)
        .order_by(
            not_(ready),
            case((ready, jobs.c.queue), else_=null()).collate("C"),
            case((ready, jobs.c.priority), else_=null()),
            case((ready, not_(jobs.c.keyed)), else_=null()),
            jobs.c.position,
        )
        .subquery("ordered")
    )
    first = case((ordered.c.ready, state("available")), else_=state("scheduled"))
    claims = and_(
        ordered.c.unique_key.isnot(None),
        ordered.c.unique_bits.isnot(None),
        func.awa.job_state_in_bitmask(ordered.c.unique_bits, first, type_=Boolean),
    )
    return (
        select(
            *ordered.c,
            cast(qs.job_id_seq.next_value(), BigInteger).label("job_id"),
            func.coalesce(claims, literal_column("false")).label("claims"),
            _payload(ordered).label("payload"),
        )
        .cte("numbered")
        .prefix_with("MATERIALIZED")
    )


@statement
def bulk_write(*, shape: Shape, all_or_nothing: bool) -> Select[Any]:
    """The batch written after :func:`~awa_sa.enqueue.bulk_lanes.bulk_lanes`: ids, unique
    claims (a key already held, or held by an earlier job of the batch, is not claimed and its
    job not written), each lane's reservation, ready rows, one segment per lane, deferred
    rows, NOTIFYs; per job in input order ``(id, run_at, created_at, args, metadata, written,
    duplicate)``.

    *all_or_nothing* (``"raise"``): a duplicate anywhere writes no job and reserves no lane
    position (awa-pg's refusal moves no lane sequence); the rest is the caller's rollback."""
    jobs = _jobs(shape)
    numbered = _numbered(jobs)
    n = numbered.c
    claimed = (
        pg_insert(job_unique_claims)
        .from_select(
            ["unique_key", "job_id"],
            select(n.unique_key, n.job_id).where(n.claims).order_by(n.position),
        )
        .on_conflict_do_nothing(index_elements=["unique_key"])
        .returning(job_unique_claims.c.job_id)
        .cte("claimed")
    )
    claimed_ids = select(claimed.c.job_id)
    duplicate = and_(n.claims, n.job_id.not_in(claimed_ids))
    keep: ColumnElement[bool] = not_(duplicate)
    if all_or_nothing:
        others = numbered.alias("other")
        keep = and_(keep, ~exists().where(others.c.claims, others.c.job_id.not_in(claimed_ids)))
    kept = select(numbered).where(keep).cte("kept").prefix_with("MATERIALIZED")
    k = kept.c
    lanes = (
        select(k.queue, k.priority, func.count().label("n"))
        .where(k.ready)
        .group_by(k.queue, k.priority)
        .order_by(k.queue.collate("C"), k.priority)
        .subquery("lanes")
    )
    first = qs.reserve_enqueue_seq(lanes.c.queue, lanes.c.priority, SHARD0, lanes.c.n)
    reserved = (
        select(lanes, cast(first, BigInteger).label("first_seq"))
        .cte("reserved")
        .prefix_with("MATERIALIZED")
    )
    r = reserved.c
    ring = (
        select(qs.queue_ring_state.c.current_slot, qs.queue_ring_state.c.generation)
        .where(qs.queue_ring_state.c.singleton)
        .cte("ring")
    )
    clock = select(func.clock_timestamp().label("now")).cte("clock").prefix_with("MATERIALIZED")
    now = clock.c.now
    none = cast(null(), Timestamp)
    in_lane = func.row_number().over(partition_by=(k.queue, k.priority), order_by=k.job_id)
    ready_values: dict[str, ColumnElement[Any]] = {
        "ready_slot": ring.c.current_slot,
        "ready_generation": ring.c.generation,
        "job_id": k.job_id,
        "kind": k.kind,
        "queue": k.queue,
        "args": k.args,
        "priority": k.priority,
        "attempt": cast(ZERO, SmallInteger),
        "run_lease": cast(ZERO, BigInteger),
        "max_attempts": k.max_attempts,
        "lane_seq": r.first_seq + in_lane - literal_column("1"),
        "enqueue_shard": SHARD0,
        "run_at": now,
        "attempted_at": none,
        "created_at": now,
        "unique_key": k.unique_key,
        "unique_states": cast(k.unique_bits, Text),
        "payload": k.payload,
    }
    on_lane = and_(r.queue == k.queue, r.priority == k.priority)
    ready_source = (
        select(*(ready_values[c.name].label(c.name) for c in qs.ready_entries.c))
        .select_from(kept.join(reserved, on_lane).join(ring, true()).join(clock, true()))
        .where(k.ready)
    )
    ready = insert(qs.ready_entries).from_select(list(ready_values), ready_source).cte("ready")
    segment = select(
        ring.c.current_slot,
        ring.c.generation,
        r.queue,
        r.priority,
        SHARD0.label("enqueue_shard"),
        r.first_seq,
        (r.first_seq + r.n).label("next_lane_seq"),
        now.label("first_run_at"),
    ).select_from(reserved.join(ring, true()).join(clock, true()))
    segment_key = ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard"]
    segments = (
        pg_insert(ready_segments)
        .from_select([c.name for c in ready_segments.c if c.name != "created_at"], segment)
        .on_conflict_do_nothing(index_elements=[*segment_key, "first_lane_seq"])
        .cte("segments")
    )
    deferred_values = scheduled_row(k, now, k.unique_key, cast(k.unique_bits, Text))
    deferred = (
        insert(qs.deferred_jobs)
        .from_select(
            list(deferred_values),
            select(*(v.label(name) for name, v in deferred_values.items()))
            .select_from(kept.join(clock, true()))
            .where(not_(k.ready)),
        )
        .cte("deferred")
    )
    channel = (literal_column("'awa:'", Text) + k.queue).collate("C").label("channel")
    channels = select(channel).where(k.ready).distinct().order_by(channel).subquery("channels")
    notified = (
        select(func.pg_notify(channels.c.channel, literal_column("''")).label("told"))
        .select_from(channels)
        .cte("notified")
    )
    told = select(func.count()).select_from(notified).scalar_subquery() >= ZERO
    answer = (
        select(
            n.job_id,
            case((n.ready, now), else_=n.run_at).label("run_at"),
            now.label("created_at"),
            cast(n.args, Text).label("args"),
            cast(n.metadata, Text).label("metadata"),
            n.job_id.in_(select(k.job_id)).label("written"),
            duplicate.label("duplicate"),
        )
        .select_from(numbered.join(clock, true()))
        .where(told)
        .order_by(n.position)
    )
    for write in (ready, segments, deferred):
        answer = answer.add_cte(write)
    return answer


BULK_ROUTING: Query[Sequence[str], Routing] = Query(
    shape=lambda _: bulk_routing(),
    binds=lambda queues: {"b_queues": list(queues)},
    read=lambda rows: Routing(*rows[0]) if rows else Routing("canonical", None, None, False),
)
"""The batch's queues in; the routing the set-based path needs out (canonical without a row)."""

BULK_WRITE: Query[tuple[Batch, bool], Rows] = Query(
    shape=lambda given: bulk_write(shape=given[0].shape, all_or_nothing=given[1]),
    binds=lambda given: insert_binds(given[0]),
    read=lambda rows: rows,
    by_position=True,
)
"""The batch and whether it is all or nothing in; per job, in input order, ``(id, run_at,
created_at, args, metadata, written, duplicate)``."""
