"""Seed a running canonical attempt the way Awa 0.6.9's claim leaves it.

A real job is inserted ``available`` and later claimed by a worker: the claim sets ``state =
'running'``, adds one to ``attempt`` and to ``run_lease``, stamps ``attempted_at`` and
``heartbeat_at`` with ``now()`` and sets ``deadline_at = now() + <queue deadline>`` (five
minutes unless configured). A handler that registers a callback then sets ``callback_id`` and
``callback_timeout_at = now() + timeout``. One INSERT of the end state gives the same row and the
same unique claim: the claim trigger keeps ``(unique_key, id)`` exactly when the mask claims
``running``, whichever way the row got there. (The suite compares this row with one a real
awa-pg 0.6.9 worker claimed.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from awa_sa.core.errors import ValidationError

DEFAULT_UNIQUE_STATES = "11111000"
"""Awa's default mask: the key is held while scheduled, available, running, completed, retryable."""

NOT_WHILE_RUNNING = "11001000"
"""A mask that claims the key while scheduled, available and retryable, but not while running."""

DEFAULT_DEADLINE_SECS = 300.0
DEFAULT_CALLBACK_TIMEOUT_SECS = 3600.0

# unique_states goes in as text: asyncpg wants a BitString for a bit(8) parameter, and a helper
# that works only on psycopg would fail an asyncpg service's tests.
_INSERT = sa.text(
    """
    INSERT INTO awa.jobs_hot (
        kind, queue, args, state, priority, attempt, max_attempts, run_at, created_at,
        attempted_at, heartbeat_at, deadline_at, finalized_at, errors, metadata, tags, unique_key,
        unique_states, callback_id, callback_timeout_at, callback_filter, callback_on_complete,
        callback_on_fail, callback_transform, run_lease, progress
    ) VALUES (
        :kind, :queue, CAST(:args AS jsonb), 'running', :priority, :attempt, :max_attempts,
        coalesce(CAST(:attempted_at AS timestamptz), now()),
        coalesce(CAST(:attempted_at AS timestamptz), now()),
        coalesce(CAST(:attempted_at AS timestamptz), now()),
        coalesce(CAST(:attempted_at AS timestamptz), now()),
        coalesce(CAST(:attempted_at AS timestamptz), now())
            + make_interval(secs => CAST(:deadline_secs AS double precision)), :finalized_at,
        CAST(:errors AS jsonb[]), CAST(:metadata AS jsonb), CAST(:tags AS text[]), :unique_key,
        CAST(CAST(:unique_states AS text) AS bit(8)), :callback_id,
        now() + make_interval(secs => CAST(:callback_timeout_secs AS double precision)),
        :callback_filter, :callback_on_complete, :callback_on_fail, :callback_transform,
        :run_lease, CAST(:progress AS jsonb)
    )
    RETURNING id, run_lease
    """
)


