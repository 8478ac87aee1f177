"""What the tests that run real awa-pg runtimes beside awa-sa share."""

from __future__ import annotations

import asyncio
from typing import Any

import awa
import sqlalchemy as sa

STILL = 3_600_000
"""A ring's rotation interval (ms) past the end of any run: no ring rotates, so none is pruned
(the maintenance that prunes a sealed slot drops its closures and terminal history with it,
and the tests read them afterwards)."""
STILL_RINGS = {
    "queue_storage_queue_rotate_interval_ms": STILL,
    "queue_storage_lease_rotate_interval_ms": STILL,
    "queue_storage_claim_rotate_interval_ms": STILL,
}
"""A runtime's ``start`` options that keep every ring still."""


LEADER_LOCK = 0x4157_415F_4D41_494E
"""Awa's maintenance-leader advisory lock key ("AWA_MAIN")."""


def hold_leadership(engine: sa.Engine) -> sa.Connection:
    """A session holding the maintenance-leader lock: no runtime becomes leader while it lives,
    so no promotion, rescue, rotation or dirty-mark recompute touches the rows a test reads.

    A runtime tries the lock as it starts (without it, ``health_check().leader`` is true within
    50 ms), so a runtime that has claimed its jobs and is not leader was kept out by this lock.
    """
    conn = engine.connect()
    assert conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK}).scalar()
    conn.commit()
    return conn


def pg_url(url: str) -> str:
    """*url* (a SQLAlchemy URL) as the libpq URL awa-pg's clients take."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[dict[str, Any]]:
    """*sql*'s rows as dicts, read in a transaction of their own."""
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]


async def until_idle(client: awa.AsyncClient, seconds: float = 60.0) -> None:
    """Until *client*'s runtime holds no job: its own completion of the last one handed over
    (the runtime's pace, so polled)."""
    for _ in range(int(seconds / 0.01)):
        health = await client.health_check()
        if all(q.in_flight == 0 for q in health.queues.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the runtime kept a job in flight for {seconds:.0f} s")
