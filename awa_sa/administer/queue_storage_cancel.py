"""Cancelling a job once routing points at a queue-storage schema, as awa-pg 0.6.9 does.

awa-pg's queue-storage cancel looks for the job in each place a live job can be, and so does
this, in the caller's transaction: a deferred job (scheduled, retryable:
:mod:`awa_sa.administer.statements.deferred`), an available lane row
(:mod:`awa_sa.administer.statements.available`), a callback wait
(:mod:`awa_sa.administer.callback_leases`), a running attempt's open receipt (the settle's
receipt close, :mod:`awa_sa.settle.statements.receipt_settles`). A job none of them holds is
terminal or unknown, and is refused (awa-pg raises "job not found").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from awa_sa.administer.callback_leases import cancelled_lease, claim_moved
from awa_sa.administer.statements.available import (
    available_claims,
    available_lane,
    cancel_available,
    claim_head_lock,
    drain_targets,
    unique_candidate,
)
from awa_sa.administer.statements.deferred import (
    cancel_deferred,
    cancel_notify,
    cancelled_attempt,
    deferred_claims,
    deferred_lane,
    done_job_fields,
)
from awa_sa.core.compiled import run
from awa_sa.core.errors import DatabaseError, QueueStorageJobs
from awa_sa.settle.running import running_attempts
from awa_sa.settle.statements.duplicate import (
    ENSURE_CLAIM_HEAD,
    ENSURE_ENQUEUE_HEAD,
    ENSURE_LANE_ROW,
    ENSURE_LANE_SEQUENCES,
    LANE_LOCK,
    RING_CURSOR,
    Lane,
)
from awa_sa.settle.statements.receipt_settles import RECEIPT_LOCKS, SETTLE_RECEIPT, ReceiptItem
from awa_sa.tables.queue_storage import translate_map

_CALLBACK_MEANWHILE = "job {} registered a callback meanwhile (a leases row): call again"


@dataclass(frozen=True, slots=True)
class JobFields:
    """A queue-storage job's fields, already read, for the answer's ``JobRow``."""

    fields: dict[str, Any]
    storage: str


def drained(conn: Connection, schema: str, queue: str) -> int:
    """Cancel every pending job of *queue* as awa-pg's ``drain_queue`` does there: its
    available, deferred and callback-waiting jobs, by id, each as ``cancel_job`` cancels it;
    one that ended meanwhile is passed over, as awa-pg passes it. How many were cancelled."""
    options = {"schema_translate_map": translate_map(schema)}
    ids = conn.execute(drain_targets(), {"b_key": queue}, execution_options=options).scalars()
    pending = [int(i) for i in ids]
    if not pending:
        return 0
    # awa-pg drains in one transaction of its own, rolled back whole by a refusal (a key another
    # job holds): a savepoint does that here, the caller's transaction left as it was.
    with conn.begin_nested():
        return sum(len(cancel_on_queue_storage(conn, schema, i, gone_ok=True)) for i in pending)


def cancel_on_queue_storage(
    conn: Connection, schema: str, job_id: int, *, gone_ok: bool = False
) -> list[Any]:
    """Cancel a scheduled, retryable, available, running or callback-waiting job of *schema*
    as awa-pg does (docs/administer.md); anything else there is refused, or with *gone_ok*
    passed over (no rows)."""
    options = {"schema_translate_map": translate_map(schema)}
    binds = {"b_job_id": job_id}
    # The row locked first: a promotion holding it makes this wait, then find it gone.
    lane_row = conn.execute(deferred_lane(), binds, execution_options=options).first()
    if lane_row is None:
        available = _cancel_available(conn, schema, job_id)
        if available:
            return available
        waiting = cancelled_lease(conn, schema, job_id)
        if waiting is not None:
            return [waiting]
        return _cancel_running(conn, schema, job_id, gone_ok=gone_ok)
    claim_moved(conn, schema, deferred_claims(), binds, "cancelled")
    ring = run(conn, RING_CURSOR, None, schema)
    if ring is None:
        raise DatabaseError(f"{schema}.queue_ring_state has no singleton row")
    lane = Lane(schema, lane_row.queue, lane_row.priority)
    run(conn, LANE_LOCK, lane)
    for ensure in (ENSURE_LANE_ROW, ENSURE_ENQUEUE_HEAD, ENSURE_CLAIM_HEAD, ENSURE_LANE_SEQUENCES):
        run(conn, ensure, lane, schema)
    at_ring = {**binds, "b_ready_slot": ring.current_slot, "b_ready_generation": ring.generation}
    rows = conn.execute(cancel_deferred(), at_ring, execution_options=options).all()
    return [JobFields(done_job_fields(row), schema) for row in rows]


def _cancel_available(conn: Connection, schema: str, job_id: int) -> list[Any]:
    """Tombstone and file the job's available lane row, as awa-pg's cancel writes it, once
    the lane's claim head is locked: a claim that committed first is seen then (the job is
    running, and the caller goes on to cancel that), one that comes later waits for the
    caller's commit and skips the tombstone. Nothing when the job is not available."""
    options = {"schema_translate_map": translate_map(schema)}
    binds = {"b_job_id": job_id}
    lane = conn.execute(available_lane(), binds, execution_options=options).first()
    if lane is None:
        return []
    head = {"b_queue": lane.queue, "b_priority": lane.priority, "b_shard": lane.enqueue_shard}
    conn.execute(claim_head_lock(), head, execution_options=options).all()
    claim_moved(conn, schema, available_claims(), binds, "cancelled")
    rows = conn.execute(cancel_available(), binds, execution_options=options).all()
    return [JobFields(done_job_fields(row), schema) for row in rows]