def running_attempt(
    conn: sa.Connection,
    *,
    kind: str = "example_job",
    queue: str = "default",
    args: Any = None,
    priority: int = 2,
    attempt: int = 1,
    max_attempts: int = 25,
    metadata: Mapping[str, Any] | None = None,
    tags: Sequence[str] = (),
    unique_key: bytes | None = None,
    unique_states: str | None = None,
    callback_id: uuid.UUID | None = None,
    callback_timeout_secs: float = DEFAULT_CALLBACK_TIMEOUT_SECS,
    callback_filter: str | None = None,
    callback_on_complete: str | None = None,
    callback_on_fail: str | None = None,
    callback_transform: str | None = None,
    run_lease: int | None = None,
    errors: Sequence[Any] = (),
    finalized_at: datetime | None = None,
    progress: Any = None,
    deadline_secs: float = DEFAULT_DEADLINE_SECS,
    attempted_at: datetime | None = None,
) -> tuple[int, int]:
    """Insert a job into ``awa.jobs_hot`` as a worker's claim leaves it; return ``(id, run_lease)``.

    Runs in *conn*'s transaction (begun if none is open) and never commits: commit to let
    another connection see the attempt, or roll back to forget it. Defaults are Awa's insert
    defaults (queue ``default``, priority 2, 25 attempts, ``args`` ``{}``).

    ``unique_key`` is the key Awa would have hashed from the job (any bytes here);
    ``unique_states`` defaults to Awa's ``11111000`` when a key is given. If the mask claims
    ``running`` the key is taken now, as the claim trigger does, and a key another job holds
    fails with PostgreSQL's unique violation on ``idx_awa_jobs_unique``.

    ``run_lease`` defaults to ``attempt``: one claim per attempt, never snoozed (a snooze gives
    the attempt back but not the lease, so pass a larger lease to model one). ``errors`` are the
    JSON values earlier attempts left and ``progress`` the stored progress. ``finalized_at`` is
    None unless an earlier attempt was retried: Awa stamps it on the retryable row and keeps it
    through promotion and claim. ``callback_id`` wires a
    callback as ``register_callback`` would (timeout ``callback_timeout_secs`` from now); the
    other ``callback_*`` columns are the optional CEL expressions. ``attempted_at`` dates the
    claim (enqueue, heartbeat and deadline follow it) for an old claim, as an admin task that
    looks for attempts running too long needs; ``attempt=max_attempts`` seeds a final attempt.

    A second attempt, after a failure Awa recorded::

        >>> from awa_sa.testing import locate, running_attempt
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(
        ...         conn, kind="send_email", args={"to": "ada@example.com"}, attempt=2,
        ...         errors=[{"error": "smtp timed out", "attempt": 1}],
        ...     )
        ...     row = locate(conn, job_id)
        >>> (row.relation, row.state, row.attempt, lease, len(row.errors))
        ('awa.jobs_hot', 'running', 2, 2, 1)
    """
    if attempt < 1:
        raise ValidationError(f"a running attempt has attempt >= 1, got {attempt}")
    lease = attempt if run_lease is None else run_lease
    if lease < attempt:
        raise ValidationError(f"every claim bumps the lease, so run_lease >= attempt; got {lease}")
    if unique_key is not None and unique_states is None:
        unique_states = DEFAULT_UNIQUE_STATES
    row = conn.execute(
        _INSERT,
        {
            "kind": kind,
            "queue": queue,
            "args": json.dumps({} if args is None else args),
            "priority": priority,
            "attempt": attempt,
            "max_attempts": max_attempts,
            "deadline_secs": deadline_secs,
            "finalized_at": finalized_at,
            "errors": [json.dumps(error) for error in errors],
            "metadata": json.dumps(dict(metadata or {})),
            "tags": list(tags),
            "unique_key": unique_key,
            "unique_states": unique_states,
            "callback_id": callback_id,
            "callback_timeout_secs": None if callback_id is None else callback_timeout_secs,
            "callback_filter": callback_filter,
            "callback_on_complete": callback_on_complete,
            "callback_on_fail": callback_on_fail,
            "callback_transform": callback_transform,
            "run_lease": lease,
            "progress": None if progress is None else json.dumps(progress),
            "attempted_at": attempted_at,
        },
    ).one()
    return int(row.id), int(row.run_lease)


@dataclass(frozen=True, slots=True)
class ContestedAttempt:
    """A running attempt, and the newer duplicate that holds the unique key it will want back."""

    job_id: int
    run_lease: int
    holder_id: int


def contested_attempt(
    conn: sa.Connection,
    *,
    unique_key: bytes = b"contested",
    kind: str = "example_job",
    queue: str = "default",
    args: Any = None,
) -> ContestedAttempt:
    """A running attempt whose unique key a newer duplicate holds; commit to publish both.

    Awa's ``unique_states`` mask says in which states a job holds its key. The attempt's mask
    (:data:`NOT_WHILE_RUNNING`) lets go of the key while it runs, so a newer job with the same
    key was accepted and holds it (Awa's default mask, running). Re-scheduling the attempt needs
    the key back: on the canonical plane that raises ``UniqueConflict`` and the attempt stays
    running; once routing points at queue storage the outcome is ``CancelledDuplicate``, and the
    newer job keeps the key either way.
    """
    job_id, run_lease = running_attempt(
        conn,
        kind=kind,
        queue=queue,
        args=args,
        unique_key=unique_key,
        unique_states=NOT_WHILE_RUNNING,
    )
    holder_id, _ = running_attempt(conn, kind=kind, queue=queue, args=args, unique_key=unique_key)
    return ContestedAttempt(job_id, run_lease, holder_id)
