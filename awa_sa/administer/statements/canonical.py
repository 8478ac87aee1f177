"""Administering canonical jobs: cancel, retry, bulk retry and discard of failed jobs.

awa-pg 0.6.9 does these through the ``awa.jobs`` view, whose INSTEAD OF trigger
(``awa.write_jobs_view``) turns every UPDATE of a row into a DELETE from the table that held it
(``scheduled_jobs`` for scheduled and retryable, else ``jobs_hot``) and an INSERT of the new row
into the table its new state belongs to, and a DELETE into a DELETE. Once routing points at
queue storage the view raises on UPDATE and no longer lists canonical rows, so these
statements write the physical tables themselves, the same DELETE and INSERT, which fire the
same row triggers (unique claims, the new-job NOTIFY) in the same order for each row.

Each statement runs after the routing lock (``statements.canonical.routing_lock``) and reads
routing afresh first: it touches nothing when routing is queue storage, and its first row says
so (``routing_schema``). Then one row per job written, as the new row reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    LargeBinary,
    Select,
    Table,
    Text,
    bindparam,
    cast,
    delete,
    func,
    insert,
    literal_column,
    null,
    select,
    true,
)

from awa_sa.core.job_rows import JobRow
from awa_sa.core.registry import statement
from awa_sa.core.sql import head_row, scalar, state
from awa_sa.tables.canonical import CALLBACK_COLUMNS, jobs_hot, scheduled_jobs

TERMINAL = ("completed", "failed", "cancelled")
LIVE_ATTEMPT = ("running", "waiting_external")
"""Prior states whose attempt a handler may still be running: a cancel tells it to stop."""
RETRYABLE = ("failed", "cancelled", "waiting_external")
"""What awa-pg's ``retry`` takes back to available."""

__all__ = [
    "JobRow",
    "cancel_job_canonical",
    "discard_failed_canonical",
    "job_rows",
    "retry_failed_canonical",
    "retry_job_canonical",
    "unique_holder_canonical",
]

By = Literal["kind", "queue"]


def _routing(routed: bool) -> CTE:
    """The first row: the queue-storage schema routing points at, read after the lock."""
    schema: ColumnElement[Any] = (
        func.awa.active_queue_storage_schema(type_=Text) if routed else cast(null(), Text)
    )
    return head_row(schema.label("routing_schema"))


def _states(names: Sequence[str]) -> list[ColumnElement[Any]]:
    return [state(name) for name in names]


def _taken(table: Table, head: CTE, where: ColumnElement[bool], name: str) -> CTE:
    """DELETE the rows of *table* that *where* picks, only while routing is canonical."""
    unrouted = scalar(head, "routing_schema").is_(None)
    return delete(table).where(where, unrouted).returning(*table.c).cte(name)


def _reinserted(old: Any, changed: dict[str, ColumnElement[Any]]) -> CTE:
    """INSERT into ``jobs_hot`` each deleted row with *changed* columns: the view's UPDATE."""
    columns = [
        changed[c.name].label(c.name) if c.name in changed else old.c[c.name] for c in jobs_hot.c
    ]
    return (
        insert(jobs_hot)
        .from_select([c.name for c in jobs_hot.c], select(*columns).select_from(old))
        .returning(*jobs_hot.c)
        .cte("written")
    )


def _no_callback() -> dict[str, ColumnElement[Any]]:
    return {name: null() for name in CALLBACK_COLUMNS}


def _job_id() -> ColumnElement[Any]:
    return bindparam("b_job_id", type_=BigInteger)


def _answer(head: CTE, written: CTE, *extra: ColumnElement[Any]) -> Select[Any]:
    """The head row, then one row per job written (NULLs after the head when none was)."""
    return select(*head.c, *written.c, *extra).select_from(head.outerjoin(written, true()))


def cancel_notice(job_id: ColumnElement[Any], run_lease: ColumnElement[Any]) -> Any:
    """``pg_notify('awa:cancel', '{"job_id":N,"run_lease":M}')``: awa-pg's text, byte for byte
    (serde_json writes no spaces), which a runtime running that attempt acts on at commit."""
    payload = func.concat(
        literal_column("""'{"job_id":'"""),
        job_id,
        literal_column("""',"run_lease":'"""),
        run_lease,
        literal_column("'}'"),
        type_=Text,
    )
    return func.pg_notify(literal_column("'awa:cancel'"), payload, type_=Text)


@statement
def cancel_job_canonical(*, routed: bool) -> Select[Any]:
    """Cancel the canonical job ``b_job_id`` in any state that is not terminal.

    awa-pg's ``UPDATE awa.jobs SET state = 'cancelled', finalized_at = now(), callback_* =
    NULL WHERE id = $1 AND state NOT IN (terminal)``, as the view writes it; and, when the
    job was running or waiting on a callback, its ``awa:cancel`` NOTIFY (``notified``).
    """
    head = _routing(routed)
    live = jobs_hot.c.state.not_in(_states(TERMINAL))
    hot = _taken(jobs_hot, head, (jobs_hot.c.id == _job_id()) & live, "hot")
    waiting = scheduled_jobs.c.state.not_in(_states(TERMINAL))
    parked = _taken(scheduled_jobs, head, (scheduled_jobs.c.id == _job_id()) & waiting, "parked")
    old = select(hot).union_all(select(parked)).cte("old")
    written = _reinserted(
        old,
        {"state": state("cancelled"), "finalized_at": func.now(), **_no_callback()},
    )
    prior = old.c.state.in_(_states(LIVE_ATTEMPT))
    notice = select(cancel_notice(old.c.id, old.c.run_lease)).where(prior).scalar_subquery()
    return _answer(head, written, notice.label("notified"))


