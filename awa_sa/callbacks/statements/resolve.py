"""Resolving a callback by its expressions, as awa-pg 0.6.9's ``resolve_callback`` does.

awa-pg first locks the wait and reads its expressions (canonical: ``SELECT * FROM
awa.jobs_hot ... FOR UPDATE``; queue storage: the lease ``FOR UPDATE OF lease``, joined to its
ready row and its ``attempt_state`` row, which holds the expressions), evaluates them, and then
completes or fails the wait as ``complete_external`` and ``fail_external`` write it, or writes
nothing (ignored). A failure its ``on_fail`` expression decided names that expression in the
error entry; these are the statements for that, and the two lookups.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, and_, literal_column, select

from awa_sa.callbacks.statements.canonical import (
    ended_canonical,
    failed_values,
    picked,
    routing_head,
)
from awa_sa.callbacks.statements.leases import ended_lease, ready_of
from awa_sa.core.registry import statement
from awa_sa.core.sql import head_then, scalar
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import jobs_hot

EXPRESSIONS = ("callback_filter", "callback_on_complete", "callback_on_fail", "callback_transform")


@statement
def resolve_wait_canonical(*, routed: bool) -> Select[Any]:
    """Lock the canonical wait on callback ``b_callback_id`` (``waiting_external`` or
    ``running``, guarded by ``b_run_lease`` unless NULL) as awa-pg's ``resolve_callback``
    does, while routing is canonical: the routing schema first, then its id, attempt and
    callback expressions (no row: none found, or routing points at queue storage)."""
    head = routing_head(routed)
    unrouted = scalar(head, "routing_schema").is_(None)
    c = jobs_hot.c
    locked = (
        select(c.id, c.attempt, *(c[name] for name in EXPRESSIONS))
        .where(picked(jobs_hot, "complete"), unrouted)
        .with_for_update(of=jobs_hot)
        .cte("locked")
    )
    return head_then(head, locked, *locked.c)


@statement
def resolve_lease() -> Select[Any]:
    """Lock the lease waiting on callback ``b_callback_id`` (``waiting_external`` or
    ``running``, guarded by ``b_run_lease`` unless NULL) as awa-pg's ``resolve_callback``
    does: the newest run lease whose ready row is there, ``FOR UPDATE OF lease``; its job,
    attempt and the callback expressions of its ``attempt_state`` row."""
    lease = qs.leases.alias("lease")
    attempt = qs.attempt_state.alias("attempt")
    held = and_(attempt.c.job_id == lease.c.job_id, attempt.c.run_lease == lease.c.run_lease)
    return (
        select(
            lease.c.job_id.label("id"),
            lease.c.attempt,
            *(attempt.c[name] for name in EXPRESSIONS),
        )
        .select_from(lease.join(qs.ready_entries, ready_of(lease)).outerjoin(attempt, held))
        .where(picked(lease, "complete"))
        .order_by(lease.c.run_lease.desc())
        .limit(literal_column("1"))
        .with_for_update(of=lease)
    )


@statement
def fail_by_expression_canonical(*, routed: bool) -> Select[Any]:
    """Fail the canonical wait on ``b_callback_id`` as ``end_callback_canonical`` does, its
    error entry naming the ``on_fail`` expression ``b_expression`` that failed it."""
    return ended_canonical(routed, "fail", failed_values(expression=True))


@statement
def fail_lease_by_expression() -> Select[Any]:
    """Fail the locked lease as ``end_lease`` does, its error entry naming the ``on_fail``
    expression ``b_expression`` that failed it."""
    return ended_lease("failed", expression=True)
