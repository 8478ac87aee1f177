"""Ending a queue-storage callback wait (a ``leases`` row), as awa-pg 0.6.9 does.

A handler that registers a callback has its attempt materialised into a ``S.leases`` row,
which ``WaitForCallback`` parks in ``waiting_external``. awa-pg's ``complete_external`` and
``fail_external`` delete the lease whose ``callback_id`` is the one given (``running`` too: the
callback may arrive before the handler parks), close its receipt with the call's outcome
(``completed``, ``failed``) under the receipt's advisory lock, read the job back from its ready
row, delete the attempt's ``attempt_state`` row, and file the terminal row in ``done_entries``
(ready-backed) with its ``+1`` delta and the unique claim moved from the lease's state to the
new one. The completed payload drops the progress; the failed one keeps the flushed progress
and appends the error entry ``{"error", "attempt", "at", "terminal": true}``.
``retry_external`` takes a parked wait only, closes its receipt as ``retryable`` and enqueues
the job again as the administering retry of a wait does, keeping its ``attempted_at``.

The lease is locked first (:func:`callback_lease`), as awa-pg's DELETE locks it, then the
receipt's advisory lock, then the claims and the one statement that writes the rest.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.administer.statements.callback_leases import (
    hydrated,
    job_row_after,
    receipts_closed,
)
from awa_sa.administer.statements.requeue import enqueued_again
from awa_sa.callbacks.statements.canonical import HELD, picked, seconds_from_now
from awa_sa.core.registry import statement
from awa_sa.core.sql import EMPTY_ARRAY, EMPTY_OBJECT, concat, state
from awa_sa.settle.statements.duplicate import insert_terminal_delta
from awa_sa.settle.statements.endings import rfc3339
from awa_sa.settle.statements.receipt_targets import json_key, text_literal
from awa_sa.settle.statements.receipt_writes import claims_in, insert_rows
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import job_unique_claims

Verb = Literal["complete", "fail", "retry"]
Ending = Literal["completed", "failed"]
_LANE = ("ready_slot", "ready_generation", "queue", "enqueue_shard", "lane_seq", "job_id")


def ready_of(lease: Any) -> ColumnElement[bool]:
    """The lease's ready row, by its lane position."""
    ready = qs.ready_entries.c
    return and_(*(ready[name] == lease.c[name] for name in _LANE))


@statement
def callback_lease(*, verb: Verb) -> Select[Any]:
    """Lock the lease waiting on callback ``b_callback_id`` (guarded by ``b_run_lease`` unless
    NULL) in a state *verb* takes: its job, run lease, lane and state, and its key and mask
    (from its ready row)."""
    lease, ready = qs.leases.alias("lease"), qs.ready_entries.c  # FOR UPDATE OF names it
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
        .select_from(lease.outerjoin(qs.ready_entries, ready_of(lease)))
        .where(picked(lease, verb))
        .order_by(lease.c.run_lease.desc())
        .with_for_update(of=lease)
    )


def _locked(verb: Verb) -> ColumnElement[bool]:
    """The lease :func:`callback_lease` locked: ``b_job_id`` and ``b_lease``, still held."""
    lease = qs.leases.c
    return and_(
        lease.job_id == bindparam("b_job_id", type_=BigInteger),
        lease.run_lease == bindparam("b_lease", type_=BigInteger),
        lease.state.in_([state(s) for s in HELD[verb]]),
    )


