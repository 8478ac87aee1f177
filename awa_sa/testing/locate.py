"""Where a job lives now, so that a service test asserts on what happened, not on SQL.

A re-scheduled attempt ends in one of three places: ``awa.scheduled_jobs`` under its own id
(canonical routing), ``S.deferred_jobs`` under a fresh id (routing flipped to queue-storage
schema ``S``), or ``S.done_entries`` as a cancelled duplicate. It stays in ``awa.jobs_hot`` when
the reschedule was stale or rolled back. A queue-storage job is found in ``S.deferred_jobs``,
``S.done_entries``, a compact completion (``S.receipt_completion_batches``), or still running (a
receipt in ``S.lease_claims`` or ``S.lease_claim_batches``). Canonical ids and ``S`` ids are
separate number spaces, so a bare id is looked up in one of them: the canonical one unless a
schema is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from awa_sa.core.errors import ValidationError
from awa_sa.settle.results import CancelledDuplicate, Migrated, Rescheduled
from awa_sa.tables.canonical import AWA_SCHEMA, jobs_hot, scheduled_jobs
from awa_sa.tables.queue_storage import (
    deferred_jobs,
    done_entries,
    lease_claim_batches,
    lease_claims,
    receipt_completion_batches,
    translate_map,
)


@dataclass(frozen=True, slots=True)
class Location:
    """One job's row: the table it is in, and the columns a test usually asserts on.

    ``schema`` is ``"awa"`` for the canonical tables (``jobs_hot``, ``scheduled_jobs``) and the
    queue-storage schema for ``deferred_jobs`` and ``done_entries`` (which may be ``"awa"``
    too: v040's default substrate lives there). ``errors`` is the canonical ``errors`` column,
    or the ``errors`` list of a queue-storage payload (empty when it has none).
    """

    schema: str
    table: str
    job_id: int
    state: str
    attempt: int
    run_lease: int
    run_at: datetime | None
    errors: tuple[Any, ...]

    @property
    def relation(self) -> str:
        """``schema.table``, e.g. ``"awa_qs.deferred_jobs"``."""
        return f"{self.schema}.{self.table}"


def _canonical(table: sa.Table) -> sa.Select[Any]:
    c = table.c
    return sa.select(
        sa.literal(table.name).label("table"),
        sa.cast(c.state, sa.Text).label("state"),
        c.attempt,
        c.run_lease,
        c.run_at,
        c.errors,
    ).where(c.id == sa.bindparam("job_id"))


def _queue_storage(table: sa.Table) -> sa.Select[Any]:
    c = table.c
    return sa.select(
        sa.literal(table.name).label("table"),
        sa.cast(c.state, sa.Text).label("state"),
        c.attempt,
        c.run_lease,
        c.run_at,
        c.payload["errors"].label("errors"),
        sa.literal(0).label("rank"),
    ).where(c.job_id == sa.bindparam("job_id"))


def _compact_completion() -> sa.Select[Any]:
    """A bare job's completion: one position of a ``receipt_completion_batches`` row."""
    c = receipt_completion_batches.c
    at = sa.func.array_position(c.job_ids, sa.bindparam("job_id", type_=sa.BigInteger))
    return sa.select(
        sa.literal(receipt_completion_batches.name).label("table"),
        sa.literal("completed").label("state"),
        c.attempts[at].label("attempt"),
        c.run_leases[at].label("run_lease"),
        sa.null().label("run_at"),
        sa.null().label("errors"),
        sa.literal(0).label("rank"),
    ).where(at.is_not(None))


def _running_receipt() -> sa.Select[Any]:
    """A receipt still running: last, since a closed one leaves its row behind."""
    c = lease_claims.c
    return sa.select(
        sa.literal(lease_claims.name).label("table"),
        sa.literal("running").label("state"),
        c.attempt,
        c.run_lease,
        sa.null().label("run_at"),
        sa.null().label("errors"),
        sa.literal(1).label("rank"),
    ).where(c.job_id == sa.bindparam("job_id"), c.closed_at.is_(None))


def _running_compact_receipt() -> sa.Select[Any]:
    """The same for a compact receipt: one position of a ``lease_claim_batches`` row."""
    c = lease_claim_batches.c
    at = sa.func.array_position(c.job_ids, sa.bindparam("job_id", type_=sa.BigInteger))
    return sa.select(
        sa.literal(lease_claim_batches.name).label("table"),
        sa.literal("running").label("state"),
        c.attempts[at].label("attempt"),
        c.run_leases[at].label("run_lease"),
        sa.null().label("run_at"),
        sa.null().label("errors"),
        sa.literal(1).label("rank"),
    ).where(at.is_not(None))


_CANONICAL = sa.union_all(_canonical(jobs_hot), _canonical(scheduled_jobs))
_QS_ROWS = sa.union_all(
    _queue_storage(deferred_jobs),
    _queue_storage(done_entries),
    _compact_completion(),
    _running_receipt(),
    _running_compact_receipt(),
).subquery("rows")
_QUEUE_STORAGE = (
    sa.select(*(c for c in _QS_ROWS.c if c.name != "rank"))
    .order_by(_QS_ROWS.c.rank, _QS_ROWS.c.run_lease.desc())
    .limit(1)
)
_ROUTED_SCHEMA = sa.select(sa.func.awa.active_queue_storage_schema())


def locate(
    conn: sa.Connection,
    job: int | Rescheduled | Migrated | CancelledDuplicate,
    *,
    schema: str | None = None,
) -> Location | None:
    """The row of *job* now, or None when no table has it.

    *job* is an outcome or an id. ``Rescheduled`` and a bare id are canonical ids, unless
    ``schema`` names a queue-storage schema to look in instead (a queue-storage attempt's
    ``Rescheduled`` is under its schema: ``schema=attempt.storage``). ``Migrated`` and
    ``CancelledDuplicate`` carry ids of queue-storage schema ``schema``, by default the one
    routing points at now. Reads in *conn*'s transaction, so it sees that transaction's writes.

    Where a snoozed attempt went, and when it runs again::

        >>> from awa_sa import Snooze, reschedule_canonical_attempt
        >>> from awa_sa.testing import locate, running_attempt
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(conn)
        >>> outcome = reschedule_canonical_attempt(engine, job_id, lease, Snooze(30))
        >>> with engine.connect() as conn:
        ...     row = locate(conn, outcome)
        >>> (row.relation, row.state, row.run_at == outcome.run_at)
        ('awa.scheduled_jobs', 'scheduled', True)
    """
    if isinstance(job, Migrated | CancelledDuplicate):
        job_id = job.job_id
        schema = schema or _routed_schema(conn)
    elif isinstance(job, Rescheduled):
        job_id = job.job_id
    elif isinstance(job, int) and not isinstance(job, bool):
        job_id = job
    else:
        raise ValidationError(f"job must be an id or an outcome that names one, got {job!r}")
    if schema is None:
        row = conn.execute(_CANONICAL, {"job_id": job_id}).one_or_none()
        where = AWA_SCHEMA
    else:
        row = conn.execute(
            _QUEUE_STORAGE,
            {"job_id": job_id},
            execution_options={"schema_translate_map": translate_map(schema)},
        ).one_or_none()
        where = schema
    if row is None:
        return None
    return Location(
        schema=where,
        table=row.table,
        job_id=job_id,
        state=row.state,
        attempt=row.attempt,
        run_lease=row.run_lease,
        run_at=row.run_at,
        errors=tuple(row.errors or ()),
    )


def _routed_schema(conn: sa.Connection) -> str:
    schema: str | None = conn.execute(_ROUTED_SCHEMA).scalar_one()
    if schema is None:
        raise ValidationError(
            "routing is canonical now, so the queue-storage schema of this outcome is unknown; "
            "pass schema="
        )
    return schema