def unique_holder_on_queue_storage(
    conn: Connection, schema: str, binds: Mapping[str, Any]
) -> int | None:
    """awa-pg's pick of the job holding a key on queue storage (docs/administer.md)."""
    options = {"schema_translate_map": translate_map(schema)}
    found = conn.execute(unique_candidate(), binds, execution_options=options).scalar()
    return None if found is None else int(found)


def _cancel_running(
    conn: Connection, schema: str, job_id: int, *, gone_ok: bool = False
) -> list[Any]:
    """Close the job's open receipt as cancelled, as awa-pg's cancel does, and tell its
    handler: the settle of a receipt (``statements.receipt_settles``) with awa-pg's admin
    cancel's rows, then the ``awa:cancel`` NOTIFY."""
    mine = [a for a in running_attempts(conn, job_id=job_id) if a.storage == schema]
    if not mine and gone_ok:
        return []
    if not mine:
        why = f"job {job_id} is none of its scheduled, retryable, available or running jobs"
        raise QueueStorageJobs("cancel_job", schema, f"{why} (terminal or unknown)")
    attempt = max(mine, key=lambda a: a.run_lease)
    if attempt.receipt_id is None or attempt.claim_slot is None:
        raise QueueStorageJobs("cancel_job", schema, _CALLBACK_MEANWHILE.format(job_id))
    item = ReceiptItem(
        job_id,
        attempt.run_lease,
        attempt.claim_slot,
        attempt.receipt_id,
        attempt.claim_batch_id,
        attempt.claim_batch_index,
        "admin_cancel",
        None,
        None,
        None,
        None,
        attempt.kind,
        attempt.queue,
        attempt.attempt,
    )
    run(conn, RECEIPT_LOCKS, [item], schema)
    closed = run(conn, SETTLE_RECEIPT, item, schema)
    if closed.materialised:
        raise QueueStorageJobs("cancel_job", schema, _CALLBACK_MEANWHILE.format(job_id))
    if closed.job_id is None:
        raise QueueStorageJobs("cancel_job", schema, f"job {job_id}'s attempt ended meanwhile")
    options = {"schema_translate_map": translate_map(schema)}
    lease = {"b_job_id": job_id, "b_run_lease": attempt.run_lease}
    conn.execute(cancel_notify(), lease)
    rows = conn.execute(cancelled_attempt(), lease, execution_options=options).all()
    return [JobFields(done_job_fields(row), schema) for row in rows]