@statement
def ended_lease_claims(*, ending: Ending) -> Select[Any]:
    """The locked lease's unique claim moved from its state to *ending*, as awa-pg's
    ``sync_unique_claim``: released where the mask claims the old state but not the new,
    taken where the reverse (held by another job: ``taken`` falls short of ``wanted``, awa-pg's
    UniqueConflict, and nothing is written)."""
    lease, ready = qs.leases, qs.ready_entries.c
    t = (
        select(lease.c.job_id, cast(lease.c.state, Text).label("state"), ready.unique_key)
        .add_columns(ready.unique_states)
        .select_from(lease.join(qs.ready_entries, ready_of(lease)))
        .where(_locked("complete"), ready.unique_key.is_not(None))
        .cte("target")
    )
    old = claims_in(t.c.unique_states, t.c.state)
    new = claims_in(t.c.unique_states, ending)
    claims = job_unique_claims
    released = (
        delete(claims)
        .where(claims.c.unique_key == t.c.unique_key, claims.c.job_id == t.c.job_id, old, ~new)
        .returning(claims.c.job_id)
        .cte("released")
    )
    wanted = select(t.c.unique_key, t.c.job_id).where(new, ~old)
    taking = pg_insert(claims).from_select(["unique_key", "job_id"], wanted)
    taken = (
        taking.on_conflict_do_update(
            index_elements=["unique_key"],
            set_={"job_id": taking.excluded.job_id},
            where=claims.c.job_id == taking.excluded.job_id,
        )
        .returning(claims.c.job_id)
        .cte("taken")
    )

    def count(rows: Any) -> Any:
        return select(func.count()).select_from(rows).scalar_subquery()

    return select(
        count(wanted.subquery("wants")).label("wanted"),
        count(taken).label("taken"),
        count(released).label("released"),
    )


def _ended_payload(ending: Ending, h: Any, expression: bool) -> ColumnElement[Any]:
    """The done row's payload: the progress dropped for a completion; for a failure the
    flushed progress kept and the error entry appended (``b_error``, the attempt, the clock,
    ``terminal``, and with *expression* the ``b_expression`` that failed it)."""
    if ending == "completed":
        dropped: ColumnElement[Any] = h.c.payload.op("-", return_type=JSONB)(
            text_literal("progress")
        )
        return dropped
    entry = func.jsonb_build_object(
        text_literal("error"),
        cast(bindparam("b_error", type_=Text), Text),
        text_literal("attempt"),
        h.c.attempt,
        text_literal("at"),
        rfc3339(func.clock_timestamp()),
        text_literal("terminal"),
        true(),
        *(
            (text_literal("expression"), cast(bindparam("b_expression", type_=Text), Text))
            if expression
            else ()
        ),
        type_=JSONB,
    )
    errors = concat(json_key(h.c.payload, "errors", EMPTY_ARRAY), func.jsonb_build_array(entry))
    return concat(h.c.payload, func.jsonb_build_object(text_literal("errors"), errors))


@statement
def end_lease(*, ending: Ending) -> Select[Any]:
    """End the locked lease (``b_job_id``, ``b_lease``) as *ending*, as awa-pg's
    ``complete_external`` or ``fail_external`` does; answers the done row with what it shares
    with its ready row, or no row when the lease or its ready row is gone."""
    return ended_lease(ending, expression=False)


def ended_lease(ending: Ending, *, expression: bool) -> Select[Any]:
    """The body of :func:`end_lease`; with *expression*, a failure's entry names it."""
    gone, h = hydrated(_locked("complete"))
    done = qs.done_entries
    payload = _ended_payload(ending, h, expression)
    same_as_ready = and_(h.c.ready_priority == h.c.priority, payload == h.c.ready_payload)
    stored = case((or_(payload == EMPTY_OBJECT, same_as_ready), cast(null(), JSONB)), else_=payload)
    carried = ("ready_slot", "ready_generation", "job_id", "kind", "queue", "priority", "attempt")
    values: dict[str, ColumnElement[Any]] = {name: h.c[name] for name in carried}
    values |= {
        "state": state(ending),
        "run_lease": h.c.run_lease,
        "lane_seq": h.c.lane_seq,
        "enqueue_shard": h.c.enqueue_shard,
        "attempted_at": h.c.attempted_at,
        "finalized_at": func.clock_timestamp(),
        "payload": stored,
    }
    written = insert_rows(done, values).returning(*done.c).cte("written")
    w = written.c
    answer = select(*job_row_after(written, h), payload.label("payload")).select_from(
        written.join(h, h.c.job_id == w.job_id)
    )
    effects = [*receipts_closed(gone, ending), insert_terminal_delta(written)]
    return answer.add_cte(*effects)


@statement
def retry_callback_lease() -> Select[Any]:
    """Retry the locked parked lease (``b_job_id``, ``b_lease``) as awa-pg's
    ``retry_external``: the lease deleted and its receipt closed as ``retryable``, the job
    enqueued again at the ring cursor (``b_ready_slot``, ...) with its ``attempted_at``;
    answers the new ready row, or no row when the lease or its ready row is gone."""
    gone, h = hydrated(_locked("retry"))
    enqueued, enqueuing, told = enqueued_again(h, attempted=True)
    answer = select(*enqueued.c, told.label("told"))
    return answer.add_cte(*receipts_closed(gone, "retryable"), *enqueuing)


