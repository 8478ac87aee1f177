"""Cancelling and retrying a queue-storage job that waits on a callback, as awa-pg 0.6.9 does.

A handler that registers a callback has its attempt materialised into a ``S.leases`` row (the
receipt it was claimed under stays, its ``materialized_at`` set); returning ``WaitForCallback``
parks that row in ``waiting_external``. awa-pg's cancel deletes the job's lease while it is
``running`` or ``waiting_external``, its retry while it is ``waiting_external``, and then does
what it does for every lease it deletes: reads the job back from its ready row, deletes the
attempt's ``attempt_state`` row (a flushed progress goes into the payload), and closes the
receipt as ``rescue`` (a closure row, and ``closed_at``). Then the cancel files a ready-backed
``cancelled`` row in ``done_entries`` (the payload stored unless empty or the ready row's own),
appends its ``+1`` terminal delta and sends the ``awa:cancel`` NOTIFY, its unique claim moved
from the lease's state to ``cancelled`` first (:func:`lease_claims_cancelled`); the retry
enqueues the job again as a failed job's retry does
(:func:`~awa_sa.administer.statements.requeue.enqueued_again`), after its claim
(:func:`lease_claims_retried`). awa-pg's bulk retry of failed jobs retries each matched job's
wait this way, where it has one, and leaves that job's failed row (:func:`resumed_targets`,
:func:`retry_done_resuming`). Observed on a real cluster and compared (docs/administer.md).
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    CTE,
    BigInteger,
    Boolean,
    ColumnElement,
    Integer,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
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
from sqlalchemy.dialects.postgresql import ARRAY, INT8MULTIRANGE, JSONB, aggregate_order_by

from awa_sa.administer.statements.canonical import cancel_notice
from awa_sa.administer.statements.failed_retry import (
    claims_moved,
    close_removed_receipts,
    failed_jobs,
    failed_removed,
)
from awa_sa.administer.statements.requeue import enqueued_again
from awa_sa.core.registry import statement
from awa_sa.core.sql import EMPTY_ARRAY, EMPTY_OBJECT, concat, state
from awa_sa.settle.statements.duplicate import insert_terminal_delta
from awa_sa.settle.statements.receipt_targets import json_key, text_literal
from awa_sa.settle.statements.receipt_writes import insert_rows
from awa_sa.tables import queue_storage as qs

Verb = Literal["cancel", "retry"]
HELD = {"cancel": ("running", "waiting_external"), "retry": ("waiting_external",)}
"""The lease states each verb takes, as awa-pg's statements name them."""
_LANE = ("ready_slot", "ready_generation", "queue", "enqueue_shard", "lane_seq", "job_id")
_NULL_JSON = cast(text_literal("null"), JSONB)


