"""The settle of a queue-storage attempt: its receipt closed, and the job's next row written.

What Awa 0.6.9's runtime writes when a receipt-claimed attempt ends (docs/contract.md#receipts),
reproduced from outside because v040 has no SQL function for it. Two statements, as the
runtime sends them:

1. :func:`receipt_lock`: the transaction-scoped advisory lock on
   ``hashtextextended('awa.receipt.complete:<job_id>:<run_lease>', 0)`` that every settle of the
   attempt takes first (the runtime's completions, failures, retries, rescues), so that whoever
   waits takes its statement snapshot after the first settle committed and sees its evidence.
2. :func:`settle_receipt`: one data-modifying statement that finds the receipt still open (no
   closure evidence of any of the six kinds, no materialised lease), closes it, and writes the
   job's next row from its ``ready_entries`` row, which a claim leaves as it was:

   * a completion of a bare job (no unique key, tags or errors; metadata at most Awa's own
     ``_awa_original_*`` keys): a ``receipt_completion_batches`` row and a closure batch, and no
     ``done_entries`` row (the runtime's fast path);
   * any other ending: a closure, a ready-backed ``done_entries`` row (no args, run_at,
     created_at or unique columns: ``terminal_jobs`` joins them back from ``ready_entries``),
     its ``+1`` terminal-count delta, and the unique claim released where the mask says;
   * a re-schedule (Snooze, RetryAfter, RetryBackoff, a retryable failure with attempts left):
     a closure and a ``deferred_jobs`` row under the **same** job id and lease.

   A receipt ``register_callback`` materialised into a running ``leases`` row is not open
   here: the statement writes nothing and says so (``materialised``), and the settle's next
   statement is the same one in its ``lease`` shape, which deletes the running lease as the
   runtime's ending of a handler's result does, closes the receipt as the runtime then closes
   it (``completed`` after a completion, else ``rescue``) and writes the same next row.

   A receipt of a queue with a deadline is a ``lease_claims`` row and is closed by a
   ``lease_claim_closures`` row plus its ``closed_at``; a compact receipt (a queue without a
   deadline) is one position of a ``lease_claim_batches`` row and is closed by a closure batch:
   only by ``cancel_job`` (``admin_cancel``), since ``settle`` refuses a compact receipt before
   any statement (docs/contract.md#compact-receipts).

The statement is put together here from its parts, one module per concern: which receipt and
what the settle makes of it (:mod:`~awa_sa.settle.statements.receipt_targets`), the next row's
payload (:mod:`~awa_sa.settle.statements.receipt_shaping`), and the rows written
(:mod:`~awa_sa.settle.statements.receipt_writes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Select,
    Text,
    cast,
    delete,
    exists,
    func,
    literal_column,
    not_,
    select,
    true,
)

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import (
    bound_rows,
    head_row,
    head_then,
    rows_as_binds,
    scalar,
)
from awa_sa.settle.statements.duplicate import insert_terminal_delta
from awa_sa.settle.statements.lease_targets import lease_target
from awa_sa.settle.statements.receipt_shaping import shaped_rows
from awa_sa.settle.statements.receipt_targets import (
    ReceiptItem,
    ReceiptTag,
    SettleShape,
    asked_row,
    binds,
    open_receipt,
    shape_of,
    tagged,
    text_literal,
)
from awa_sa.settle.statements.receipt_writes import (
    closing_rows,
    completion_batch,
    deferred_row,
    done_row,
    unique_claim_sync,
)
from awa_sa.tables import queue_storage as qs

__all__ = [
    "RECEIPT_LOCKS",
    "SETTLE_LEASE",
    "SETTLE_RECEIPT",
    "ReceiptItem",
    "ReceiptTag",
    "Settled",
    "receipt_lock",
    "settle_receipt",
]


LOCK_PREFIX = "awa.receipt.complete:"
"""The advisory-lock key text, before ``<job_id>:<run_lease>``, as the runtime spells it."""


PLAN_MODE = "plan_cache_mode"
SAVED_PLAN_MODE = "awa_sa.plan_cache_mode"
"""Where :func:`receipt_lock` keeps the caller's ``plan_cache_mode`` for the settle to restore."""


def generic_plan_next() -> ColumnElement[Any]:
    """``plan_cache_mode`` set to ``force_generic_plan`` for the rest of the transaction, the
    value it had saved first (an argument is evaluated before its function).

    The settle's plan spans every partition of a dozen partitioned tables: a custom plan costs
    tens of milliseconds, and under ``auto`` PostgreSQL keeps making custom plans, because
    they prune to the attempt's slots and look cheaper than the generic plan. A generic plan is
    made once per connection (and again only when maintenance invalidates it), and prunes at
    executor start by the bound slots. :func:`settle_receipt` restores the saved value.
    """
    saved = func.pg_catalog.set_config(
        text_literal(SAVED_PLAN_MODE),
        func.pg_catalog.current_setting(text_literal(PLAN_MODE)),
        true(),
    )
    return func.pg_catalog.set_config(
        text_literal(PLAN_MODE), text_literal("force_generic_plan"), saved.is_not(None)
    )


def restored_plan_mode() -> ColumnElement[Any]:
    """The caller's ``plan_cache_mode`` back, as :func:`generic_plan_next` saved it; unchanged
    where nothing was saved in this transaction (a placeholder reads '' once its transaction
    ended)."""
    saved = func.nullif(
        func.pg_catalog.current_setting(text_literal(SAVED_PLAN_MODE), true()), text_literal("")
    )
    now = func.pg_catalog.current_setting(text_literal(PLAN_MODE))
    return func.pg_catalog.set_config(text_literal(PLAN_MODE), func.coalesce(saved, now), true())


