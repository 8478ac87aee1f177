"""Retrying and discarding failed jobs of a queue-storage schema, as awa-pg 0.6.9 does.

A failed or cancelled job there is a row of ``S.done_entries`` (ready-backed: what it shares
with its ``ready_entries`` row is stored only there). awa-pg's retry deletes the job's newest
such row, closes the removed attempt's ``lease_claims`` receipt as ``terminal_removed``,
appends a ``-1`` terminal-count delta, takes the unique claim again where the mask claims
``available``, and enqueues the job anew under its own id and run lease: the lane's next
sequence numbers reserved by the schema's own ``S.reserve_enqueue_seq`` (which also holds the
lane's reservation lock to the end of the transaction), a ``ready_entries`` row at the ring
cursor with ``attempt = 0`` and ``run_at`` now, a one-row ``ready_segments`` entry, and the
queue's NOTIFY. Its discard deletes the kind's failed rows and every ``dlq_entries`` row of the
kind, with the same closures, the deltas summed per counter key, and the claims released.

Each verb is a few statements whatever the number of jobs: the targets locked (``FOR UPDATE
SKIP LOCKED``, as awa-pg's), then one statement that writes them all. Every job is named by
its id in one ``bigint[]``; the rows are read again from the locked ``done_entries`` rows.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    cast,
    delete,
    exists,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.administer.statements.requeue import enqueued_again
from awa_sa.core.registry import statement
from awa_sa.core.sql import EMPTY_OBJECT, distinct_on, state
from awa_sa.settle.statements.duplicate import counter_bucket
from awa_sa.settle.statements.receipt_writes import claims_in
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import job_unique_claims
from awa_sa.tables.runtime import queue_terminal_rollups

By = Literal["job", "kind", "queue"]
RETRIABLE = ("failed", "cancelled")


def _ids() -> ColumnElement[Any]:
    return bindparam("b_job_ids", type_=ARRAY(BigInteger))


def _newest(done: Any) -> ColumnElement[bool]:
    """No newer failed or cancelled row of the same job: awa-pg's ``ORDER BY finalized_at
    DESC LIMIT 1``."""
    newer = qs.done_entries.alias("newer")
    return ~exists().where(
        newer.c.job_id == done.c.job_id,
        newer.c.state.in_([state(s) for s in RETRIABLE]),
        newer.c.finalized_at > done.c.finalized_at,
    )


def _failed_of(by: By) -> ColumnElement[bool]:
    """The jobs with a failed row of kind or queue ``b_key`` (awa-pg's first scan)."""
    d = qs.done_entries.c
    key = bindparam("b_key", type_=Text)
    return and_(d.kind == key if by == "kind" else d.queue == key, d.state == state("failed"))


@statement
def retry_targets(*, by: By) -> Select[Any]:
    """Lock each job's newest failed or cancelled row (skipping locked ones, as awa-pg does):
    its id, run lease and lane. A job that also waits on a callback (a ``leases`` row) is left
    out: awa-pg's retry resumes the wait instead and leaves that row alone
    (:func:`~awa_sa.administer.statements.callback_leases.resumed_targets`)."""
    done = qs.done_entries.alias("target")
    d = done.c
    if by == "job":
        chosen: ColumnElement[bool] = d.job_id == bindparam("b_job_id", type_=BigInteger)
    else:
        chosen = d.job_id.in_(failed_jobs(by))
    waits = exists().where(
        qs.leases.c.job_id == d.job_id, qs.leases.c.state == state("waiting_external")
    )
    return (
        select(d.job_id, d.run_lease, d.queue, d.priority)
        .where(chosen, d.state.in_([state(s) for s in RETRIABLE]), _newest(done), ~waits)
        .order_by(d.job_id)
        .with_for_update(of=done, skip_locked=True)
    )


def failed_jobs(by: Literal["kind", "queue"]) -> Select[Any]:
    """The ids of the jobs with a failed row of kind or queue ``b_key``: awa-pg's scan."""
    picked = qs.done_entries.alias("picked")
    key = bindparam("b_key", type_=Text)
    column_ = picked.c.kind if by == "kind" else picked.c.queue
    return select(picked.c.job_id).where(column_ == key, picked.c.state == state("failed"))


@statement
def failed_matched(*, by: Literal["kind", "queue"]) -> Select[Any]:
    """awa-pg's ``matched``: the distinct jobs with a failed row of the kind or queue; and how
    many of them also wait on a callback (awa-pg's retry resumes those waits)."""
    d = qs.done_entries.c
    waits = exists().where(
        qs.leases.c.job_id == d.job_id, qs.leases.c.state == state("waiting_external")
    )
    jobs: ColumnElement[Any] = func.count(d.job_id.distinct())
    waiting: ColumnElement[Any] = func.count(d.job_id.distinct()).filter(waits)
    return select(jobs.label("matched"), waiting.label("waiting")).where(_failed_of(by))


@statement
def pruned_failed() -> Select[Any]:
    """awa-pg 0.6.9's ``pruned_failed_count`` of a queue: its rollups' pruned failed rows."""
    r = queue_terminal_rollups.c
    total = func.coalesce(func.sum(r.pruned_failed_count), literal_column("0"))
    return select(cast(total, BigInteger).label("pruned")).where(
        r.queue == bindparam("b_key", type_=Text)
    )


def with_ready_columns(rows: Any, *clocks: str) -> Select[Any]:
    """The done rows *rows* with what they share with their ready row, as awa-pg reads them
    (and the *clocks* named, ``run_at``, ``attempted_at``, where a reader wants them)."""
    ready = qs.ready_entries
    r = ready.c
    lane = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "lane_seq")
    joined = rows.join(ready, and_(*(r[n] == rows.c[n] for n in lane)), isouter=True)

    def either(name: str, default: ColumnElement[Any] | None = None) -> Any:
        parts = [rows.c[name], r[name]] + ([default] if default is not None else [])
        return func.coalesce(*parts, type_=rows.c[name].type).label(name)

    return select(
        *(rows.c[n] for n in (*lane, "job_id", "kind", "state", "attempt", "run_lease")),
        rows.c.finalized_at,
        either("args", EMPTY_OBJECT),
        either("max_attempts", cast(literal_column("25"), SmallInteger)),
        either("created_at", rows.c.finalized_at),
        either("unique_key"),
        either("unique_states"),
        either("payload", EMPTY_OBJECT),
        *(either(name) for name in clocks),
    ).select_from(joined)