def receipts_closed(gone: CTE, outcome: str = "rescue", prefix: str = "") -> list[CTE]:
    """The deleted lease's receipt closed as *outcome*: ``rescue``, as awa-pg closes the
    receipt of every lease it deletes, or the callback's own ending (``completed``, ...), which
    awa-pg's callback calls write first: a ``lease_claims`` row (closure and ``closed_at``), or
    a compact one (a closure batch per claim batch, unless some closure already names it)."""
    batch = qs.lease_claim_batches.alias("claim_batches")
    items = (
        func.unnest(batch.c.job_ids, batch.c.run_leases, batch.c.receipt_ids)
        .table_valued(
            column("job_id", BigInteger),
            column("run_lease", BigInteger),
            column("receipt_id", BigInteger),
        )
        .render_derived(name="items")
    )
    i = items.c
    closures, ranges = qs.lease_claim_closures, qs.lease_claim_closure_batches
    open_items = (
        select(batch.c.claim_slot, batch.c.ready_slot, batch.c.ready_generation, i.receipt_id)
        .select_from(
            batch.join(items, true()).join(
                gone, and_(gone.c.job_id == i.job_id, gone.c.run_lease == i.run_lease)
            )
        )
        .where(
            ~exists().where(
                closures.c.claim_slot == batch.c.claim_slot,
                closures.c.job_id == i.job_id,
                closures.c.run_lease == i.run_lease,
            ),
            ~exists().where(
                ranges.c.claim_slot == batch.c.claim_slot,
                ranges.c.receipt_ranges.op("@>", return_type=Boolean)(i.receipt_id),
            ),
        )
        .cte(f"{prefix}batch_claims")
    )
    o = open_items.c
    ordered = o.receipt_id.asc()
    one_range = func.int8range(o.receipt_id, o.receipt_id + literal_column("1"), text_literal("[)"))
    closed = (
        insert(ranges)
        .from_select(
            [
                "claim_slot",
                "ready_slot",
                "ready_generation",
                "outcome",
                "closed_count",
                "receipt_ids",
                "receipt_ranges",
                "closed_at",
            ],
            select(
                o.claim_slot,
                o.ready_slot,
                o.ready_generation,
                text_literal(outcome),
                cast(func.count(), Integer),
                func.array_agg(aggregate_order_by(o.receipt_id, ordered)),
                func.range_agg(aggregate_order_by(one_range, ordered), type_=INT8MULTIRANGE),
                func.clock_timestamp(),
            ).group_by(o.claim_slot, o.ready_slot, o.ready_generation),
        )
        .returning(ranges.c.claim_slot)
        .cte(f"{prefix}inserted_batches")
    )
    return [close_removed_receipts(gone, outcome, prefix=prefix), closed]


def job_row_after(written: CTE, h: CTE) -> list[ColumnElement[Any]]:
    """A waiting job's row once its lease ended in a ``done_entries`` row, its payload aside:
    what the done row says, and what the hydrated lease (:func:`hydrated`) carried."""
    w = written.c
    return [
        w.job_id,
        h.c.kind,
        w.queue,
        h.c.args,
        w.state,
        w.priority,
        w.attempt,
        w.run_lease,
        h.c.max_attempts,
        h.c.run_at,
        w.attempted_at,
        w.finalized_at,
        h.c.created_at,
        h.c.unique_key,
        h.c.unique_states,
    ]


def _leased(verb: Verb, table: Any = qs.leases, *, many: bool = False) -> ColumnElement[bool]:
    """The job's lease in a state *verb* takes; with *many*, the leases of ``b_lease_ids``."""
    lease = table.c
    if many:
        chosen = lease.job_id == func.any(bindparam("b_lease_ids", type_=ARRAY(BigInteger)))
    else:
        chosen = lease.job_id == bindparam("b_job_id", type_=BigInteger)
    return and_(chosen, lease.state.in_([state(s) for s in HELD[verb]]))


def _ready_of(lease: Any) -> ColumnElement[bool]:
    ready = qs.ready_entries.c
    return and_(*(ready[name] == lease.c[name] for name in _LANE))


@statement
def lease_target(*, verb: Verb) -> Select[Any]:
    """Lock the job's lease: its lane, state and run lease, and its key and mask (from its
    ready row)."""
    # An alias: FOR UPDATE OF names it unqualified, as the schema translation needs.
    lease, ready = qs.leases.alias("lease"), qs.ready_entries.c
    return (
        select(
            lease.c.job_id,
            lease.c.run_lease,
            lease.c.queue,
            lease.c.priority,
            cast(lease.c.state, Text).label("state"),
            ready.unique_key,
            ready.unique_states,
        )
        .select_from(lease.outerjoin(qs.ready_entries, _ready_of(lease)))
        .where(_leased(verb, lease))
        .with_for_update(of=lease)
    )


