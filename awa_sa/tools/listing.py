"""Every statement awa-sa can send, rendered as PostgreSQL text for ``awa-sa sql``.

The listing is derived, never written by hand: :func:`awa_sa.statements.all_builders` calls
each registered builder with every value its ``Literal``/``bool`` parameters allow, and the
listing compiles what the library itself would execute. A hand-kept copy would drift from the
code the first time a builder changed, which is exactly when a reviewer or DBA reads it.

Queue-storage tables sit under a placeholder schema; the library renders the real name into the
text it sends, and so does the listing, so the reader sees ``awa_qs.deferred_jobs``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ClauseElement

from awa_sa import compiled, statements


@dataclass(frozen=True)
class Block:
    """One printed statement: which builder call produced it, and its compiled text."""

    builder: str
    arguments: dict[str, object] = field(default_factory=dict)
    description: str = ""
    sql: str = ""

    @property
    def title(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"{self.builder}({args})"


DIALECT: Dialect = PGDialect_psycopg()
"""psycopg 3, the driver awa-sa runs on, named explicitly: SQLAlchemy 2.0's default PostgreSQL
dialect is psycopg2's, which renders bind parameters without their casts."""


def compile_statement(stmt: ClauseElement, schema: str) -> str:
    """The text PostgreSQL receives for *stmt* when routed to queue-storage schema *schema*.

    The library's own compile (:mod:`awa_sa.compiled`), so the listing cannot drift from it.
    """
    return compiled.compile_statement(stmt, DIALECT, schema).sql


def _summary(builder: Callable[..., Any]) -> str:
    doc = inspect.getdoc(builder) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def render_all(schema: str = "awa") -> list[Block]:
    """Every statement, compiled for PostgreSQL with *schema* as the queue-storage schema."""
    return [
        Block(
            build.func.__name__,
            build.keywords,
            _summary(build.func),
            compile_statement(build(), schema),
        )
        for build in statements.all_builders()
    ]
