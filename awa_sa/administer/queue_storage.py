"""Retrying and discarding failed jobs once routing points at a queue-storage schema.

The flow of :mod:`awa_sa.administer.statements.failed_retry` and
:mod:`~awa_sa.administer.statements.failed_discard` (docs/administer.md): the targets locked
while nothing is written, the enqueue shard of each job picked as awa-pg's call picks it, then the
receipts' advisory locks, the claims, each lane ensured as awa-pg ensures it
(:mod:`awa_sa.administer.statements.lanes`), the ring cursor, and one statement that writes every
job; a matched job that also waits on a callback has that wait retried in the
same statement, as awa-pg's bulk retry does
(:func:`~awa_sa.administer.statements.callback_leases.retry_done_resuming`). The lane's enqueue
sequence advances outside the transaction, as awa-pg's and Awa's own SQL producer's do: a rollback
leaves a gap in the lane, which the claim side steps over (docs/contract.md#administer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from awa_sa.administer.callback_leases import (
    claim_moved,
    ready_ring,
    retried_lease,
    shard_binds,
    shards_picked,
)
from awa_sa.administer.statements.callback_leases import (
    lease_claims_retried,
    resumed_targets,
    retry_done_resuming,
)
from awa_sa.administer.statements.deferred import done_job_fields
from awa_sa.administer.statements.failed_discard import discard_failed_qs, discard_targets
from awa_sa.administer.statements.failed_retry import (
    By,
    failed_matched,
    pruned_failed,
    retry_claims,
    retry_done,
    retry_targets,
)
from awa_sa.core.job_rows import JobRow
from awa_sa.settle.statements.receipt_settles import receipt_lock
from awa_sa.tables.queue_storage import translate_map


def retried(
    conn: Connection, schema: str, by: By, binds: Mapping[str, Any]
) -> tuple[list[JobRow], int, int | None]:
    """Retry job ``b_job_id``, or the failed jobs of kind or queue ``b_key``, as awa-pg's
    queue-storage retry does: the new rows, how many jobs matched, and for a queue the
    failed rows already pruned (awa-pg's ``pruned_failed_count``)."""
    options = {"schema_translate_map": translate_map(schema)}
    waits: list[Any] = []
    if by == "job":  # awa-pg resumes a callback wait first
        resumed = retried_lease(conn, schema, binds["b_job_id"])
        if resumed is not None:
            return [resumed], 1, None
    else:
        counted = conn.execute(failed_matched(by=by), binds, execution_options=options).one()
        if counted.waiting:  # so does its bulk retry, each such job's failed row kept
            found = conn.execute(resumed_targets(by=by), binds, execution_options=options)
            waits = list(found.all())
    targets = conn.execute(retry_targets(by=by), binds, execution_options=options).all()
    matched, pruned = len(targets) if by == "job" else int(counted.matched), None
    if by == "queue":
        summed = conn.execute(pruned_failed(), binds, execution_options=options).scalar()
        pruned = int(summed or 0)
    if not targets and not waits:
        return [], matched, pruned
    in_order = sorted((*targets, *waits), key=lambda t: int(t.job_id))  # awa-pg's loop
    shards = dict(
        zip(
            (int(t.job_id) for t in in_order),
            shards_picked(conn, [t.queue for t in in_order]),
            strict=True,
        )
    )
    ids = [int(t.job_id) for t in targets]
    lease_ids = [int(w.job_id) for w in waits]
    if ids:
        leases = {"b_job_id": ids, "b_run_lease": [int(t.run_lease) for t in targets]}
        conn.execute(receipt_lock(batch=True), leases)
        claim_moved(conn, schema, retry_claims(), {"b_job_ids": ids}, "retried")
    if lease_ids:
        claim_moved(conn, schema, lease_claims_retried(), {"b_job_ids": lease_ids}, "retried")
    lanes = [(t.queue, t.priority, shards[int(t.job_id)]) for t in in_order]
    ring = ready_ring(conn, schema, lanes)
    at_ring = {
        "b_job_ids": ids,
        "b_ready_slot": ring.current_slot,
        "b_ready_generation": ring.generation,
        **shard_binds(shards),
    }
    if lease_ids:
        at_ring["b_lease_ids"] = lease_ids
    written = retry_done_resuming() if lease_ids else retry_done()
    rows = conn.execute(written, at_ring, execution_options=options).all()
    return [JobRow(**ready_job_fields(row), storage=schema) for row in rows], matched, pruned


def discarded(conn: Connection, schema: str, kind: str) -> int:
    """Discard the failed jobs of *kind* as awa-pg's queue-storage discard does; how many
    rows went (``done_entries`` and ``dlq_entries``), as awa-pg counts them."""
    options = {"schema_translate_map": translate_map(schema)}
    binds = {"b_key": kind}
    pairs = conn.execute(discard_targets(), binds, execution_options=options).all()
    if pairs:
        ids = [int(p.job_id) for p in pairs]
        leases = [int(p.run_lease) for p in pairs]
        conn.execute(receipt_lock(batch=True), {"b_job_id": ids, "b_run_lease": leases})
    return int(conn.execute(discard_failed_qs(), binds, execution_options=options).scalar_one())


def ready_job_fields(row: Any) -> dict[str, Any]:
    """A new ``ready_entries`` row as :class:`JobRow`'s fields, as awa-pg builds the row it
    returns: available, not finalized, no unique states, the rest as a done row's."""
    return done_job_fields(row, state="available", finalized_at=None, unique_states=None)
