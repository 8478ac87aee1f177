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
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ClauseElement

from awa_sa import statements
from awa_sa.core import compiled


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

    The library's own compile (:mod:`awa_sa.core.compiled`), so the listing cannot drift from it.
    """
    return compiled.compile_statement(stmt, DIALECT, schema).sql


def _summary(builder: Callable[..., Any]) -> str:
    doc = inspect.getdoc(builder) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def plain(doc: str) -> str:
    """A docstring's text without its reST markup, for a SQL comment."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", doc)


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


# -- layout for reading: whitespace only, never a token ---------------------------------------

WIDTH = 100
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|%\(\w+\)s|[(),]|\s+|[^\s(),'\"%]+|%")
_CLAUSES = (
    "WITH ORDINALITY",  # not a clause: matched first so that WITH below does not cut it
    "WITH TIME ZONE",
    "WITH",
    "SELECT",
    "FROM",
    "WHERE",
    "GROUP BY",
    "HAVING",
    "ORDER BY",
    "LIMIT",
    "FOR UPDATE",
    "FOR SHARE",
    "RETURNING",
    "INSERT INTO",
    "DELETE FROM",
    "UPDATE",
    "SET",
    "VALUES",
    "ON CONFLICT",
    "USING",
    "LEFT OUTER JOIN",
    "JOIN",
    "UNION ALL",
)
_NOT_CLAUSES = ("WITH ORDINALITY", "WITH TIME ZONE")
_CONJUNCTIONS = ("AND", "OR")
_CASE = ("WHEN", "ELSE", "END")

Node = str | list["Node"]
"""A token, or a parenthesised group: ``["(", ...nodes, ")"]``."""


def formatted(sql: str) -> str:
    """*sql* laid out on lines of at most ``WIDTH`` characters where it can be, for review.

    Only whitespace between tokens changes (literals, quoted names and bind parameters are
    atoms), so the text means what the library sends: the listing's tests compare both token
    by token, and PostgreSQL prepares the printed text.
    """
    stack: list[list[Node]] = [[]]
    for token in _TOKEN.findall(sql):
        node = " " if token.isspace() else token
        if node == "(":
            stack.append(["("])
        elif node == ")" and len(stack) > 1:
            group = stack.pop()
            stack[-1].append([*group, ")"])
        else:
            stack[-1].append(node)
    return "\n".join(_lines(_strip(stack[0]), ""))


def _flat(nodes: list[Node]) -> str:
    return "".join(node if isinstance(node, str) else _flat(node) for node in nodes)


def _strip(nodes: list[Node]) -> list[Node]:
    while nodes and nodes[0] == " ":
        nodes = nodes[1:]
    while nodes and nodes[-1] == " ":
        nodes = nodes[:-1]
    return nodes


def _phrase_at(nodes: list[Node], at: int, phrases: tuple[str, ...]) -> str | None:
    """The first of *phrases* whose words begin at *at* after a space (or at the start)."""
    if at > 0 and nodes[at - 1] != " ":
        return None
    for phrase in phrases:
        words = phrase.split()
        span = nodes[at : at + 2 * len(words) - 1]
        if span[::2] == words and all(node == " " for node in span[1::2]):
            return phrase
    return None


def _cut(nodes: list[Node], before: tuple[str, ...]) -> list[list[Node]]:
    """*nodes* cut before each top-level phrase of *before* (a phrase is never cut inside)."""
    parts: list[list[Node]] = [[]]
    skip = 0
    for at, node in enumerate(nodes):
        phrase = None if skip else _phrase_at(nodes, at, before)
        if phrase is not None:
            skip = 2 * len(phrase.split()) - 1
            if at > 0 and phrase not in _NOT_CLAUSES:
                parts.append([])
        skip = max(skip - 1, 0)
        parts[-1].append(node)
    return [part for part in (_strip(p) for p in parts) if part]


def _items(nodes: list[Node]) -> list[list[Node]]:
    """*nodes* cut after each top-level comma."""
    parts: list[list[Node]] = [[]]
    for node in nodes:
        parts[-1].append(node)
        if node == ",":
            parts.append([])
    return [part for part in (_strip(p) for p in parts) if part]


def _lines(nodes: list[Node], indent: str) -> list[str]:
    flat = _flat(nodes)
    if len(indent) + len(flat) <= WIDTH:
        return [indent + flat]
    inner = indent + "    "
    clauses = _cut(nodes, _CLAUSES)
    if len(clauses) > 1:
        return [line for clause in clauses for line in _lines(clause, indent)]
    keyword = _phrase_at(nodes, 0, _CLAUSES)
    if keyword is not None and keyword not in _NOT_CLAUSES:
        rest = _strip(nodes[2 * len(keyword.split()) - 1 :])
        items = _items(rest)
        if len(items) > 1:
            return [indent + keyword, *(line for item in items for line in _lines(item, inner))]
    items = _items(nodes)
    if len(items) > 1:
        return [line for item in items for line in _lines(item, indent)]
    for hanging in (_CONJUNCTIONS, _CASE):
        parts = _cut(nodes, hanging)
        if len(parts) > 1:
            rest_lines = [line for part in parts[1:] for line in _lines(part, inner)]
            return [*_lines(parts[0], indent), *rest_lines]
    groups = [at for at, node in enumerate(nodes) if isinstance(node, list)]
    if not groups:
        return [indent + flat]
    # The leftmost sizeable group, so the text before it fits; what follows is laid out anew.
    sizeable = [i for i in groups if len(_flat([nodes[i]])) >= 30]
    at = sizeable[0] if sizeable else max(groups, key=lambda i: len(_flat([nodes[i]])))
    group = nodes[at]
    assert isinstance(group, list)
    return [
        indent + _flat(nodes[:at]) + "(",
        *_lines(_strip(group[1:-1]), inner),
        *_lines(_strip([")", *nodes[at + 1 :]]), indent),
    ]
