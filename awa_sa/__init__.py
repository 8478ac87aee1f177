"""awa-sa: typed SQLAlchemy Core data access for Awa v040.

The public surface is re-exported here; ``awa_sa.asyncio`` holds the async face.
"""

from awa_sa.errors import (
    AwaSAError,
    DatabaseError,
    InvalidSchemaName,
    NotAnAwaDatabase,
    UniqueConflict,
    ValidationError,
)
from awa_sa.kinds import (
    Attempt,
    CancelledDuplicate,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
)
from awa_sa.reschedule import reschedule_canonical_attempt, reschedule_canonical_attempts
from awa_sa.running import RunningAttempt, running_attempts

__all__ = [
    "Attempt",
    "AwaSAError",
    "CancelledDuplicate",
    "DatabaseError",
    "InvalidSchemaName",
    "Kind",
    "Migrated",
    "NotAnAwaDatabase",
    "Outcome",
    "Rescheduled",
    "RetryAfter",
    "RetryBackoff",
    "RunningAttempt",
    "Snooze",
    "Stale",
    "UniqueConflict",
    "ValidationError",
    "reschedule_canonical_attempt",
    "reschedule_canonical_attempts",
    "running_attempts",
]
