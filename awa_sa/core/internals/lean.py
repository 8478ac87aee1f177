"""The lean execution of a statement's text, and the rows every path answers with.

``Connection.exec_driver_sql`` spends most of its client time after the statement has run:
it builds a ``CursorResult`` and, for driver SQL, a new ``CursorResultMetaData`` from the
cursor description on every call (per column: names, types, processors, the key map), which
for the 7-column answer of the one statement costs more than the statement's own send and
fetch on psycopg 3. Everything before it is kept: ``Connection._execute_context`` -- the same
call ``exec_driver_sql`` makes -- checks the transaction, autobegins it, fires
before_cursor_execute / after_cursor_execute with the statement text and parameters, echoes,
and routes any error through ``_handle_dbapi_exception`` (translation, handle_error, the
disconnect check, invalidation). Only the result differs: the execution context is the
dialect's own class with ``_setup_result_proxy`` (the step that builds the CursorResult)
replaced by one that fetches the rows (:func:`fetched`). Values are what the driver
returned, as with driver SQL before (no result processing there either). Where one of those
private names moved (``lookup.PATHS.lean``), ``exec_driver_sql`` itself runs the statement and
its rows are read into the same named tuples. tests/integration/test_compiled.py.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.engine.default import DefaultExecutionContext
from sqlalchemy.engine.interfaces import DBAPICursor

from awa_sa.core.internals import lookup

__all__ = ["fetched", "lean_execute", "learned_row", "positional_rows", "row_type"]


def _lean_result(self: DefaultExecutionContext) -> list[Any]:
    """``_setup_result_proxy`` of a lean context: the rows fetched, the cursor closed."""
    cursor = self.cursor
    rows = fetched(self.statement, cursor)
    cursor.close()
    return rows


def fetched(statement: str, cursor: DBAPICursor) -> list[Any]:
    """The rows *cursor* holds after running *statement*: tuples with named fields.

    Not a SQLAlchemy ``Result``: building one and reading its rows back through its key map
    was a third of what the flow adds to a call in the client. A named tuple reads as a
    ``Row`` does for the statements' readers (by position and by attribute). Its class is made
    from the cursor description once per statement text, whose answer has the same columns
    every time (psycopg 3 builds a ``Column`` object per column each time ``description`` is
    read).
    """
    row = _row_types.get(statement, UNKNOWN)
    if row is UNKNOWN:
        description = cursor.description
        row = learned_row(statement, None if description is None else [c[0] for c in description])
    return [] if row is None else list(map(row._make, cursor.fetchall()))


def row_type(statement: str) -> Any:
    """*statement*'s row class, None for a statement without rows, :data:`UNKNOWN` until one
    of its answers was seen."""
    return _row_types.get(statement, UNKNOWN)


def learned_row(statement: str, names: list[str] | None) -> Any:
    """*statement*'s row class, kept: the named tuple of an answer with columns *names* (None
    for a statement without rows). An unlabelled column (or a name that is not an identifier)
    becomes ``_<position>``, and no reader reads it by name."""
    row = None if names is None else namedtuple("Row", names, rename=True)
    _row_types[statement] = row
    return row


class PlainRow:
    """The row class of a statement whose reader takes its rows by position only: ``tuple``
    of the driver's tuple is that very tuple, so no second object is made per row (for a
    batch of thousands, that object and the collections it brings about cost more than
    the rest of reading the rows)."""

    _make = tuple


def positional_rows(statement: str) -> None:
    """Answer *statement* with the driver's own rows (:class:`PlainRow`), not named tuples."""
    _row_types[statement] = PlainRow


UNKNOWN: Any = object()
_row_types: dict[str, Any] = {}
"""Per statement text (ours are a bounded set): its answer's row class, None for no rows."""

_lean_contexts: dict[type[Any], type[DefaultExecutionContext]] = {}
"""The lean subclass of each dialect's execution context class."""


def _lean_context(dialect: Dialect) -> type[DefaultExecutionContext]:
    base = dialect.execution_ctx_cls
    lean = _lean_contexts.get(base)
    if lean is None:
        namespace = {"_setup_result_proxy": _lean_result, "__module__": __name__}
        lean = _lean_contexts[base] = type(f"Lean{base.__name__}", (base,), namespace)
    return lean


def lean_execute(
    conn: Connection, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]
) -> list[Any]:
    """``conn.exec_driver_sql(statement, parameters)``, answered by its rows (:func:`fetched`).

    ``_execute_context`` is declared to return a ``CursorResult``; the lean context makes it
    return the rows (tests/integration/test_compiled.py reads them both ways).
    """
    if not lookup.PATHS.lean:
        return _public_execute(conn, statement, parameters)
    dialect = conn.dialect
    rows: list[Any] = conn._execute_context(  # type: ignore[assignment]  # the lean context's
        dialect,
        _lean_context(dialect)._init_statement,
        statement,
        None,
        conn.get_execution_options(),
        statement,
        [parameters],
    )
    return rows


def _public_execute(
    conn: Connection, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]
) -> list[Any]:
    """:func:`lean_execute` by ``exec_driver_sql``: the same rows, through a ``CursorResult``."""
    result = conn.exec_driver_sql(statement, parameters)
    if not result.returns_rows:
        return []
    row = _row_types.get(statement, UNKNOWN)
    if row is UNKNOWN:
        row = learned_row(statement, list(result.keys()))
    return list(map(row._make, result.all()))