def runtime_payload(payload: Any, progress: Any) -> ColumnElement[Any]:
    """The payload as awa-pg rewrites it: metadata, tags, errors and progress, each only when
    not empty, the attempt's flushed progress over the stored one."""

    def part(key: str, value: Any, empty: ColumnElement[Any]) -> Any:
        obj = func.jsonb_build_object(text_literal(key), value, type_=JSONB)
        return case((func.coalesce(value, empty, type_=JSONB) != empty, obj), else_=EMPTY_OBJECT)

    flushed = func.coalesce(progress, json_key(payload, "progress", _NULL_JSON), type_=JSONB)
    return concat(
        part("metadata", json_key(payload, "metadata", EMPTY_OBJECT), EMPTY_OBJECT),
        part("tags", json_key(payload, "tags", EMPTY_ARRAY), EMPTY_ARRAY),
        part("errors", json_key(payload, "errors", EMPTY_ARRAY), EMPTY_ARRAY),
        part("progress", flushed, _NULL_JSON),
    )


def _hydrated(verb: Verb, *, many: bool = False) -> tuple[CTE, CTE]:
    return hydrated(_leased(verb, many=many))


def hydrated(leased: ColumnElement[bool]) -> tuple[CTE, CTE]:
    """The leases *leased* picks deleted (``gone``) and each job read back from its ready row,
    its ``attempt_state`` row deleted (``hydrated``), as awa-pg hydrates a deleted lease."""
    gone = delete(qs.leases).where(leased).returning(*qs.leases.c).cte("gone")
    attempt = qs.attempt_state
    flushed = (
        delete(attempt)
        .where(attempt.c.job_id == gone.c.job_id, attempt.c.run_lease == gone.c.run_lease)
        .returning(attempt.c.job_id, attempt.c.run_lease, attempt.c.progress)
        .cte("flushed")
    )
    ready = qs.ready_entries.c
    ready_payload = func.coalesce(ready.payload, EMPTY_OBJECT, type_=JSONB)
    hydrated = (
        select(
            *gone.c,
            ready.kind,
            ready.args,
            ready.run_at,
            ready.created_at,
            ready.unique_key,
            ready.unique_states,
            ready.priority.label("ready_priority"),
            ready_payload.label("ready_payload"),
            runtime_payload(ready_payload, flushed.c.progress).label("payload"),
        )
        .select_from(
            gone.join(qs.ready_entries, _ready_of(gone)).outerjoin(
                flushed,
                and_(flushed.c.job_id == gone.c.job_id, flushed.c.run_lease == gone.c.run_lease),
            )
        )
        .cte("hydrated")
    )
    return gone, hydrated


@statement
def cancel_lease() -> Select[Any]:
    """Cancel the job's lease as awa-pg does; answers the cancelled row with what it shares
    with its ready row, or no row when the job had no such lease."""
    gone, h = _hydrated("cancel")
    done = qs.done_entries
    same_as_ready = and_(h.c.ready_priority == h.c.priority, h.c.payload == h.c.ready_payload)
    stored = case(
        (or_(h.c.payload == EMPTY_OBJECT, same_as_ready), cast(null(), JSONB)),
        else_=h.c.payload,
    )
    carried = ("ready_slot", "ready_generation", "job_id", "kind", "queue", "priority", "attempt")
    values: dict[str, ColumnElement[Any]] = {name: h.c[name] for name in carried}
    values |= {
        "state": state("cancelled"),
        "run_lease": h.c.run_lease,
        "lane_seq": h.c.lane_seq,
        "enqueue_shard": h.c.enqueue_shard,
        "attempted_at": h.c.attempted_at,
        "finalized_at": func.clock_timestamp(),
        "payload": stored,
    }
    written = insert_rows(done, values).returning(*done.c).cte("written")
    w = written.c
    answer = select(
        *job_row_after(written, h),
        h.c.payload,
        cancel_notice(w.job_id, w.run_lease).label("notified"),
    ).select_from(written.join(h, h.c.job_id == w.job_id))
    effects = [*receipts_closed(gone), insert_terminal_delta(written)]
    return answer.add_cte(*effects)