PENDING = ("available", "scheduled", "retryable", "waiting_external")


@statement
def drain_queue_canonical(*, routed: bool) -> Select[Any]:
    """Cancel every pending job of queue ``b_key``: awa-pg's ``UPDATE awa.jobs SET state =
    'cancelled', finalized_at = now(), callback_* = NULL WHERE queue = $1 AND state IN
    (available, scheduled, retryable, waiting_external)``, as the view writes it (no NOTIFY)."""
    head = _routing(routed)
    key = bindparam("b_key", type_=Text)
    picked = [
        _taken(t, head, (t.c.queue == key) & t.c.state.in_(_states(PENDING)), name)
        for t, name in ((jobs_hot, "hot"), (scheduled_jobs, "parked"))
    ]
    old = select(picked[0]).union_all(select(picked[1])).cte("old")
    written = _reinserted(
        old,
        {"state": state("cancelled"), "finalized_at": func.now(), **_no_callback()},
    )
    return _answer(head, written)


@statement
def retry_job_canonical(*, routed: bool) -> Select[Any]:
    """Take the canonical job ``b_job_id`` back to available, if failed, cancelled or waiting.

    awa-pg's ``UPDATE awa.jobs SET state = 'available', attempt = 0, run_at = now(),
    finalized_at, heartbeat_at, deadline_at, callback_* = NULL WHERE id = $1 AND state IN
    (failed, cancelled, waiting_external)``. Those states live in ``jobs_hot`` only.
    """
    head = _routing(routed)
    picked = (jobs_hot.c.id == _job_id()) & jobs_hot.c.state.in_(_states(RETRYABLE))
    old = _taken(jobs_hot, head, picked, "old")
    return _answer(head, _reinserted(old, {**_available(), **_no_callback()}))


def _available() -> dict[str, ColumnElement[Any]]:
    return {
        "state": state("available"),
        "attempt": literal_column("0"),
        "run_at": func.now(),
        "finalized_at": null(),
        "heartbeat_at": null(),
        "deadline_at": null(),
    }


@statement
def retry_failed_canonical(*, routed: bool, by: By) -> Select[Any]:
    """Take every failed canonical job of kind (or queue) ``b_key`` back to available.

    awa-pg's ``retry_failed_by_kind`` / ``_by_queue``: the same SET as a retry but the
    callback columns, on ``state = 'failed'``; one statement for them all.
    """
    head = _routing(routed)
    key = bindparam("b_key", type_=Text)
    picked = (jobs_hot.c[by] == key) & (jobs_hot.c.state == state("failed"))
    old = _taken(jobs_hot, head, picked, "old")
    return _answer(head, _reinserted(old, _available()))


@statement
def discard_failed_canonical(*, routed: bool) -> Select[Any]:
    """Delete every failed canonical job of kind ``b_key``: awa-pg's ``DELETE FROM awa.jobs
    WHERE kind = $1 AND state = 'failed'``, which the view sends to ``jobs_hot``."""
    head = _routing(routed)
    key = bindparam("b_key", type_=Text)
    picked = (jobs_hot.c.kind == key) & (jobs_hot.c.state == state("failed"))
    old = _taken(jobs_hot, head, picked, "old")
    gone = select(func.count()).select_from(old).scalar_subquery()
    return select(*head.c, gone.label("discarded"))


def job_rows(rows: Sequence[Any], storage: str) -> list[JobRow]:
    """The jobs after the head row of an administering statement's answer."""
    names = [c.name for c in jobs_hot.c]
    found = []
    for row in rows:
        values = row._mapping
        if values["id"] is None:
            continue
        fields = {name: values[name] for name in names}
        fields["errors"] = list(fields["errors"] or [])
        fields["tags"] = list(fields["tags"])
        fields["unique_key"] = None if fields["unique_key"] is None else bytes(fields["unique_key"])
        found.append(JobRow(**fields, storage=storage))
    return sorted(found, key=lambda job: job.id)


@statement
def unique_holder_canonical(*, routed: bool) -> Select[Any]:
    """The routing schema, and the oldest canonical job with key ``b_unique_key`` that is not
    terminal (``job_id``, NULL when none), as awa-pg's ``cancel_by_unique_key`` picks it: the
    lowest id of either table, read without a lock (the cancel then locks and re-checks it)."""
    head = _routing(routed)
    key = bindparam("b_unique_key", type_=LargeBinary)
    found = [
        select(table.c.id).where(
            (table.c.unique_key == key) & table.c.state.not_in(_states(TERMINAL))
        )
        for table in (jobs_hot, scheduled_jobs)
    ]
    oldest = found[0].union_all(found[1]).order_by("id").limit(literal_column("1")).subquery("held")
    return select(head.c.routing_schema, select(oldest.c.id).scalar_subquery().label("job_id"))
