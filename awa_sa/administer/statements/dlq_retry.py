"""Retrying jobs out of the dead-letter queue of a queue-storage schema, as awa-pg 0.6.9 does.

awa-pg's ``retry_from_dlq`` deletes the job's ``dlq_entries`` row and writes the job anew under
its own id and run lease: ``attempt = 0``, ``attempted_at`` cleared, its payload read and written
back the way awa-pg's runtime payload keeps it (``metadata``, ``tags`` and ``errors`` where not
empty, the progress dropped), its queue and priority as given or as they were. Due now, it is
enqueued as every retry is (:func:`~awa_sa.administer.statements.requeue.enqueued_again`: the
lane's next number, the ring cursor, a ``ready_segments`` entry, the queue's NOTIFY); due later,
it becomes a ``scheduled`` row of ``deferred_jobs`` and no NOTIFY. Either way its unique claim
is taken where the mask claims the new state and not ``failed``. A DLQ row is counted in no
terminal count, so no delta is written. ``bulk_retry_from_dlq`` does the same for every row
awa-pg's DLQ filter picks, each due now in its own queue and priority, in one insert: one
clock for all, one segment per lane, the lane numbers in the order awa-pg's DELETE returns
the rows.

The flow locks the rows first (``FOR UPDATE``: awa-pg's DELETE waits for a row another
transaction holds, and so does this), takes the claims, ensures the lanes, then sends one
statement that deletes and writes them all.
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
    bindparam,
    case,
    cast,
    column,
    delete,
    false,
    func,
    insert,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from awa_sa.administer.statements.dlq import dlq_filter
from awa_sa.administer.statements.failed_retry import claims_moved
from awa_sa.administer.statements.requeue import enqueued_again
from awa_sa.core.registry import statement
from awa_sa.core.sql import EMPTY_ARRAY, EMPTY_OBJECT, concat, state
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp

By = Literal["job", "filter"]


def _ids() -> ColumnElement[Any]:
    return bindparam("b_job_ids", type_=ARRAY(BigInteger))


def _to_queue(queue: ColumnElement[Any]) -> ColumnElement[Any]:
    """``b_to_queue``, or the row's own queue where it is NULL."""
    return func.coalesce(bindparam("b_to_queue", type_=Text), queue, type_=Text)


def _to_priority(priority: ColumnElement[Any]) -> ColumnElement[Any]:
    """``b_to_priority``, or the row's own priority where it is NULL."""
    given = cast(bindparam("b_to_priority", type_=SmallInteger), SmallInteger)
    return func.coalesce(given, priority, type_=SmallInteger)


@statement
def dlq_retry_targets(*, by: By) -> Select[Any]:
    """Lock the DLQ rows a retry takes: job ``b_job_id``'s, or every row awa-pg's filter picks
    (``b_kind``, ``b_queue``, ``b_tag``; the cursor binds NULL). Each with the lane it goes to
    and, for one job, whether ``b_run_at`` is still ahead of the clock (a ``scheduled`` row
    then, as awa-pg writes it for a ``run_at`` in the future).

    The filter's rows come in no ORDER BY, as awa-pg's DELETE returns them: the same WHERE on
    the same table gets the same plan, so the same order (with a queue, its index's: newest
    move first), which is the order awa-pg numbers them in."""
    d = qs.dlq_entries.c
    if by == "job":
        run_at = bindparam("b_run_at", type_=Timestamp)
        due_later = func.coalesce(run_at > func.clock_timestamp(), false())
        return (
            select(
                d.job_id,
                _to_queue(d.queue).label("to_queue"),
                _to_priority(d.priority).label("to_priority"),
                due_later.label("deferred"),
            )
            .where(d.job_id == bindparam("b_job_id", type_=BigInteger))
            .with_for_update()
        )
    return (
        select(
            d.job_id,
            d.queue.label("to_queue"),
            d.priority.label("to_priority"),
            false().label("deferred"),
        )
        .where(dlq_filter())
        .with_for_update()
    )