def _lease_targets(leased: ColumnElement[bool]) -> CTE:
    """The leases *leased* picks, with their ready rows' key and mask."""
    lease, ready = qs.leases, qs.ready_entries.c
    return (
        select(lease.c.job_id, lease.c.state, ready.unique_key, ready.unique_states)
        .select_from(lease.join(qs.ready_entries, _ready_of(lease)))
        .where(leased)
        .cte("targets")
    )


@statement
def lease_claims_retried() -> Select[Any]:
    """The claims of the leases of ``b_job_ids`` as they become available again (as
    :func:`~awa_sa.administer.statements.failed_retry.retry_claims` counts them)."""
    ids = bindparam("b_job_ids", type_=ARRAY(BigInteger))
    leased = and_(
        qs.leases.c.job_id == func.any(ids), qs.leases.c.state == state("waiting_external")
    )
    return claims_moved(_lease_targets(leased), HELD["retry"])


@statement
def lease_claims_cancelled() -> Select[Any]:
    """The claim of the job's lease as it becomes ``cancelled``, as awa-pg's
    ``sync_unique_claim`` moves it before the cancelled row (``taken`` short of ``wanted``:
    another job holds the key, awa-pg's UniqueConflict)."""
    return claims_moved(_lease_targets(_leased("cancel")), HELD["cancel"], "cancelled")


@statement
def retry_lease() -> Select[Any]:
    """Retry the job's callback wait as awa-pg does: the lease deleted and its receipt closed,
    the job enqueued again at the ring cursor (``b_ready_slot``, ...); answers the new ready
    row, or no row when the job waited on no callback."""
    gone, h = _hydrated("retry")
    enqueued, enqueuing, told = enqueued_again(h)
    answer = select(*enqueued.c, told.label("told"))
    return answer.add_cte(*receipts_closed(gone), *enqueuing)


@statement
def resumed_targets(*, by: Literal["kind", "queue"]) -> Select[Any]:
    """Lock the callback waits of the jobs with a failed row of kind or queue ``b_key``
    (``FOR UPDATE``, as awa-pg's ``DELETE`` of each waits): their ids and lanes. awa-pg's bulk
    retry retries such a job's wait, not its failed row (:func:`retry_done_resuming`)."""
    lease = qs.leases.alias("lease")  # FOR UPDATE OF names it unqualified
    return (
        select(lease.c.job_id, lease.c.run_lease, lease.c.queue, lease.c.priority)
        .where(
            lease.c.job_id.in_(failed_jobs(by)),
            lease.c.state == state("waiting_external"),
        )
        .order_by(lease.c.job_id)
        .with_for_update(of=lease)
    )


@statement
def retry_done_resuming() -> Select[Any]:
    """:func:`~awa_sa.administer.statements.failed_retry.retry_done` for the failed rows of
    ``b_job_ids``, and :func:`retry_lease` for the callback waits of ``b_lease_ids`` (their
    failed rows left as they are, as awa-pg leaves them), every job enqueued again in one id
    order, as awa-pg's job-by-job loop numbers them, each on the shard picked for it
    (``b_shard_ids``, ``b_shards``); answers the new ready rows by id."""
    removed, effects = failed_removed()
    gone, h = _hydrated("retry", many=True)
    carried = (
        "job_id",
        "kind",
        "queue",
        "args",
        "priority",
        "run_lease",
        "max_attempts",
        "created_at",
        "unique_key",
        "unique_states",
        "payload",
    )
    both = union_all(
        select(*(removed.c[name] for name in carried)),
        select(*(h.c[name] for name in carried)),
    ).cte("retried")
    enqueued, enqueuing, told = enqueued_again(both, sharded=True)
    answer = select(*enqueued.c, told.label("told")).order_by(enqueued.c.job_id)
    return answer.add_cte(*effects, *receipts_closed(gone, prefix="lease_"), *enqueuing)
