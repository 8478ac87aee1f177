"""The async face: the same flow on ``AsyncEngine``/``AsyncConnection`` (psycopg async).

``AsyncConnection.run_sync`` drives the sync flow in SQLAlchemy's greenlet bridge, so there is one
copy of the decision logic and both faces hit the same compiled statements.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from awa_sa.errors import ValidationError, translated
from awa_sa.kinds import Kind, Outcome
from awa_sa.reschedule import prepare, run

__all__ = ["reschedule_canonical_attempt"]


async def reschedule_canonical_attempt(
    bind: AsyncEngine | AsyncConnection,
    job_id: int,
    run_lease: int,
    kind: Kind,
    *,
    error: Any = None,
    progress: Any = None,
) -> Outcome:
    """Async :func:`awa_sa.reschedule_canonical_attempt`; same arguments, outcomes and errors.

    Input is validated before a connection is even checked out.
    """
    if not isinstance(bind, AsyncEngine | AsyncConnection):
        raise ValidationError(
            "bind must be a sqlalchemy AsyncEngine or AsyncConnection, got "
            f"{type(bind).__name__} (use awa_sa.reschedule_canonical_attempt for sync binds)"
        )
    call = prepare(job_id, run_lease, kind, error, progress)
    with translated():  # BEGIN and COMMIT too
        if isinstance(bind, AsyncEngine):
            async with bind.begin() as conn:
                return await conn.run_sync(run, call)
        return await bind.run_sync(run, call)
