"""Pure statement builders: each returns one Core statement and does no I/O.

One module per part of the flow, each statement beside its typed parameters and rows:
:mod:`~awa_sa.settle.statements.canonical` (the one statement, the routing lock and the move),
:mod:`~awa_sa.settle.statements.migration` (the queue-storage take, deferred rows and claims) and
:mod:`~awa_sa.settle.statements.duplicate` (the cancelled duplicate); new jobs go through Awa's own
producer function (:mod:`~awa_sa.enqueue.statements`). They share the attempts as rows
(:mod:`~awa_sa.settle.statements.attempts`) and a few SQL pieces (:mod:`~awa_sa.core.sql`).

Every builder is memoised and registered (:mod:`~awa_sa.core.registry`), so one
statement object per shape exists for the life of the process and :func:`all_builders` -- what
``awa-sa sql`` lists and the tests compile -- cannot miss one. Values travel only as bind
parameters, and the queue-storage schema only through ``schema_translate_map`` (see
:mod:`awa_sa.tables.queue_storage`). Builders take keyword arguments only.

Bind names carry a prefix (``guard_``, ``b_``) because SQLAlchemy reserves a column's own name for
its VALUES/SET parameter in ``insert()``/``update()``.
"""

from awa_sa.administer.statements.available import (
    available_claims,
    available_lane,
    cancel_available,
    claim_head_lock,
    drain_targets,
    unique_candidate,
)
from awa_sa.administer.statements.callback_leases import (
    cancel_lease,
    lease_claims_cancelled,
    retry_lease,
)
from awa_sa.administer.statements.canonical import (
    cancel_job_canonical,
    discard_failed_canonical,
    drain_queue_canonical,
    retry_failed_canonical,
    retry_job_canonical,
)
from awa_sa.administer.statements.deferred import (
    cancel_deferred,
    deferred_claims,
    deferred_lane,
)
from awa_sa.administer.statements.dlq import list_dlq_rows, move_to_dlq, purge_dlq_rows
from awa_sa.administer.statements.dlq_retry import dlq_retry_deferred, dlq_retry_ready
from awa_sa.administer.statements.failed_discard import discard_failed_qs
from awa_sa.administer.statements.failed_retry import retry_done, retry_targets
from awa_sa.administer.statements.lanes import ensure_shard_head, ensure_shard_sequences
from awa_sa.administer.statements.queue_control import pause_queue_meta, resume_queue_meta
from awa_sa.callbacks.statements.canonical import (
    end_callback_canonical,
    heartbeat_callback_canonical,
)
from awa_sa.callbacks.statements.leases import (
    callback_lease,
    end_lease,
    ended_lease_claims,
    heartbeat_lease,
    resume_lease,
    retry_callback_lease,
)
from awa_sa.callbacks.statements.resolve import (
    fail_by_expression_canonical,
    fail_lease_by_expression,
    resolve_lease,
    resolve_wait_canonical,
)
from awa_sa.core.registry import all_builders
from awa_sa.enqueue.bulk import bulk_routing, bulk_write
from awa_sa.enqueue.bulk_canonical import bulk_canonical
from awa_sa.enqueue.bulk_lanes import bulk_lanes
from awa_sa.enqueue.bulk_plain import bulk_plain
from awa_sa.enqueue.statements import insert_jobs, unique_holder
from awa_sa.read.statements.listings import list_jobs_rows
from awa_sa.read.statements.lookups import read_job, read_routing
from awa_sa.read.statements.stats import queue_stats_rows
from awa_sa.settle.statements.canonical import (
    ROUTING_BODY_MD5,
    canonical_move,
    move_if_canonical,
    routing_lock,
)
from awa_sa.settle.statements.duplicate import (
    LIFECYCLE_DUPLICATE,
    clock,
    ensure_lane_head,
    ensure_lane_row,
    ensure_lane_sequences,
    insert_cancelled,
    lane_lock,
    ring_cursor,
)
from awa_sa.settle.statements.endings import end_attempts, end_job
from awa_sa.settle.statements.job_receipts import claim_of_job, open_claims
from awa_sa.settle.statements.listings import attempt_lookup
from awa_sa.settle.statements.migration import claim_unique_keys, insert_deferred, take_and_allocate

__all__ = [
    "LIFECYCLE_DUPLICATE",
    "ROUTING_BODY_MD5",
    "all_builders",
    "attempt_lookup",
    "available_claims",
    "available_lane",
    "bulk_canonical",
    "bulk_lanes",
    "bulk_plain",
    "bulk_routing",
    "bulk_write",
    "callback_lease",
    "cancel_available",
    "cancel_deferred",
    "cancel_job_canonical",
    "cancel_lease",
    "canonical_move",
    "claim_head_lock",
    "claim_of_job",
    "claim_unique_keys",
    "clock",
    "deferred_claims",
    "deferred_lane",
    "discard_failed_canonical",
    "discard_failed_qs",
    "dlq_retry_deferred",
    "dlq_retry_ready",
    "drain_queue_canonical",
    "drain_targets",
    "end_attempts",
    "end_callback_canonical",
    "end_job",
    "end_lease",
    "ended_lease_claims",
    "ensure_lane_head",
    "ensure_lane_row",
    "ensure_lane_sequences",
    "ensure_shard_head",
    "ensure_shard_sequences",
    "fail_by_expression_canonical",
    "fail_lease_by_expression",
    "heartbeat_callback_canonical",
    "heartbeat_lease",
    "insert_cancelled",
    "insert_deferred",
    "insert_jobs",
    "lane_lock",
    "lease_claims_cancelled",
    "list_dlq_rows",
    "list_jobs_rows",
    "move_if_canonical",
    "move_to_dlq",
    "open_claims",
    "pause_queue_meta",
    "purge_dlq_rows",
    "queue_stats_rows",
    "read_job",
    "read_routing",
    "resolve_lease",
    "resolve_wait_canonical",
    "resume_lease",
    "resume_queue_meta",
    "retry_callback_lease",
    "retry_done",
    "retry_failed_canonical",
    "retry_job_canonical",
    "retry_lease",
    "retry_targets",
    "ring_cursor",
    "routing_lock",
    "take_and_allocate",
    "unique_candidate",
    "unique_holder",
]
