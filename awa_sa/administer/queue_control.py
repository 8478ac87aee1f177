"""Pausing, resuming and draining a queue in the caller's transaction.

awa-pg 0.6.9's ``Client.pause_queue`` and ``resume_queue`` write one row of ``awa.queue_meta``
on the client's own pool. A service that pauses a queue in the same commit as the business row
that makes it wait (a tenant suspended, a downstream taken offline) wants a rollback to leave
the queue running: these write the same row (:mod:`awa_sa.administer.statements.queue_control`)
in the bind's transaction. The row is shared by both planes, so no routing is read and no
routing lock is taken; a worker sees the pause at its next claim after the commit.
``drain_queue`` cancels the queue's pending jobs, so it takes the routing lock as a cancel
does, and on queue storage cancels each job as ``cancel_job`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine

from awa_sa.administer.api import Step, _canonical, _text
from awa_sa.administer.queue_storage_cancel import drained
from awa_sa.administer.statements.canonical import drain_queue_canonical
from awa_sa.administer.statements.queue_control import pause_queue_meta, resume_queue_meta
from awa_sa.core.binds import administered, check_bind

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


def pause_queue_step(queue: object, paused_by: object) -> Step[None]:
    """The validated step of :func:`pause_queue`, for either face."""
    binds = {
        "b_queue": _text("queue", queue),
        "b_paused_by": None if paused_by is None else _text("paused_by", paused_by),
    }

    def step(conn: Connection) -> None:
        conn.execute(pause_queue_meta(), binds)

    return step


def resume_queue_step(queue: object) -> Step[None]:
    """The validated step of :func:`resume_queue`, for either face."""
    binds = {"b_queue": _text("queue", queue)}

    def step(conn: Connection) -> None:
        conn.execute(resume_queue_meta(), binds)

    return step


def pause_queue(
    bind: Engine | Connection | Session, queue: str, paused_by: str | None = None
) -> None:
    """Pause *queue* as awa-pg's ``Client.pause_queue`` does: its ``awa.queue_meta`` row made
    or rewritten (paused, now, *paused_by*). No worker of either plane claims a job of it once
    the transaction commits, until :func:`resume_queue`; jobs already running go on.

    ``bind`` is an ``Engine`` (own transaction, committed), or a ``Connection`` or ``Session``
    (the caller's transaction, never committed here); an AUTOCOMMIT one is refused.
    """
    check_bind(bind)
    return administered(bind, pause_queue_step(queue, paused_by))


def resume_queue(bind: Engine | Connection | Session, queue: str) -> None:
    """Resume *queue* as awa-pg's ``Client.resume_queue`` does: the pause flag cleared, its
    clock and author kept; nothing for a queue never paused. ``bind`` as for
    :func:`pause_queue`."""
    check_bind(bind)
    return administered(bind, resume_queue_step(queue))


def drain_queue_step(queue: object) -> Step[int]:
    """The validated step of :func:`drain_queue`, for either face."""
    binds = {"b_key": _text("queue", queue)}
    rows = _canonical(
        "drain_queue",
        lambda routed: drain_queue_canonical(routed=routed),
        binds,
        lambda conn, schema: [drained(conn, schema, binds["b_key"])],
    )

    def step(conn: Connection) -> int:
        found = rows(conn)
        if found and isinstance(found[0], int):
            return found[0]
        return sum(1 for row in found if row.id is not None)

    return step


def drain_queue(bind: Engine | Connection | Session, queue: str) -> int:
    """Cancel every pending job of *queue* (available, scheduled, retryable, waiting on a
    callback) as awa-pg's ``Client.drain_queue`` does; how many were cancelled. Running jobs
    go on. ``bind`` and the errors are as for :func:`~awa_sa.cancel_job`; on queue storage a
    drain that raises is undone whole (a savepoint), as awa-pg's own transaction is."""
    check_bind(bind)
    return administered(bind, drain_queue_step(queue))
