"""Cancelling and retrying a queue-storage job that waits on a callback (a ``leases`` row).

The flow around :mod:`awa_sa.administer.statements.callback_leases` (docs/administer.md): the lease
locked and the refusals read while nothing is written, then one statement for a cancel; for a retry
the claim, the lane steps and the ring cursor first, as for a failed job's retry
(:mod:`awa_sa.administer.queue_storage`). Both run after the routing lock, in the caller's
transaction. Every queue-storage retry ensures its lanes (any enqueue shard) and reads the
ring here, its shards picked as awa-pg's administering call picks them
(:mod:`awa_sa.administer.statements.lanes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from awa_sa.administer.statements.callback_leases import (
    Verb,
    cancel_lease,
    lease_claims_cancelled,
    lease_claims_retried,
    lease_target,
    retry_lease,
)
from awa_sa.administer.statements.canonical import JobRow
from awa_sa.administer.statements.deferred import done_job_fields
from awa_sa.administer.statements.lanes import (
    ensure_shard_head,
    ensure_shard_sequences,
    sharded_queues,
)
from awa_sa.core.compiled import run
from awa_sa.core.errors import DatabaseError, UniqueConflict
from awa_sa.settle.statements.duplicate import (
    ENSURE_CLAIM_HEAD,
    ENSURE_ENQUEUE_HEAD,
    ENSURE_LANE_ROW,
    ENSURE_LANE_SEQUENCES,
    LANE_LOCK,
    RING_CURSOR,
    Lane,
    lane_lock,
)
from awa_sa.tables.queue_storage import translate_map

_CLAIM = "idx_awa_jobs_unique"


def ready_ring(conn: Connection, schema: str, lanes: Iterable[tuple[str, int, int]]) -> Any:
    """The ring's cursor, once each lane ``(queue, priority, shard)`` a job goes back to is
    locked and has the rows awa-pg's enqueue makes for it: where a retried job's ready row
    goes. Shard 0 with the settle's lane steps, another with the same steps for that shard."""
    for queue, priority, shard in sorted(set(lanes)):
        lane = Lane(schema, queue, priority)
        if shard:
            _ensure_shard(conn, lane, shard)
            continue
        run(conn, LANE_LOCK, lane)
        for ensure in (ENSURE_LANE_ROW, ENSURE_ENQUEUE_HEAD, ENSURE_CLAIM_HEAD):
            run(conn, ensure, lane, schema)
        run(conn, ENSURE_LANE_SEQUENCES, lane, schema)
    ring = run(conn, RING_CURSOR, None, schema)
    if ring is None:
        raise DatabaseError(f"{schema}.queue_ring_state has no singleton row")
    return ring


def _ensure_shard(conn: Connection, lane: Lane, shard: int) -> None:
    """awa-pg's lane steps for a shard other than 0: its lock key and head rows name it."""
    conn.execute(lane_lock(), {"b_lane_key": f"{lane.schema}:{lane.queue}:{lane.priority}:{shard}"})
    run(conn, ENSURE_LANE_ROW, lane, lane.schema)
    options = {"schema_translate_map": translate_map(lane.schema)}
    binds = {"b_queue": lane.queue, "b_priority": lane.priority, "b_enqueue_shard": shard}
    for table in ("enqueue", "claim"):
        conn.execute(ensure_shard_head(table=table), binds, execution_options=options)
    conn.execute(ensure_shard_sequences(), binds, execution_options=options)


def shards_picked(conn: Connection, queues: Sequence[str]) -> list[int]:
    """The enqueue shard of each pick of a call, *queues* in the call's pick order, as awa-pg's
    administering call picks them: its rotor starts at 0 and moves once per pick onto a queue
    with more than one enqueue shard, which gets ``pick mod shards``; any other queue, 0."""
    counts: dict[str, int] = {}
    if len(queues) > 1:  # a first pick is 0 whatever the count: one job needs no read
        found = conn.execute(sharded_queues(), {"b_queues": sorted(set(queues))}).all()
        counts = {row.queue: int(row.enqueue_shards) for row in found}
    picks, rotor = [], 0
    for queue in queues:
        shards = counts.get(queue, 1)
        picks.append(rotor % shards if shards > 1 else 0)
        rotor += shards > 1
    return picks


def shard_binds(shards: Mapping[int, int]) -> dict[str, list[int]]:
    """``b_shard_ids`` and ``b_shards``: the jobs of *shards* (job id to shard) not on 0."""
    placed = sorted((job_id, shard) for job_id, shard in shards.items() if shard)
    return {"b_shard_ids": [j for j, _ in placed], "b_shards": [s for _, s in placed]}


def _lease(conn: Connection, schema: str, job_id: int, verb: Verb) -> Any:
    """The job's lease, locked, or None."""
    options = {"schema_translate_map": translate_map(schema)}
    return conn.execute(
        lease_target(verb=verb), {"b_job_id": job_id}, execution_options=options
    ).first()


def claim_moved(
    conn: Connection, schema: str, claims: Any, binds: Mapping[str, Any], becomes: str
) -> None:
    """Run *claims* (a :func:`~awa_sa.administer.statements.failed_retry.claims_moved`
    statement) for the jobs' claims as they become *becomes* (``cancelled``, ``retried``),
    before anything else of the call is written: a key another job holds raises awa-pg's
    UniqueConflict with nothing written, the transaction still usable."""
    options = {"schema_translate_map": translate_map(schema)}
    moved = conn.execute(claims, binds, execution_options=options).one()
    if moved.taken < moved.wanted:
        raise UniqueConflict(_CLAIM, f"a {becomes} job's unique key is held by another job")


def cancelled_lease(conn: Connection, schema: str, job_id: int) -> JobRow | None:
    """Cancel job *job_id*'s callback wait (or running attempt with a callback registered) as
    awa-pg does, its handler told by the ``awa:cancel`` NOTIFY; None when it has no lease."""
    if _lease(conn, schema, job_id, "cancel") is None:
        return None
    claim_moved(conn, schema, lease_claims_cancelled(), {"b_job_id": job_id}, "cancelled")
    options = {"schema_translate_map": translate_map(schema)}
    row = conn.execute(cancel_lease(), {"b_job_id": job_id}, execution_options=options).first()
    if row is None:  # awa-pg's hydration fails there too; the caller's rollback undoes it
        raise DatabaseError(f"{schema}.leases row of job {job_id} has no ready row")
    return JobRow(**done_job_fields(row), storage=schema)


def retried_lease(conn: Connection, schema: str, job_id: int) -> JobRow | None:
    """Retry job *job_id*'s callback wait as awa-pg does: enqueued again, attempt 0, under its
    own id and run lease; None when it waits on no callback."""
    lease = _lease(conn, schema, job_id, "retry")
    if lease is None:
        return None
    options = {"schema_translate_map": translate_map(schema)}
    claim_moved(conn, schema, lease_claims_retried(), {"b_job_ids": [job_id]}, "retried")
    ring = ready_ring(conn, schema, [(lease.queue, lease.priority, 0)])  # one pick: shard 0
    at_ring = {
        "b_job_id": job_id,
        "b_ready_slot": ring.current_slot,
        "b_ready_generation": ring.generation,
    }
    row = conn.execute(retry_lease(), at_ring, execution_options=options).first()
    if row is None:
        raise DatabaseError(f"{schema}.leases row of job {job_id} has no ready row")
    fields = done_job_fields(row, state="available", finalized_at=None, unique_states=None)
    return JobRow(**fields, storage=schema)
