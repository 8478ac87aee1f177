"""What the tests that run real awa-pg runtimes beside awa-sa share."""

from __future__ import annotations

from typing import Any

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


def pg_url(url: str) -> str:
    """*url* (a SQLAlchemy URL) as the libpq URL awa-pg's clients take."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[dict[str, Any]]:
    """*sql*'s rows as dicts, read in a transaction of their own."""
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]
