"""Discarding the failed jobs of a kind on a queue-storage schema, as awa-pg 0.6.9 does.

awa-pg's ``discard_failed`` there deletes the kind's ``failed`` rows of ``S.done_entries`` and
every ``S.dlq_entries`` row of the kind, closes the removed attempts' ``lease_claims`` receipts
as ``terminal_removed``, appends one negative terminal-count delta per counter key (the sum of
its removed rows), and releases the unique claims the removed rows held. Here that is one
statement, after the receipts' advisory locks.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, Text, and_, bindparam, delete, func, or_, select

from awa_sa.administer.statements.failed_retry import (
    close_removed_receipts,
    removed_deltas,
    with_ready_columns,
)
from awa_sa.core.registry import statement
from awa_sa.core.sql import state
from awa_sa.settle.statements.receipt_writes import claims_in
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import JOB_STATES, job_unique_claims


@statement
def discard_targets() -> Select[Any]:
    """The attempts whose failed rows of kind ``b_key`` a discard removes, for their receipt
    locks (taken before the statement that removes them)."""
    d = qs.done_entries.c
    key = bindparam("b_key", type_=Text)
    return select(d.job_id, d.run_lease).where(d.kind == key, d.state == state("failed"))


@statement
def discard_failed_qs() -> Select[Any]:
    """Delete the failed rows of kind ``b_key`` and every ``dlq_entries`` row of it, close the
    removed attempts' receipts, append the summed deltas, release the claims; answers how
    many rows went."""
    done, dlq = qs.done_entries, qs.dlq_entries
    key = bindparam("b_key", type_=Text)
    removed = (
        delete(done)
        .where(done.c.kind == key, done.c.state == state("failed"))
        .returning(*done.c)
        .cte("removed")
    )
    proj = with_ready_columns(removed).cte("gone")
    dropped = (
        delete(dlq)
        .where(dlq.c.kind == key)
        .returning(dlq.c.job_id, dlq.c.state, dlq.c.unique_key, dlq.c.unique_states)
        .cte("dropped")
    )
    held = select(proj.c.job_id, proj.c.state, proj.c.unique_key, proj.c.unique_states).union_all(
        select(dropped.c.job_id, dropped.c.state, dropped.c.unique_key, dropped.c.unique_states)
    )
    gone = held.subquery("held")
    claims = job_unique_claims
    old = or_(
        *(and_(gone.c.state == state(s), claims_in(gone.c.unique_states, s)) for s in JOB_STATES)
    )
    released = (
        delete(claims)
        .where(claims.c.unique_key == gone.c.unique_key, claims.c.job_id == gone.c.job_id, old)
        .returning(claims.c.job_id)
        .cte("released")
    )
    effects = [close_removed_receipts(removed), removed_deltas(removed, summed=True), released]
    count = func.count()
    answer = select(
        (
            select(count).select_from(removed).scalar_subquery()
            + select(count).select_from(dropped).scalar_subquery()
        ).label("discarded")
    )
    return answer.add_cte(*effects)
