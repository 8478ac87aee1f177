"""awa-sa: typed SQLAlchemy Core data access for Awa v040.

The public surface is re-exported here; ``awa_sa.asyncio`` holds the async face.

A handler failed and wants its attempt retried in a minute. Here ``engine`` is an ``Engine`` on
an Awa v040 database, and the testing kit plays the worker that claimed the job::

    >>> from awa_sa import Rescheduled, RetryAfter, reschedule_canonical_attempt
    >>> from awa_sa.testing import running_attempt
    >>> with engine.begin() as conn:
    ...     job_id, lease = running_attempt(conn, kind="send_email", attempt=3)
    >>> outcome = reschedule_canonical_attempt(
    ...     engine, job_id, lease, RetryAfter(60), error={"error": "smtp timed out"}
    ... )
    >>> isinstance(outcome, Rescheduled), outcome.job_id == job_id, outcome.attempt
    (True, True, 3)

The same attempt settled again, now in a batch: the guard no longer matches, nothing is written::

    >>> from awa_sa import Attempt, Snooze, reschedule_canonical_attempts
    >>> reschedule_canonical_attempts(engine, [Attempt(job_id, lease, Snooze(5))])
    [Stale()]
"""

from awa_sa.administer.api import (
    RetriedFailed,
    cancel_by_unique_key,
    cancel_job,
    discard_failed,
    retry_failed,
    retry_job,
)
from awa_sa.administer.dead_letters import (
    DlqEntry,
    bulk_move_failed_to_dlq,
    dlq_depth,
    get_dlq_job,
    list_dlq,
    move_failed_to_dlq,
    purge_dlq,
    purge_dlq_job,
)
from awa_sa.administer.dlq_retry import bulk_retry_from_dlq, retry_from_dlq
from awa_sa.administer.queue_control import drain_queue, pause_queue, resume_queue
from awa_sa.callbacks.api import (
    complete_external,
    fail_external,
    heartbeat_callback,
    resolve_callback,
    resume_external,
    retry_external,
)
from awa_sa.callbacks.cel_engine import CelUnavailable, ExpressionRefused
from awa_sa.callbacks.resolve import Resolved
from awa_sa.callbacks.signing import (
    CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS,
    CALLBACK_DEFAULT_PATH_PREFIX,
    CALLBACK_SIGNATURE_HEADER,
    build_callback_url,
    sign_callback,
    verify_callback,
)
from awa_sa.core.errors import (
    AmbiguousAttempt,
    AttemptNotFound,
    AwaSAError,
    CompactReceipt,
    DatabaseError,
    DuplicateJob,
    InvalidSchemaName,
    MaterialisedAttempt,
    NotAnAwaDatabase,
    QueueStorageAttempt,
    QueueStorageJobs,
    ReadOnlyTransaction,
    UniqueConflict,
    ValidationError,
)
from awa_sa.core.job_rows import JobRow
from awa_sa.core.unique_keys import Unique
from awa_sa.enqueue.api import enqueue, enqueue_many
from awa_sa.enqueue.new_jobs import Duplicate, EnqueuedJob, NewJob
from awa_sa.read.api import get_job, jobs_view, list_jobs, queue_stats
from awa_sa.read.statements.stats import QueueStat
from awa_sa.settle.api import (
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
    settle,
    settle_attempts,
    settle_canonical_attempt,
    settle_canonical_attempts,
)
from awa_sa.settle.results import (
    Attempt,
    Cancel,
    Cancelled,
    CancelledDuplicate,
    Complete,
    Completed,
    Ending,
    Fail,
    Failed,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    Result,
    RetryAfter,
    RetryBackoff,
    Settle,
    Settlement,
    Snooze,
    Stale,
)
from awa_sa.settle.running import CANONICAL, RunningAttempt, attempt_of, running_attempts

__all__ = [
    "CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS",
    "CALLBACK_DEFAULT_PATH_PREFIX",
    "CALLBACK_SIGNATURE_HEADER",
    "CANONICAL",
    "AmbiguousAttempt",
    "Attempt",
    "AttemptNotFound",
    "AwaSAError",
    "Cancel",
    "Cancelled",
    "CancelledDuplicate",
    "CelUnavailable",
    "CompactReceipt",
    "Complete",
    "Completed",
    "DatabaseError",
    "DlqEntry",
    "Duplicate",
    "DuplicateJob",
    "Ending",
    "EnqueuedJob",
    "ExpressionRefused",
    "Fail",
    "Failed",
    "InvalidSchemaName",
    "JobRow",
    "Kind",
    "MaterialisedAttempt",
    "Migrated",
    "NewJob",
    "NotAnAwaDatabase",
    "Outcome",
    "QueueStat",
    "QueueStorageAttempt",
    "QueueStorageJobs",
    "ReadOnlyTransaction",
    "Rescheduled",
    "Resolved",
    "Result",
    "RetriedFailed",
    "RetryAfter",
    "RetryBackoff",
    "RunningAttempt",
    "Settle",
    "Settlement",
    "Snooze",
    "Stale",
    "Unique",
    "UniqueConflict",
    "ValidationError",
    "attempt_of",
    "build_callback_url",
    "bulk_move_failed_to_dlq",
    "bulk_retry_from_dlq",
    "cancel_by_unique_key",
    "cancel_job",
    "complete_external",
    "discard_failed",
    "dlq_depth",
    "drain_queue",
    "enqueue",
    "enqueue_many",
    "fail_external",
    "get_dlq_job",
    "get_job",
    "heartbeat_callback",
    "jobs_view",
    "list_dlq",
    "list_jobs",
    "move_failed_to_dlq",
    "pause_queue",
    "purge_dlq",
    "purge_dlq_job",
    "queue_stats",
    "reschedule_canonical_attempt",
    "reschedule_canonical_attempts",
    "resolve_callback",
    "resume_external",
    "resume_queue",
    "retry_external",
    "retry_failed",
    "retry_from_dlq",
    "retry_job",
    "running_attempts",
    "settle",
    "settle_attempts",
    "settle_canonical_attempt",
    "settle_canonical_attempts",
    "sign_callback",
    "verify_callback",
]
