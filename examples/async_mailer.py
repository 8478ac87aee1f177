"""The mailer's retry for an async service (asyncpg, or psycopg 3 async): one awaited call.

``test_async_mailer.py`` runs its tests on every async driver installed.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from awa_sa import Outcome, RetryAfter
from awa_sa.asyncio import reschedule_canonical_attempt


async def retry_later(engine: AsyncEngine, job_id: int, run_lease: int) -> Outcome:
    """Try the attempt ``(job_id, run_lease)`` again in ten minutes, in a transaction of its own."""
    async with engine.begin() as conn:
        return await reschedule_canonical_attempt(conn, job_id, run_lease, RetryAfter(600))