def _targets() -> CTE:
    """The locked rows named by ``b_job_ids``, read again with their ready columns."""
    done = qs.done_entries
    d = done.c
    chosen = select(done).where(
        d.job_id == func.any(_ids()), d.state.in_([state(s) for s in RETRIABLE]), _newest(done)
    )
    return with_ready_columns(chosen.subquery("chosen")).cte("targets")


@statement
def retry_claims() -> Select[Any]:
    """The retried jobs' unique claims: released where the mask claims the old state but not
    ``available``, taken where the reverse (kept by another job: ``taken`` falls short of
    ``wanted``, awa-pg's UniqueConflict)."""
    return claims_moved(_targets(), RETRIABLE)


def claims_moved(t: CTE, states: tuple[str, ...], new_state: str = "available") -> Select[Any]:
    """The claims of the jobs of *t* (in one of *states*) as they become *new_state* (available
    again, or scheduled for a DLQ retry to a later time)."""
    old = or_(*(and_(t.c.state == state(s), claims_in(t.c.unique_states, s)) for s in states))
    new = claims_in(t.c.unique_states, new_state)
    claims = job_unique_claims
    released = (
        delete(claims)
        .where(claims.c.unique_key == t.c.unique_key, claims.c.job_id == t.c.job_id, old, ~new)
        .returning(claims.c.job_id)
        .cte("released")
    )
    wanted = select(t.c.unique_key, t.c.job_id).where(t.c.unique_key.is_not(None), new, ~old)
    stmt = pg_insert(claims).from_select(
        ["unique_key", "job_id"], distinct_on(wanted, t.c.unique_key).order_by(t.c.unique_key)
    )
    taken = (
        stmt.on_conflict_do_update(
            index_elements=["unique_key"],
            set_={"job_id": stmt.excluded.job_id},
            where=claims.c.job_id == stmt.excluded.job_id,
        )
        .returning(claims.c.job_id)
        .cte("taken")
    )
    return select(
        select(func.count())
        .select_from(wanted.subquery("wants"))
        .scalar_subquery()
        .label("wanted"),
        select(func.count()).select_from(taken).scalar_subquery().label("taken"),
        select(func.count()).select_from(released).scalar_subquery().label("released"),
    )