@statement
def dlq_retry_claims(*, deferred: bool) -> Select[Any]:
    """The unique claims of the locked DLQ rows ``b_job_ids`` as they become available (or
    scheduled): taken where the mask claims the new state but not ``failed``, released where
    the reverse, as awa-pg syncs them from ``failed`` whatever the row says; ``taken`` short
    of ``wanted`` is awa-pg's UniqueConflict."""
    d = qs.dlq_entries.c
    rows = (
        select(d.job_id, d.unique_key, d.unique_states, state("failed").label("state"))
        .where(d.job_id == func.any(_ids()))
        .cte("targets")
    )
    return claims_moved(rows, ("failed",), "scheduled" if deferred else "available")


def revived_payload(payload: ColumnElement[Any]) -> ColumnElement[Any]:
    """The payload as awa-pg's runtime payload writes it back after a DLQ retry: its
    ``metadata``, ``tags`` and ``errors``, each only when not empty, and nothing else (the
    progress cleared, unknown keys dropped); ``{}`` when none is left."""

    def kept(key: str, empty: ColumnElement[Any]) -> ColumnElement[Any]:
        value = payload.op("->", return_type=JSONB)(literal_column(f"'{key}'"))
        one = func.jsonb_build_object(literal_column(f"'{key}'"), value, type_=JSONB)
        return case((value != empty, one), else_=EMPTY_OBJECT)  # NULL, absent: left out

    return concat(
        kept("metadata", EMPTY_OBJECT), kept("tags", EMPTY_ARRAY), kept("errors", EMPTY_ARRAY)
    )


def _revived() -> CTE:
    """The locked rows ``b_job_ids`` deleted from the DLQ, as the job each becomes: its queue
    and priority (``b_to_queue``, ``b_to_priority`` where given), its payload revived, and its
    place ``ord`` in ``b_job_ids`` (the order the lane numbers follow)."""
    dlq = qs.dlq_entries
    gone = delete(dlq).where(dlq.c.job_id == func.any(_ids())).returning(*dlq.c).cte("revived")
    keys = func.unnest(_ids()).table_valued(column("job_id", BigInteger), with_ordinality="ord")
    keyed = keys.render_derived(name="keys")
    g = gone.c
    return (
        select(
            g.job_id,
            g.kind,
            _to_queue(g.queue).label("queue"),
            g.args,
            _to_priority(g.priority).label("priority"),
            g.run_lease,
            g.max_attempts,
            g.created_at,
            g.unique_key,
            g.unique_states,
            revived_payload(g.payload).label("payload"),
            keyed.c.ord,
        )
        .select_from(gone.join(keyed, keyed.c.job_id == g.job_id))
        .cte("revived_rows")
    )


@statement
def dlq_retry_ready() -> Select[Any]:
    """Delete the locked DLQ rows ``b_job_ids`` and enqueue each job again at the ring cursor
    (``b_ready_slot``, ...), due now, on the enqueue shard picked for its lane (``b_shard_ids``,
    ``b_shards``; else 0); answers the new ready rows by id."""
    revived = _revived()
    enqueued, enqueuing, told = enqueued_again(revived, order="ord", one_insert=True, sharded=True)
    return select(*enqueued.c, told.label("told")).order_by(enqueued.c.job_id).add_cte(*enqueuing)


@statement
def dlq_retry_deferred() -> Select[Any]:
    """Delete the locked DLQ row ``b_job_ids`` and write its job as a ``scheduled`` row of
    ``deferred_jobs``, due at ``b_run_at``; answers that row."""
    proj = _revived()
    p = proj.c
    deferred = qs.deferred_jobs
    values: dict[str, ColumnElement[Any]] = {
        "state": state("scheduled"),
        "attempt": cast(literal_column("0"), SmallInteger),
        "run_at": bindparam("b_run_at", type_=Timestamp),
        "attempted_at": cast(None, Timestamp),
        "finalized_at": cast(None, Timestamp),
        "payload": cast(case((p.payload == EMPTY_OBJECT, None), else_=p.payload), JSONB),
    }
    source = select(
        *(values[c.name].label(c.name) if c.name in values else p[c.name] for c in deferred.c)
    )
    written = (
        insert(deferred)
        .from_select([c.name for c in deferred.c], source)
        .returning(*deferred.c)
        .cte("written")
    )
    return select(*written.c).order_by(written.c.job_id)
