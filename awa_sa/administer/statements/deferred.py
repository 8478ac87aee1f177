"""Cancelling a scheduled or retryable job of a queue-storage schema, as awa-pg 0.6.9 does.

A job waiting in ``S.deferred_jobs`` never entered a lane. awa-pg's cancel deletes its row and
files it as a terminal ``cancelled`` row of ``S.done_entries`` at the ring cursor, on shard 0
of its ``(queue, priority)`` lane (ensured first) under the synthetic ``lane_seq = -job_id``,
with the deferred row's own columns and payload, and one ``+1`` terminal-count delta is
appended. Before any of it the unique claim moves from the job's state to ``cancelled`` where the
mask says (:func:`deferred_claims`, awa-pg's ``sync_unique_claim``): released, or taken, which a
key another job holds refuses. The ring cursor and the lane steps are
:mod:`awa_sa.settle.statements.duplicate`'s, as for a cancelled duplicate; the rest is one
statement here. Every table reaches its schema through ``schema_translate_map``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Select,
    and_,
    bindparam,
    cast,
    delete,
    func,
    insert,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB

from awa_sa.administer.statements.canonical import cancel_notice
from awa_sa.administer.statements.failed_retry import claims_moved
from awa_sa.core.registry import statement
from awa_sa.core.sql import SHARD0, state
from awa_sa.settle.statements.duplicate import insert_terminal_delta
from awa_sa.tables import queue_storage as qs

DEFERRED = ("scheduled", "retryable")


def _deferred(job_id: ColumnElement[Any]) -> ColumnElement[bool]:
    d = qs.deferred_jobs.c
    return and_(d.job_id == job_id, d.state.in_([state(s) for s in DEFERRED]))


@statement
def deferred_lane() -> Select[Any]:
    """Lock the job's deferred row and read its lane, which the lane steps ensure first."""
    d = qs.deferred_jobs.c
    job_id = bindparam("b_job_id", type_=BigInteger)
    return select(d.queue, d.priority).where(_deferred(job_id)).with_for_update()


@statement
def cancel_deferred() -> Select[Any]:
    """Delete the deferred row, file it cancelled, append the delta (its claim moved first).

    Answers the ``done_entries`` row written, or no row when the job was no longer deferred.
    """
    job_id = bindparam("b_job_id", type_=BigInteger)
    gone = delete(qs.deferred_jobs).where(_deferred(job_id)).returning(*qs.deferred_jobs.c)
    old = gone.cte("gone")
    done = qs.done_entries
    values: dict[str, ColumnElement[Any]] = {
        "ready_slot": cast(bindparam("b_ready_slot", type_=BigInteger), done.c.ready_slot.type),
        "ready_generation": bindparam("b_ready_generation", type_=BigInteger),
        "state": state("cancelled"),
        "lane_seq": -old.c.job_id,
        "enqueue_shard": SHARD0,
        "finalized_at": func.clock_timestamp(),
    }
    columns = [values[c.name].label(c.name) if c.name in values else old.c[c.name] for c in done.c]
    written = (
        insert(done)
        .from_select([c.name for c in done.c], select(*columns).select_from(old))
        .returning(*done.c)
        .cte("written")
    )
    delta = insert_terminal_delta(written)
    return select(*written.c).select_from(written.join(delta, true()))


@statement
def deferred_claims() -> Select[Any]:
    """The deferred job's claim as it becomes ``cancelled``, as awa-pg's ``sync_unique_claim``
    moves it before the cancelled row: released where the mask claims its state but not
    ``cancelled``, taken where the reverse (``taken`` short of ``wanted``: another job holds
    the key, awa-pg's UniqueConflict)."""
    d = qs.deferred_jobs.c
    job_id = bindparam("b_job_id", type_=BigInteger)
    targets = select(d.job_id, d.state, d.unique_key, d.unique_states).where(_deferred(job_id))
    return claims_moved(targets.cte("targets"), DEFERRED, "cancelled")


def done_job_fields(row: Any, **lacking: Any) -> dict[str, Any]:
    """A ``done_entries`` row as :class:`~awa_sa.administer.statements.canonical.JobRow`'s fields:
    errors, metadata, tags and progress from its payload, as awa-pg builds its ``JobRow``.

    Another queue-storage row serves too, given the columns it does not carry as *lacking*
    (a ``ready_entries`` row: its state, ``finalized_at`` and ``unique_states``)."""
    values = {**row._mapping, **lacking}
    payload = values["payload"] or {}
    return {
        "id": values["job_id"],
        "kind": values["kind"],
        "queue": values["queue"],
        "args": values["args"],
        "state": values["state"],
        "priority": values["priority"],
        "attempt": values["attempt"],
        "max_attempts": values["max_attempts"],
        "run_at": values["run_at"],
        "heartbeat_at": None,
        "deadline_at": None,
        "attempted_at": values["attempted_at"],
        "finalized_at": values["finalized_at"],
        "created_at": values["created_at"],
        "errors": list(payload.get("errors") or []),
        "metadata": payload.get("metadata") or {},
        "tags": list(payload.get("tags") or []),
        "unique_key": None if values["unique_key"] is None else bytes(values["unique_key"]),
        "unique_states": values["unique_states"],
        "callback_id": None,
        "callback_timeout_at": None,
        "callback_filter": None,
        "callback_on_complete": None,
        "callback_on_fail": None,
        "callback_transform": None,
        "run_lease": values["run_lease"],
        "progress": payload.get("progress"),
    }


@statement
def cancel_notify() -> Select[Any]:
    """The ``awa:cancel`` NOTIFY of a running queue-storage attempt, after its receipt closed."""
    job_id = bindparam("b_job_id", type_=BigInteger)
    run_lease = bindparam("b_run_lease", type_=BigInteger)
    return select(cancel_notice(job_id, run_lease))


@statement
def cancelled_attempt() -> Select[Any]:
    """The cancelled attempt's terminal row, joined back to its ready row as Awa's
    ``terminal_jobs`` view does (a ready-backed row stores only what the ready row lacks)."""
    done, ready = qs.done_entries.c, qs.ready_entries.c
    payload = func.coalesce(done.payload, ready.payload, type_=JSONB)
    lane = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "lane_seq")
    return (
        select(
            done.job_id,
            ready.kind,
            done.queue,
            ready.args,
            done.state,
            done.priority,
            done.attempt,
            done.run_lease,
            ready.max_attempts,
            ready.run_at,
            done.attempted_at,
            done.finalized_at,
            ready.created_at,
            ready.unique_key,
            ready.unique_states,
            payload.label("payload"),
        )
        .select_from(
            qs.done_entries.join(
                qs.ready_entries, and_(*(done[name] == ready[name] for name in lane))
            )
        )
        .where(
            done.job_id == bindparam("b_job_id", type_=BigInteger),
            done.run_lease == bindparam("b_run_lease", type_=BigInteger),
            done.state == state("cancelled"),
        )
    )