def _lease_answer(lease: Any, attempt: Any) -> Select[Any]:
    """The lease *lease* (a CTE of written ``leases`` rows) with its ready row and its
    ``attempt_state`` row *attempt* as awa-pg's ``load_active_lease`` reads them."""
    ready = qs.ready_entries
    r = ready.c
    heartbeat = func.coalesce(attempt.c.heartbeat_at, lease.c.heartbeat_at)
    return select(
        lease.c.job_id,
        r.kind,
        lease.c.queue,
        r.args,
        cast(lease.c.state, Text).label("state"),
        lease.c.priority,
        lease.c.attempt,
        lease.c.run_lease,
        lease.c.max_attempts,
        r.run_at,
        heartbeat.label("heartbeat_at"),
        lease.c.deadline_at,
        lease.c.attempted_at,
        cast(null(), qs.done_entries.c.finalized_at.type).label("finalized_at"),
        r.created_at,
        r.unique_key,
        lease.c.callback_id,
        lease.c.callback_timeout_at,
        attempt.c.callback_filter,
        attempt.c.callback_on_complete,
        attempt.c.callback_on_fail,
        attempt.c.callback_transform,
        func.coalesce(r.payload, EMPTY_OBJECT, type_=JSONB).label("payload"),
        attempt.c.progress,
        attempt.c.callback_result,
    ).select_from(
        lease.join(ready, ready_of(lease)).outerjoin(
            attempt,
            and_(attempt.c.job_id == lease.c.job_id, attempt.c.run_lease == lease.c.run_lease),
        )
    )


@statement
def resume_lease() -> Select[Any]:
    """Resume the wait on callback ``b_callback_id`` (guarded by ``b_run_lease`` unless NULL)
    as awa-pg's ``resume_external``: the lease back to ``running``, its callback cleared and
    its heartbeat now, and ``b_payload`` stored as the attempt's ``callback_result`` (its
    callback expressions cleared), for the handler's ``wait_for_callback``; answers the lease
    as awa-pg reads it back, or no row when no wait was found."""
    lease = qs.leases
    resumed = (
        update(lease)
        .where(picked(lease, "resume"))
        .values(
            state=state("running"),
            callback_id=null(),
            callback_timeout_at=null(),
            heartbeat_at=func.clock_timestamp(),
        )
        .returning(*lease.c)
        .cte("resumed")
    )
    attempt = qs.attempt_state
    result = cast(bindparam("b_payload", type_=Text), JSONB)
    cleared = {name: null() for name in _EXPRESSIONS}
    rows = select(
        resumed.c.job_id,
        resumed.c.run_lease,
        *(null().label(name) for name in _EXPRESSIONS),
        result.label("callback_result"),
        func.clock_timestamp().label("updated_at"),
    )
    upsert = pg_insert(attempt).from_select(
        ["job_id", "run_lease", *_EXPRESSIONS, "callback_result", "updated_at"], rows
    )
    stored = (
        upsert.on_conflict_do_update(
            index_elements=["job_id", "run_lease"],
            set_={
                **cleared,
                "callback_result": upsert.excluded.callback_result,
                "updated_at": func.clock_timestamp(),
            },
        )
        .returning(*attempt.c)
        .cte("stored")
    )
    return _lease_answer(resumed, stored)


_EXPRESSIONS = ("callback_filter", "callback_on_complete", "callback_on_fail", "callback_transform")


@statement
def heartbeat_lease() -> Select[Any]:
    """Extend the wait on callback ``b_callback_id`` to ``b_timeout`` seconds from now, as
    awa-pg's ``heartbeat_callback``; answers the lease as :func:`resume_lease` does."""
    lease = qs.leases
    beaten = (
        update(lease)
        .where(picked(lease, "heartbeat", guarded=False))
        .values(callback_timeout_at=func.clock_timestamp() + seconds_from_now())
        .returning(*lease.c)
        .cte("beaten")
    )
    attempt = qs.attempt_state.alias("attempt")
    return _lease_answer(beaten, attempt)