def receipt_lock_key(job_id: Any, run_lease: Any) -> ColumnElement[Any]:
    """The receipt's advisory-lock key: ``format('...%s:%s', ...)`` as the runtime spells it,
    without a ``%`` in the text (the same key for bigints, and no literal a driver's paramstyle
    could take for a placeholder)."""
    key = text_literal(LOCK_PREFIX) + cast(job_id, Text) + text_literal(":") + cast(run_lease, Text)
    return func.pg_catalog.hashtextextended(key, literal_column("0"), type_=BigInteger)


@statement
def receipt_lock(*, batch: bool, generic_settle: bool = False) -> Select[Any]:
    """The runtime's advisory lock on each attempt's receipt, held to the end of the
    transaction; a batch takes them in one statement, distinct and in ascending key order, as
    the runtime's batched completion does, so that the two cannot deadlock.

    *generic_settle*: the lock before one :func:`settle_receipt` also asks PostgreSQL for the
    settle's generic plan (:func:`generic_plan_next`), at no extra round trip.
    """
    fields = [("b_job_id", "job_id", BigInteger), ("b_run_lease", "run_lease", BigInteger)]
    pairs = bound_rows("pairs", fields, batch)
    lock_key = receipt_lock_key(pairs.c.job_id, pairs.c.run_lease)
    keys = select(lock_key.label("lock_key")).distinct().order_by(lock_key)
    ordered = keys.cte("locks").prefix_with("MATERIALIZED")
    locked = func.pg_catalog.pg_advisory_xact_lock(ordered.c.lock_key, type_=Text)
    if not generic_settle:
        return select(locked.label("locked"))
    mode = (
        select(generic_plan_next().label("plan_mode")).cte("plan_mode").prefix_with("MATERIALIZED")
    )
    return select(locked.label("locked"), mode.c.plan_mode).select_from(ordered, mode)


@statement
def settle_receipt(*, shape: SettleShape) -> Select[Any]:
    """Settle one open receipt as asked (module docstring), in one statement.

    Returns one row: ``materialised`` (a callback wait made the attempt a ``leases`` row: then
    nothing was written), and, when the receipt was open and is now closed, the job id, the
    state its next row has, and for a re-schedule the new ``run_at`` and ``attempt``.

    *shape* names the receipt's source (:data:`SettleShape`): only that one is read, each
    partitioned table in the asked claim slot (and ready slot, where known) only, bound as
    parameters PostgreSQL prunes by; ``leases`` is probed once, by the head.
    """
    asked = asked_row()
    lease = qs.leases
    materialised = exists().where(
        lease.c.job_id == asked.c.job_id, lease.c.run_lease == asked.c.run_lease
    )
    head = head_row(materialised.label("materialised"), restored_plan_mode().label("plan_mode"))
    if shape == "lease":
        taken = open_receipt(asked, true(), shape, lease_target(asked))
    else:
        taken = open_receipt(asked, not_(scalar(head, "materialised")), shape)
    state_rows = qs.attempt_state
    flushed = (
        delete(state_rows)
        .where(
            state_rows.c.job_id == taken.c.job_id,
            state_rows.c.run_lease == taken.c.run_lease,
            ~tagged(taken, "admin_cancel"),
        )
        .returning(state_rows.c.progress)
        .cte("flushed")
    )
    shaped = shaped_rows(taken, flushed)
    done = done_row(shaped)
    writes = [
        *closing_rows(shaped, lease=shape == "lease"),
        completion_batch(shaped),
        done,
        insert_terminal_delta(done),
        *unique_claim_sync(shaped),
    ]
    deferred = deferred_row(shaped)
    written = [select(func.count()).select_from(w).scalar_subquery() for w in writes]
    answer = (
        select(
            shaped.c.job_id,
            shaped.c.next_state,
            deferred.c.run_at,
            deferred.c.attempt,
            (sum(written[1:], written[0])).label("writes"),
        )
        .select_from(shaped.outerjoin(deferred, true()))
        .subquery("answer")
    )
    a = answer.c
    return head_then(head, answer, a.job_id, a.next_state, a.run_at, a.attempt, a.writes)


class Settled(NamedTuple):
    """What :func:`settle_receipt` did."""

    materialised: bool
    """A callback had materialised the attempt into a ``leases`` row: nothing written (the
    ``lease`` shape, run next, settles the lease)."""
    job_id: int | None
    """None: the receipt was not open (settled, rescued), or no longer that attempt: Stale."""
    state: str | None
    """``completed``, ``cancelled``, ``failed``, ``retryable`` or ``scheduled``."""
    run_at: datetime | None
    attempt: int | None
    """The re-scheduled row's ``run_at`` and ``attempt``."""

    @classmethod
    def read(cls, rows: Rows) -> Settled:
        (row,) = rows
        return cls(bool(row.materialised), row.job_id, row.next_state, row.run_at, row.attempt)


def _lock_binds(items: Sequence[ReceiptItem]) -> Mapping[str, Any]:
    return rows_as_binds([{"b_job_id": i.job_id, "b_run_lease": i.run_lease} for i in items])


RECEIPT_LOCKS: Query[Sequence[ReceiptItem], None] = Query(
    lambda items: receipt_lock(batch=len(items) > 1, generic_settle=len(items) == 1),
    _lock_binds,
    lambda _: None,
)
SETTLE_RECEIPT: Query[ReceiptItem, Settled] = Query(
    lambda item: settle_receipt(shape=shape_of(item)), binds, Settled.read
)
SETTLE_LEASE: Query[ReceiptItem, Settled] = Query(
    lambda _: settle_receipt(shape="lease"), binds, Settled.read
)
"""The settle of an attempt :data:`SETTLE_RECEIPT` found materialised (``Settled.materialised``):
its running lease deleted and ended as the runtime ends it, under the lock already held."""
