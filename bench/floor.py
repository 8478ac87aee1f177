"""The floor: awa-sa's own SQL text sent through raw psycopg 3, prepared, same round trips.

The text and its parameters are the library's own (:mod:`awa_sa.compiled`), so the only difference
left between the two sides is the SQLAlchemy layer itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from awa_sa.compiled import Compiled


def run_sync(conn: psycopg.Connection[Any], stmt: Compiled, values: Mapping[str, Any]) -> Any:
    return conn.execute(stmt.sql, stmt.params(values), prepare=True).fetchall()


async def run_async(
    conn: psycopg.AsyncConnection[Any], stmt: Compiled, values: Mapping[str, Any]
) -> Any:
    cur = await conn.execute(stmt.sql, stmt.params(values), prepare=True)
    return await cur.fetchall()
