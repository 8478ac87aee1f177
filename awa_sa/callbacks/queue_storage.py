"""Ending a queue-storage callback wait: the flow around :mod:`awa_sa.callbacks.statements.leases`.

The lease locked (or none: awa-pg's "callback not found"), then the receipt's advisory lock
as awa-pg's closing of it takes, then the unique claim and one statement for the rest; a retry
first checks the lane and takes the ring cursor, as the administering retry of a wait does
(:mod:`awa_sa.administer.callback_leases`). A resume or a heartbeat keeps the lease: one
statement each, answered with the lease read back. All in the caller's transaction, after the
routing lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from awa_sa.administer.callback_leases import ready_ring
from awa_sa.administer.statements.callback_leases import lease_claims_retried
from awa_sa.administer.statements.canonical import JobRow
from awa_sa.administer.statements.deferred import done_job_fields
from awa_sa.callbacks.statements.leases import (
    Ending,
    Verb,
    callback_lease,
    end_lease,
    ended_lease_claims,
    heartbeat_lease,
    resume_lease,
    retry_callback_lease,
)
from awa_sa.callbacks.statements.resolve import fail_lease_by_expression
from awa_sa.core.errors import DatabaseError, UniqueConflict
from awa_sa.settle.statements.receipt_settles import receipt_lock
from awa_sa.tables.queue_storage import translate_map

_LEASE_COLUMNS = (
    "heartbeat_at",
    "deadline_at",
    "callback_id",
    "callback_timeout_at",
    "callback_filter",
    "callback_on_complete",
    "callback_on_fail",
    "callback_transform",
)
"""What a lease's ``JobRow`` has of its own, where a done row's has None."""
ENDINGS: dict[str, Ending] = {"complete": "completed", "fail": "failed"}
_CLAIM = "idx_awa_jobs_unique"


def ended_on_queue_storage(
    conn: Connection,
    schema: str,
    verb: Verb,
    binds: Mapping[str, Any],
    *,
    by_expression: bool = False,
) -> JobRow | None:
    """End the wait on ``b_callback_id`` in *schema* as awa-pg does; None when no lease waits
    on it in a state *verb* takes. A failure *by_expression* names ``b_expression`` in its
    error entry (``resolve_callback``)."""
    options = {"schema_translate_map": translate_map(schema)}
    lease = conn.execute(callback_lease(verb=verb), binds, execution_options=options).first()
    if lease is None:
        return None
    held = {**binds, "b_job_id": lease.job_id, "b_lease": lease.run_lease}
    conn.execute(
        receipt_lock(batch=False), {"b_job_id": lease.job_id, "b_run_lease": lease.run_lease}
    )
    if verb == "retry":
        return _retried(conn, schema, lease, held)
    ending = ENDINGS[verb]
    claims = conn.execute(ended_lease_claims(ending=ending), held, execution_options=options)
    moved = claims.one()
    if moved.taken < moved.wanted:
        raise UniqueConflict(_CLAIM, f"a {ending} job's unique key is held by another job")
    ends = fail_lease_by_expression() if by_expression else end_lease(ending=ending)
    row = conn.execute(ends, held, execution_options=options).first()
    if row is None:  # awa-pg's hydration fails there too; the caller's rollback undoes it
        raise DatabaseError(f"{schema}.leases row of job {lease.job_id} has no ready row")
    return JobRow(**done_job_fields(row), storage=schema)


def _retried(conn: Connection, schema: str, lease: Any, held: Mapping[str, Any]) -> JobRow:
    options = {"schema_translate_map": translate_map(schema)}
    ids = {"b_job_ids": [lease.job_id]}
    claims = conn.execute(lease_claims_retried(), ids, execution_options=options).one()
    if claims.taken < claims.wanted:
        raise UniqueConflict(_CLAIM, "a retried job's unique key is held by another job")
    # One job, awa-pg's first pick of its call: shard 0 whatever the queue's shard count.
    ring = ready_ring(conn, schema, [(lease.queue, lease.priority, 0)])
    at_ring = {**held, "b_ready_slot": ring.current_slot, "b_ready_generation": ring.generation}
    row = conn.execute(retry_callback_lease(), at_ring, execution_options=options).first()
    if row is None:
        raise DatabaseError(f"{schema}.leases row of job {lease.job_id} has no ready row")
    fields = done_job_fields(row, state="available", finalized_at=None, unique_states=None)
    return JobRow(**fields, storage=schema)


def resumed_on_queue_storage(
    conn: Connection, schema: str, binds: Mapping[str, Any]
) -> JobRow | None:
    """Resume the wait on ``b_callback_id`` in *schema* as awa-pg does: its handler's
    ``wait_for_callback`` returns ``b_payload``; None when no lease waits on it."""
    options = {"schema_translate_map": translate_map(schema)}
    row = conn.execute(resume_lease(), binds, execution_options=options).first()
    return None if row is None else lease_job(row, schema)


def heartbeat_on_queue_storage(
    conn: Connection, schema: str, binds: Mapping[str, Any]
) -> JobRow | None:
    """Extend the parked wait on ``b_callback_id`` in *schema*; None when none is parked."""
    options = {"schema_translate_map": translate_map(schema)}
    row = conn.execute(heartbeat_lease(), binds, execution_options=options).first()
    return None if row is None else lease_job(row, schema)


def lease_job(row: Any, schema: str) -> JobRow:
    """A lease read back as awa-pg's ``JobRow``: its payload with the attempt's progress, and
    a callback result under the metadata's ``_awa_callback_result``, as awa-pg builds it."""
    values = row._mapping
    payload = dict(values["payload"] or {})
    if values["progress"] is not None:
        payload["progress"] = values["progress"]
    metadata = dict(payload.get("metadata") or {})
    if values["callback_result"] is not None:
        metadata["_awa_callback_result"] = values["callback_result"]
    payload["metadata"] = metadata
    fields = done_job_fields(row, payload=payload, unique_states=None)
    fields |= {name: values[name] for name in _LEASE_COLUMNS}
    return JobRow(**fields, storage=schema)
