"""Ending a canonical callback wait, as awa-pg 0.6.9 does.

awa-pg's callback calls write ``awa.jobs_hot`` in place (one UPDATE, not through the
``awa.jobs`` view): a callback waits only on a running or ``waiting_external`` row, and those
live there. Each statement runs after the routing lock and reads routing afresh first: it
touches nothing when routing is queue storage (awa-pg then looks for the callback there, and
only there), and its first row says so (``routing_schema``). Then the row written, if any.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Select,
    Text,
    Uuid,
    and_,
    bindparam,
    cast,
    func,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB

from awa_sa.core.registry import statement
from awa_sa.core.sql import head_row, head_then, scalar, state, text_param_as
from awa_sa.settle.statements.endings import rfc3339
from awa_sa.tables.canonical import CALLBACK_COLUMNS, jobs_hot

Verb = Literal["complete", "fail", "retry", "resume"]
WAITS = ("waiting_external", "running")
HELD: dict[str, tuple[str, ...]] = {
    "complete": WAITS,
    "fail": WAITS,
    "resume": WAITS,
    "retry": ("waiting_external",),
    "heartbeat": ("waiting_external",),
}
"""The states each call takes, as awa-pg's statements name them: a callback may arrive before
its handler parks (``running``), except for a retry, which would run the job twice, and a
heartbeat, which only extends a wait."""


def callback_id_param() -> ColumnElement[Any]:
    """``b_callback_id``, sent as text and cast: the same on every driver."""
    return text_param_as("b_callback_id", Uuid())


def run_lease_param() -> ColumnElement[Any]:
    """``b_run_lease``, the optional guard (NULL: any run lease), typed for every driver."""
    return cast(bindparam("b_run_lease", type_=BigInteger), BigInteger)


def picked(table: Any, verb: str, *, guarded: bool = True) -> ColumnElement[bool]:
    """awa-pg's WHERE: ``callback_id = $1 AND state IN (...) AND ($2 IS NULL OR run_lease =
    $2)`` (a heartbeat has no run-lease guard)."""
    c = table.c
    found: ColumnElement[bool] = and_(
        c.callback_id == callback_id_param(), c.state.in_([state(s) for s in HELD[verb]])
    )
    if not guarded:
        return found
    lease = run_lease_param()
    return and_(found, or_(lease.is_(None), c.run_lease == lease))


def appended(errors: ColumnElement[Any], entry: ColumnElement[Any]) -> ColumnElement[Any]:
    """``errors || entry``: the entry appended to the ``jsonb[]`` column."""
    append: Any = errors.op("||", return_type=ARRAY(JSONB))
    return cast(append(entry), ARRAY(JSONB))


def seconds_from_now() -> ColumnElement[Any]:
    """``make_interval(secs => b_timeout)``, the seconds a heartbeat extends a wait by."""
    zero: ColumnElement[Any] = literal_column("0")
    seconds = cast(bindparam("b_timeout", type_=Float), Float)
    return func.make_interval(zero, zero, zero, zero, zero, zero, seconds, type_=INTERVAL)


def routing_head(routed: bool) -> Any:
    """The statement's first row: the routing schema read afresh (NULL while canonical)."""
    schema: ColumnElement[Any] = (
        func.awa.active_queue_storage_schema(type_=Text) if routed else cast(null(), Text)
    )
    return head_row(schema.label("routing_schema"))


def _cleared() -> dict[str, Any]:
    return {name: null() for name in CALLBACK_COLUMNS}


def failed_values(*, expression: bool) -> dict[str, Any]:
    """The SET of awa-pg's UPDATE to ``failed``: the error entry ``{"error": b_error,
    "attempt", "at"}`` appended, with ``"expression": b_expression`` where a callback's
    ``on_fail`` expression failed it (``resolve_callback``)."""
    fields: list[ColumnElement[Any]] = [
        literal_column("'error'"),
        cast(bindparam("b_error", type_=Text), Text),
        literal_column("'attempt'"),
        jobs_hot.c.attempt,
        literal_column("'at'"),
        rfc3339(func.now()),
    ]
    if expression:
        named = cast(bindparam("b_expression", type_=Text), Text)
        fields += [literal_column("'expression'"), named]
    entry = func.jsonb_build_object(*fields, type_=JSONB)
    return {
        "state": state("failed"),
        "finalized_at": func.now(),
        **_cleared(),
        "heartbeat_at": null(),
        "deadline_at": null(),
        "errors": appended(jobs_hot.c.errors, entry),
    }


def _set(verb: str) -> dict[str, Any]:
    """The SET of awa-pg's UPDATE for *verb*."""
    if verb == "complete":
        return {
            "state": state("completed"),
            "finalized_at": func.now(),
            **_cleared(),
            "heartbeat_at": null(),
            "deadline_at": null(),
            "progress": null(),
        }
    if verb == "fail":
        return failed_values(expression=False)
    if verb == "resume":
        result = func.jsonb_build_object(
            literal_column("'_awa_callback_result'"), text_param_as("b_payload", JSONB)
        )
        return {
            "state": state("running"),
            **_cleared(),
            "heartbeat_at": func.now(),
            "metadata": jobs_hot.c.metadata.op("||", return_type=JSONB)(result),
        }
    return {
        "state": state("available"),
        "attempt": literal_column("0"),
        "run_at": func.now(),
        "finalized_at": null(),
        **_cleared(),
        "heartbeat_at": null(),
        "deadline_at": null(),
    }


@statement
def end_callback_canonical(*, routed: bool, verb: Verb) -> Select[Any]:
    """End the canonical callback wait ``b_callback_id`` (guarded by ``b_run_lease`` unless
    NULL) as awa-pg's ``complete_external``, ``fail_external`` (``b_error``),
    ``retry_external`` or ``resume_external`` (``b_payload``) does: one UPDATE of
    ``jobs_hot`` (and a retry's NOTIFY to the job's queue), answered with the row after."""
    return ended_canonical(routed, verb, _set(verb))


def ended_canonical(routed: bool, verb: Verb, values: dict[str, Any]) -> Select[Any]:
    """The body of :func:`end_callback_canonical`, with the SET *values*."""
    head = routing_head(routed)
    unrouted = scalar(head, "routing_schema").is_(None)
    written = (
        update(jobs_hot)
        .where(picked(jobs_hot, verb), unrouted)
        .values(values)
        .returning(*jobs_hot.c)
        .cte("written")
    )
    if verb != "retry":
        return head_then(head, written, *written.c)
    # awa-pg's ``pg_notify('awa:' || queue, '')`` after the UPDATE: the queue's workers wake.
    channel = literal_column("'awa:'", Text) + written.c.queue
    told = select(func.pg_notify(channel, literal_column("''"))).select_from(written)
    counted = select(func.count()).select_from(told.subquery("told")).scalar_subquery()
    return head_then(head, written, *written.c, counted.label("told"))


@statement
def heartbeat_callback_canonical(*, routed: bool) -> Select[Any]:
    """Extend the canonical callback wait ``b_callback_id`` to ``b_timeout`` seconds from now,
    as awa-pg's ``heartbeat_callback``; answered with the row after."""
    head = routing_head(routed)
    unrouted = scalar(head, "routing_schema").is_(None)
    timeout = func.now() + seconds_from_now()
    written = (
        update(jobs_hot)
        .where(picked(jobs_hot, "heartbeat", guarded=False), unrouted)
        .values(callback_timeout_at=timeout)
        .returning(*jobs_hot.c)
        .cte("written")
    )
    return head_then(head, written, *written.c)
