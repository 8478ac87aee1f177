"""A job as awa-pg's ``Job`` reports it: what the administering verbs answer and the reads
return, on either plane."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass(frozen=True, slots=True)
class JobRow:
    """A job's row, as awa-pg's ``Job`` reports it (after an administrative change, or read).

    ``storage`` names the plane that holds it: ``"canonical"`` (``awa.jobs_hot`` or
    ``awa.scheduled_jobs``), or a queue-storage schema.
    """

    id: int
    kind: str
    queue: str
    args: Any
    state: str
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    attempted_at: datetime | None
    finalized_at: datetime | None
    created_at: datetime
    errors: list[Any]
    metadata: Any
    tags: list[str]
    unique_key: bytes | None
    unique_states: str | None
    callback_id: UUID | None
    callback_timeout_at: datetime | None
    callback_filter: str | None
    callback_on_complete: str | None
    callback_on_fail: str | None
    callback_transform: str | None
    run_lease: int
    progress: Any
    storage: str
