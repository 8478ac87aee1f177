"""Ending a job that waits on an external callback, in the caller's transaction.

awa-pg 0.6.9's ``Client.complete_external``, ``fail_external`` and ``retry_external`` each run
on the client's own pool, in a transaction of their own: a webhook receiver's rows and the
waiting job's end commit apart. These do what those write, on a bind's transaction
(docs/callbacks.md): the receiver's rows and the job's end commit together, and a rollback
leaves the job waiting as it was.

Each call validates its input before any connection is touched, then, in the bind's form
(:func:`awa_sa.core.binds.administered`), share-locks the transition singleton (the routing
lock, as the administering verbs take it) and sends one statement that reads routing afresh
and writes only while routing is canonical
(:mod:`awa_sa.callbacks.statements.canonical`). Once routing points at queue storage that
statement wrote nothing, and the call goes on in the routing schema, where awa-pg looks too
(:mod:`awa_sa.callbacks.queue_storage`). Where awa-pg raises "callback not found" the call
answers None.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine

from awa_sa.administer.statements.canonical import JobRow, job_rows
from awa_sa.callbacks.expressions import DefaultAction
from awa_sa.callbacks.queue_storage import (
    ended_on_queue_storage,
    heartbeat_on_queue_storage,
    resumed_on_queue_storage,
)
from awa_sa.callbacks.resolve import Resolved, resolved_step
from awa_sa.callbacks.statements.canonical import (
    Verb,
    end_callback_canonical,
    heartbeat_callback_canonical,
)
from awa_sa.core.binds import administered, check_bind
from awa_sa.core.compiled import run
from awa_sa.core.errors import ValidationError
from awa_sa.core.unique_keys import to_json
from awa_sa.settle.running import CANONICAL
from awa_sa.settle.statements.canonical import ROUTING_LOCK

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")
Step = Callable[[Connection], _T]
"""What a call does on a Connection, once validated; both faces run it."""

BIGINT_MAX = 2**63 - 1


def callback_id_text(callback_id: object) -> str:
    """The callback id as awa-pg parses it (a ``uuid.UUID``, or its text in any form
    ``uuid.UUID`` reads), in canonical text; anything else is refused."""
    if isinstance(callback_id, uuid.UUID):
        return str(callback_id)
    if not isinstance(callback_id, str):
        raise ValidationError(
            f"callback_id must be a str or UUID, got {type(callback_id).__name__}"
        )
    try:
        return str(uuid.UUID(callback_id))
    except ValueError as exc:
        raise ValidationError(f"callback_id is not a UUID: {callback_id!r}") from exc


def _run_lease(run_lease: object) -> int | None:
    if run_lease is None:
        return None
    if not isinstance(run_lease, int) or isinstance(run_lease, bool):
        raise ValidationError(f"run_lease must be an int or None, got {type(run_lease).__name__}")
    if not -BIGINT_MAX - 1 <= run_lease <= BIGINT_MAX:
        raise ValidationError(f"run_lease must fit a bigint, got {run_lease}")
    return run_lease


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be a str, got {type(value).__name__}")
    if "\x00" in value:
        raise ValidationError(f"{name} must not contain NUL characters")
    return value


def payload_json(payload: object) -> str:
    """*payload* as the JSON text awa-pg would store (``null`` for None); refused when it is
    not JSON (as awa-pg's conversion refuses it)."""
    return "null" if payload is None else to_json(payload)


def timeout_seconds(value: object) -> float:
    """A heartbeat's timeout, as awa-pg checks it: a finite number of seconds, not negative."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"timeout_seconds must be a number, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or math.copysign(1.0, seconds) < 0:
        raise ValidationError(f"timeout_seconds must be finite and not negative, got {value}")
    return seconds


def ended_step(verb: Verb, binds: Mapping[str, Any]) -> Step[JobRow | None]:
    """The step: the routing lock, then the canonical statement; once routing is queue
    storage, the routing schema's flow."""

    def step(conn: Connection) -> JobRow | None:
        routed = run(conn, ROUTING_LOCK, None)
        rows = list(conn.execute(end_callback_canonical(routed=routed, verb=verb), binds).all())
        schema = rows[0].routing_schema
        if schema is None:
            jobs = job_rows(rows, CANONICAL)
            return jobs[0] if jobs else None
        if verb == "resume":
            return resumed_on_queue_storage(conn, schema, binds)
        return ended_on_queue_storage(conn, schema, verb, binds)

    return step


def complete_external_step(
    callback_id: object, payload: object = None, run_lease: object = None
) -> Step[JobRow | None]:
    """The validated step of :func:`complete_external`, for either face."""
    payload_json(payload)  # checked as awa-pg converts it; a completion does not store it
    binds = {"b_callback_id": callback_id_text(callback_id), "b_run_lease": _run_lease(run_lease)}
    return ended_step("complete", binds)


def fail_external_step(
    callback_id: object, error: object, run_lease: object = None
) -> Step[JobRow | None]:
    """The validated step of :func:`fail_external`, for either face."""
    binds = {
        "b_callback_id": callback_id_text(callback_id),
        "b_run_lease": _run_lease(run_lease),
        "b_error": _text("error", error),
    }
    return ended_step("fail", binds)


def retry_external_step(callback_id: object) -> Step[JobRow | None]:
    """The validated step of :func:`retry_external`, for either face."""
    binds = {"b_callback_id": callback_id_text(callback_id), "b_run_lease": None}
    return ended_step("retry", binds)


def resume_external_step(callback_id: object, payload: object = None) -> Step[JobRow | None]:
    """The validated step of :func:`resume_external`, for either face."""
    binds = {
        "b_callback_id": callback_id_text(callback_id),
        "b_run_lease": None,
        "b_payload": payload_json(payload),
    }
    return ended_step("resume", binds)


def resolve_callback_step(
    callback_id: object,
    payload: object = None,
    default_action: object = "ignore",
    run_lease: object = None,
) -> Step[Resolved | None]:
    """The validated step of :func:`resolve_callback`, for either face."""
    binds = {"b_callback_id": callback_id_text(callback_id), "b_run_lease": _run_lease(run_lease)}
    text = None if payload is None else payload_json(payload)
    step: Step[Resolved | None] = resolved_step(binds, text, default_action)
    return step


def heartbeat_callback_step(callback_id: object, timeout: object) -> Step[JobRow | None]:
    """The validated step of :func:`heartbeat_callback`, for either face."""
    binds = {"b_callback_id": callback_id_text(callback_id), "b_timeout": timeout_seconds(timeout)}

    def step(conn: Connection) -> JobRow | None:
        routed = run(conn, ROUTING_LOCK, None)
        rows = list(conn.execute(heartbeat_callback_canonical(routed=routed), binds).all())
        schema = rows[0].routing_schema
        if schema is None:
            jobs = job_rows(rows, CANONICAL)
            return jobs[0] if jobs else None
        return heartbeat_on_queue_storage(conn, schema, binds)

    return step


def complete_external(
    bind: Engine | Connection | Session,
    callback_id: str | uuid.UUID,
    payload: Any | None = None,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Complete the job waiting on callback *callback_id* (``waiting_external``, or still
    ``running`` when the callback arrives before its handler parks), as awa-pg's
    ``Client.complete_external`` writes it; its row after, or None where awa-pg raises
    "callback not found" (no such wait, or it ended already). With *run_lease*, only that
    attempt's wait (awa-pg's Rust ``run_lease`` guard).

    *payload* is checked as awa-pg checks it and, as there, not stored. ``bind`` is an
    ``Engine`` (own transaction, committed), or a ``Connection`` or ``Session`` (the caller's
    transaction, never committed here): the job ends when the caller commits, together with
    the caller's rows. A completed job whose unique mask claims ``completed`` but not its
    waiting state takes its key again; another job holding it raises
    :class:`~awa_sa.core.errors.UniqueConflict`, as in awa-pg.
    """
    check_bind(bind)
    return administered(bind, complete_external_step(callback_id, payload, run_lease))


def fail_external(
    bind: Engine | Connection | Session,
    callback_id: str | uuid.UUID,
    error: str,
    *,
    run_lease: int | None = None,
) -> JobRow | None:
    """Fail, for good, the job waiting on callback *callback_id*, as awa-pg's
    ``Client.fail_external`` writes it (the error entry appended to its errors); its row after,
    or None. ``bind``, *run_lease* and the states taken are as for :func:`complete_external`.
    """
    check_bind(bind)
    return administered(bind, fail_external_step(callback_id, error, run_lease))


def retry_external(
    bind: Engine | Connection | Session, callback_id: str | uuid.UUID
) -> JobRow | None:
    """Take the job parked on callback *callback_id* (``waiting_external`` only: a handler
    still running would run twice) back to available, attempt 0, as awa-pg's
    ``Client.retry_external`` writes it; its row after, or None. ``bind`` is as for
    :func:`complete_external`. On queue storage the job goes to shard 0 of its lane whatever
    the queue's enqueue shard count, the shard awa-pg's call picks for its one job.
    """
    check_bind(bind)
    return administered(bind, retry_external_step(callback_id))


def resume_external(
    bind: Engine | Connection | Session, callback_id: str | uuid.UUID, payload: Any | None = None
) -> JobRow | None:
    """Hand *payload* to the handler waiting on callback *callback_id* and let it run on, as
    awa-pg's ``Client.resume_external`` writes it: the job ``running`` again, its callback
    cleared, the payload where the handler's ``wait_for_callback`` reads it (canonical: the
    metadata's ``_awa_callback_result``; queue storage: the attempt's ``callback_result``); its
    row after, or None. ``bind`` and the states taken are as for :func:`complete_external`.
    """
    check_bind(bind)
    return administered(bind, resume_external_step(callback_id, payload))


def heartbeat_callback(
    bind: Engine | Connection | Session,
    callback_id: str | uuid.UUID,
    timeout_seconds: float = 3600.0,
) -> JobRow | None:
    """Move the timeout of the wait parked on callback *callback_id* to *timeout_seconds* from
    now, as awa-pg's ``Client.heartbeat_callback`` writes it; its row after, or None when no
    wait is parked on it. ``bind`` is as for :func:`complete_external`.
    """
    check_bind(bind)
    return administered(bind, heartbeat_callback_step(callback_id, timeout_seconds))


def resolve_callback(
    bind: Engine | Connection | Session,
    callback_id: str | uuid.UUID,
    payload: Any | None = None,
    default_action: DefaultAction = "ignore",
    *,
    run_lease: int | None = None,
) -> Resolved | None:
    """Resolve callback *callback_id* by the expressions its handler registered with it
    (``filter``, ``on_fail``, ``on_complete``, ``transform``: CEL, evaluated by awa-pg's own
    engine), as awa-pg's ``Client.resolve_callback`` does: the job completed, failed, or left
    waiting, *default_action* where no expression decides. Its :class:`Resolved`, or None
    where awa-pg raises "callback not found". The states taken, ``bind`` and *run_lease* are
    as for :func:`complete_external`.

    A wait with expressions needs the ``callbacks-cel`` extra
    (:class:`~awa_sa.callbacks.cel_engine.CelUnavailable` without it); an expression awa-sa
    cannot evaluate exactly as awa-pg raises
    :class:`~awa_sa.callbacks.cel_engine.ExpressionRefused`, with nothing written
    (docs/callbacks.md#expressions).
    """
    check_bind(bind)
    return administered(
        bind, resolve_callback_step(callback_id, payload, default_action, run_lease)
    )
