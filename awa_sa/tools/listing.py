"""Every statement awa-sa can send, rendered as PostgreSQL text for ``awa-sa sql``.

The listing is derived, never written by hand: it walks the public builders of
:mod:`awa_sa.statements`, calls each with every value its ``Literal``/``bool`` parameters allow,
and compiles what the library itself would execute. A hand-kept copy would drift from the code
the first time a builder changed, which is exactly when a reviewer or DBA reads it.

Queue-storage tables sit under a placeholder schema; the library renders the real name into the
text it sends, and so does the listing, so the reader sees ``awa_qs.deferred_jobs``.
"""

from __future__ import annotations

import inspect
import itertools
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.base import Executable
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


DIALECT: Dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]
"""psycopg 3, the driver awa-sa runs on, named explicitly: SQLAlchemy 2.0's default PostgreSQL
dialect is psycopg2's, which renders bind parameters without their casts."""


def compile_statement(stmt: ClauseElement, schema: str) -> str:
    """The text PostgreSQL receives for *stmt* when routed to queue-storage schema *schema*.

    The library's own compile (:mod:`awa_sa.compiled`), so the listing cannot drift from it.
    """
    return compiled.compile_statement(stmt, DIALECT, schema).sql


def _choices(annotation: object) -> tuple[object, ...] | None:
    """The finite set of values a parameter can take, or None when it is open-ended."""
    if annotation is bool:
        return (False, True)
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return None


def _unwrap(obj: Any) -> Callable[..., Any]:
    # functools.cache keeps the real function (and its annotations) in __wrapped__.
    return typing.cast(Callable[..., Any], inspect.unwrap(obj))


def builders() -> Iterator[tuple[str, Callable[..., Any]]]:
    """Public callables defined in :mod:`awa_sa.statements` whose parameters are all finite."""
    for name, obj in vars(statements).items():
        if name.startswith("_") or not callable(obj) or isinstance(obj, type):
            continue
        func = _unwrap(obj)
        if not isinstance(func, types.FunctionType) or func.__module__ != statements.__name__:
            continue
        hints = typing.get_type_hints(func)
        if not inspect.isclass(hints.get("return")) or not issubclass(hints["return"], Executable):
            continue  # a helper such as all_builders(), not a statement
        yield name, obj


def variants(builder: Callable[..., Any]) -> list[dict[str, object]]:
    """Every combination of argument values the builder accepts."""
    func = _unwrap(builder)
    hints = typing.get_type_hints(func)
    params = list(inspect.signature(func).parameters)
    options = []
    for p in params:
        choices = _choices(hints.get(p))
        if choices is None:
            raise TypeError(f"statements.{func.__name__}: cannot enumerate parameter {p!r}")
        options.append(choices)
    return [dict(zip(params, combo, strict=True)) for combo in itertools.product(*options)]


def _summary(builder: Callable[..., Any]) -> str:
    doc = inspect.getdoc(builder) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def render_all(schema: str = "awa") -> list[Block]:
    """Every statement, compiled for PostgreSQL with *schema* as the queue-storage schema."""
    blocks = []
    for name, builder in builders():
        for args in variants(builder):
            stmt = builder(**args)
            blocks.append(Block(name, args, _summary(builder), compile_statement(stmt, schema)))
    return blocks
