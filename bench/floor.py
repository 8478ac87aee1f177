"""The floor: awa-sa's own SQL text sent through raw psycopg 3, prepared, same round trips.

The text and parameters come from the library's compiled statements, so the only difference
left between the two sides is the SQLAlchemy layer itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.sql.base import Executable

from awa_sa.sql_listing import DIALECT


@dataclass(frozen=True)
class RawStatement:
    """One compiled statement: its text and how to turn call parameters into its binds."""

    sql: str
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, stmt: Executable) -> RawStatement:
        compiled = stmt.compile(dialect=DIALECT)  # type: ignore[attr-defined]
        values = {compiled.bind_names[b]: b.effective_value for b in compiled.binds.values()}
        return cls(compiled.string, values)

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: values.get(k, v) for k, v in self.defaults.items()}


def run_sync(conn: psycopg.Connection[Any], stmt: RawStatement, values: Mapping[str, Any]) -> Any:
    return conn.execute(stmt.sql, stmt.params(values), prepare=True).fetchall()


async def run_async(
    conn: psycopg.AsyncConnection[Any], stmt: RawStatement, values: Mapping[str, Any]
) -> Any:
    cur = await conn.execute(stmt.sql, stmt.params(values), prepare=True)
    return await cur.fetchall()
