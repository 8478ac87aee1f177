"""The async face: the same flow on ``AsyncEngine``/``AsyncConnection`` (psycopg 3 or asyncpg).

``AsyncConnection.run_sync`` drives the sync flow in SQLAlchemy's greenlet bridge, so there is one
copy of the decision logic and both faces send the same compiled statements.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from awa_sa.drivers import check_dialect
from awa_sa.errors import ValidationError, translated
from awa_sa.kinds import Attempt, Kind, Outcome
from awa_sa.reschedule import Call, prepare, prepare_all, run_all

__all__ = ["reschedule_canonical_attempt", "reschedule_canonical_attempts"]


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
    _check_bind(bind)
    return (await _within(bind, [prepare(job_id, run_lease, kind, error, progress)]))[0]


async def reschedule_canonical_attempts(
    bind: AsyncEngine | AsyncConnection, attempts: Iterable[Attempt]
) -> list[Outcome]:
    """Async :func:`awa_sa.reschedule_canonical_attempts`; same arguments, outcomes and errors."""
    _check_bind(bind)
    calls = prepare_all(attempts)
    return await _within(bind, calls) if calls else []


def _check_bind(bind: object) -> None:
    if not isinstance(bind, AsyncEngine | AsyncConnection):
        raise ValidationError(
            "bind must be a sqlalchemy AsyncEngine or AsyncConnection, got "
            f"{type(bind).__name__} (use the awa_sa functions for sync binds)"
        )
    check_dialect(bind.dialect, is_async=True)


async def _within(bind: AsyncEngine | AsyncConnection, calls: list[Call]) -> list[Outcome]:
    with translated():  # BEGIN and COMMIT too
        if isinstance(bind, AsyncEngine):
            async with bind.begin() as conn:
                return await conn.run_sync(run_all, calls)
        return await bind.run_sync(run_all, calls)