def close_removed_receipts(
    removed: Any, outcome: str = "terminal_removed", *, prefix: str = ""
) -> CTE:
    """Close the removed attempts' ``lease_claims`` receipts as *outcome*: a terminal row
    removed (``terminal_removed``), or a lease deleted (``rescue``, as awa-pg closes the
    receipt of every lease it deletes). *prefix* keeps its CTEs' names apart from another
    call's in the same statement."""
    claims, closures = qs.lease_claims, qs.lease_claim_closures
    c = claims.c
    closed = (
        pg_insert(closures)
        .from_select(
            ["claim_slot", "job_id", "run_lease", "outcome", "closed_at"],
            select(
                c.claim_slot,
                c.job_id,
                c.run_lease,
                literal_column(f"'{outcome}'", Text),
                func.clock_timestamp(),
            ).where(c.job_id == removed.c.job_id, c.run_lease == removed.c.run_lease),
        )
        .on_conflict_do_nothing(index_elements=["claim_slot", "job_id", "run_lease"])
        .returning(*closures.c)
        .cte(f"{prefix}closed")
    )
    return (
        update(claims)
        .where(
            c.claim_slot == closed.c.claim_slot,
            c.job_id == closed.c.job_id,
            c.run_lease == closed.c.run_lease,
        )
        .values(closed_at=func.coalesce(c.closed_at, closed.c.closed_at))
        .returning(c.job_id)
        .cte(f"{prefix}marked")
    )


def removed_deltas(removed: Any, *, summed: bool) -> CTE:
    """The negative terminal-count deltas: one ``-1`` per row (a retry, job by job), or one
    sum per counter key (a discard)."""
    deltas = qs.queue_terminal_count_deltas
    key = [removed.c[n] for n in ("ready_slot", "ready_generation", "queue", "priority")]
    key += [removed.c.enqueue_shard, counter_bucket(removed.c.job_id).label("counter_bucket")]
    minus_one = cast(literal_column("-1"), BigInteger)
    if summed:
        rows = select(*key, (-func.count()).label("d")).group_by(*key)
    else:
        rows = select(*key, minus_one.label("d"))
    names = ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard"]
    return (
        insert(deltas)
        .from_select([*names, "counter_bucket", "terminal_delta"], rows)
        .returning(deltas.c.ready_slot)
        .cte("deltas")
    )


@statement
def retry_done() -> Select[Any]:
    """Delete the locked rows, close their receipts, append their deltas, and enqueue each
    job again on its lane at the ring cursor (``b_ready_slot``, ...), on the enqueue shard
    picked for it (``b_shard_ids``, ``b_shards``; else 0); answers the new ready rows by id."""
    proj, effects = failed_removed()
    enqueued, enqueuing, told = enqueued_again(proj, sharded=True)
    answer = select(*enqueued.c, told.label("told")).order_by(enqueued.c.job_id)
    return answer.add_cte(*effects, *enqueuing)


def failed_removed() -> tuple[CTE, list[CTE]]:
    """The locked rows of ``b_job_ids`` deleted, read with their ready columns, and the CTEs
    that close their receipts and append their ``-1`` deltas."""
    done = qs.done_entries
    t = _targets()
    keys = select(t.c.job_id, t.c.finalized_at)
    removed = (
        delete(done)
        .where(tuple_(done.c.job_id, done.c.finalized_at).in_(keys))
        .returning(*done.c)
        .cte("removed")
    )
    proj = with_ready_columns(removed).cte("removed_rows")
    return proj, [close_removed_receipts(removed), removed_deltas(removed, summed=False)]
