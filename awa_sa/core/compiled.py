"""Each statement compiled once per dialect and queue-storage schema, then executed as text.

``Connection.execute(core_statement)`` makes SQLAlchemy walk the statement to build its cache
key on every call, and for the 27-column move that walk costs more than our whole Python flow.
Our statements are immutable objects built once (:mod:`awa_sa.statements`), so the key is known
in advance: their identity, the dialect and the schema. The text is compiled once for that key,
with the schema rendered in, and sent as ``Connection.exec_driver_sql`` sends driver SQL: the
same connection, transaction, savepoints and events (``before_cursor_execute`` still fires),
without the walk, and answered by the fetched rows rather than a ``CursorResult`` built afresh
each call (:func:`awa_sa.core.internals.lean_execute`).

The flow always speaks in named values. A named-parameter driver (psycopg 3, psycopg2) takes
them as a dict; a positional one (asyncpg's ``$1``, pg8000's ``%s``) takes a tuple in the order
the compiler numbered the placeholders, which is fixed at compile time, so each call only picks
the values out in that order. ``exec_driver_sql`` applies no type processing, so the flow hands
over values each driver accepts as they are (see :mod:`awa_sa.core.drivers`).

For psycopg 3 it is also the text ``awa-sa sql`` prints, so the listing is what the database
receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary, ref

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from awa_sa.core.internals import Direct, lean_execute, positional_rows
from awa_sa.core.registry import P, Query, R, Rows
from awa_sa.tables.queue_storage import translate_map

Params = Mapping[str, Any] | tuple[Any, ...]
"""What the driver receives: named values, or positional ones in placeholder order."""


@dataclass(frozen=True, slots=True)
class Compiled:
    """A statement's text for one dialect and schema, and how its values are laid out.

    ``positions`` is None for a named-parameter dialect; otherwise the bind name behind each
    placeholder, in order (a name repeats where ``%s`` repeats; ``$n`` names each bind once).
    """

    sql: str
    defaults: Mapping[str, Any]
    positions: tuple[str, ...] | None = None

    def params(self, values: Mapping[str, Any]) -> Params:
        """*values* completed with the defaults, as the driver takes them.

        A required bind left out is the driver's error (named) or a ``KeyError`` (positional).
        """
        if self.defaults:
            values = {**self.defaults, **values}
        if self.positions is None:
            return values
        return tuple([values[name] for name in self.positions])


def compile_statement(stmt: ClauseElement, dialect: Dialect, schema: str | None) -> Compiled:
    """Compile *stmt* for *dialect*, with queue-storage schema *schema* rendered in (if any)."""
    options: dict[str, Any] = {}
    if schema is not None:
        options = {"schema_translate_map": translate_map(schema), "render_schema_translate": True}
    compiled = stmt.compile(dialect=dialect, **options)
    assert isinstance(compiled, SQLCompiler)  # a statement, not DDL
    # Nothing of ours expands at execution time ("expanding" IN lists, literal_execute), which
    # would make the text depend on the values.
    assert not compiled.post_compile_params
    assert not compiled.literal_execute_params
    defaults = {
        compiled.bind_names[bind]: bind.effective_value
        for bind in compiled.binds.values()
        if not bind.required
    }
    positions = tuple(compiled.positiontup or ()) if compiled.positional else None
    return Compiled(compiled.string, defaults, positions)


_cache: WeakKeyDictionary[Dialect, dict[tuple[ClauseElement, str | None], Compiled]] = (
    WeakKeyDictionary()
)
"""Per dialect, so an engine's entries go with it; statements are memoised, so keyed by identity."""


def compiled(stmt: ClauseElement, dialect: Dialect, schema: str | None = None) -> Compiled:
    """The text of *stmt* for *dialect* and *schema*, compiled on first use only."""
    global _recent  # noqa: PLW0603 -- one tuple, replaced whole: safe across threads
    recent = _recent
    if recent is not None and recent[0]() is dialect:
        per_dialect = recent[1]
    else:
        per_dialect = _cache.get(dialect) or _cache.setdefault(dialect, {})
        _recent = (ref(dialect), per_dialect)
    found = per_dialect.get((stmt, schema))
    if found is None:
        found = per_dialect[(stmt, schema)] = compile_statement(stmt, dialect, schema)
    return found


_recent: tuple[ref[Dialect], dict[tuple[ClauseElement, str | None], Compiled]] | None = None
"""The last dialect's entries, found without the ``WeakKeyDictionary``'s Python-level lookup
(a service has one engine, so nearly every call finds them here). The dialect itself is only
weakly held; the one dict of entries it keeps alive is bounded."""


def execute(
    conn: Connection,
    stmt: ClauseElement,
    params: Mapping[str, Any] | None = None,
    schema: str | None = None,
) -> Rows:
    """Run *stmt* on *conn*: its compiled text and *params*, in whatever transaction is open.

    As ``exec_driver_sql`` would, but answered by the fetched rows, as the statements' readers
    take them (:func:`awa_sa.core.internals.fetched`).
    """
    text = compiled(stmt, conn.dialect, schema)
    return lean_execute(conn, text.sql, text.params(params or {}))


Runner = Connection | Direct
"""Where a step's statements run: a Connection, or the Engine form's pooled connection
itself (:class:`awa_sa.core.internals.Direct`, for its autocommit try)."""


def run(conn: Runner, query: Query[P, R], params: P, schema: str | None = None) -> R:
    """Run *query* with *params* on *conn*, as the statement its parameters call for.

    :func:`execute` inlined: this is on the path of every call.
    """
    text = compiled(query.shape(params), conn.dialect, schema)
    values = text.params(query.binds(params))
    if query.by_position:
        positional_rows(text.sql)
    if isinstance(conn, Direct):
        return query.read(conn.send(text.sql, values))
    return query.read(lean_execute(conn, text.sql, values))
