"""SQL pieces every statement module uses: literals, JSON composition, bound rows, head rows.

Values travel only as bind parameters. One row binds scalars, several bind one array per
field, one element per row: an array of unknown length makes PostgreSQL plan the statement
afresh on every execution, which more than doubled the cost of a single call (measured: 2.1-2.5
ms against 0.94 ms for the canonical lock and move through raw psycopg), while scalars get a
plan it can cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import reduce
from importlib import import_module
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Select,
    SmallInteger,
    Text,
    bindparam,
    case,
    cast,
    column,
    func,
    literal_column,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB

from awa_sa.tables.canonical import Timestamp, job_state

_PG_DISTINCT_ON: Callable[..., Any] | None = getattr(
    import_module("sqlalchemy.dialects.postgresql"), "distinct_on", None
)
"""SQLAlchemy 2.1's DISTINCT ON construct; None on 2.0."""

EMPTY_OBJECT = cast(literal_column("'{}'"), JSONB)
EMPTY_ARRAY = cast(literal_column("'[]'"), JSONB)
EMPTY_ERRORS = cast(literal_column("'{}'"), ARRAY(JSONB))
ZERO: ColumnElement[Any] = literal_column("0")
SHARD0 = cast(ZERO, SmallInteger)
"""Cancelled rows never entered a lane; Awa files them under shard 0."""


def state(name: str) -> ColumnElement[Any]:
    return literal_column(f"'{name}'::awa.job_state", job_state)


def jsonb_param(name: str) -> ColumnElement[Any]:
    return text_param_as(name, JSONB)


def text_param_as(name: str, type_: Any) -> ColumnElement[Any]:
    return cast(bindparam(name, type_=Text), type_)


def concat(*parts: ColumnElement[Any]) -> ColumnElement[Any]:
    def op(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
        return a.op("||", return_type=JSONB)(b)

    return reduce(op, parts)


def rows_as_binds(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The binds of :func:`bound_rows`: one row's scalars, or one array per name for more."""
    if len(rows) == 1:
        return rows[0]
    return {name: [row[name] for row in rows] for name in rows[0]}


def bound_rows(
    name: str, fields: Sequence[tuple[str, str, Any]], batch: bool, ordinality: bool = False
) -> Any:
    """Rows ``name(column, ...)`` from ``(bind, column, type)`` fields, optionally with ``ord``.

    A batch binds one array per field and gets one row per element; a single row binds
    scalars (see the module docstring).
    """
    if not batch:
        return bound_row(fields, ordinality).subquery(name)
    arrays = func.unnest(*(bindparam(p, type_=ARRAY(t)) for p, _, t in fields))
    columns = [column(c, t) for _, c, t in fields]
    if ordinality:
        rows = arrays.table_valued(*columns, with_ordinality="ord")
    else:
        rows = arrays.table_valued(*columns)
    return rows.render_derived(name=name)


def bound_row(fields: Sequence[tuple[str, str, Any]], ordinality: bool = False) -> Select[Any]:
    """The one row of :func:`bound_rows`' single shape, as a SELECT of its scalars."""
    row = [cast(bindparam(p, type_=t), t).label(c) for p, c, t in fields]
    if ordinality:
        row.append(literal_column("1").label("ord"))
    return select(*row)


def distinct_on(query: Select[Any], *on: ColumnElement[Any]) -> Select[Any]:
    """``SELECT DISTINCT ON (on...)``, spelled as each SQLAlchemy line wants it.

    2.1 has ``postgresql.distinct_on`` and deprecates expressions in ``Select.distinct()``;
    2.0 has only the latter. Both compile to the same text.
    """
    if _PG_DISTINCT_ON is None:
        return query.distinct(*on)
    return query.ext(_PG_DISTINCT_ON(*on))  # type: ignore[attr-defined,unused-ignore]


def head_row(*columns: ColumnElement[Any]) -> CTE:
    """The first result row: read once, before anything is taken, whatever the plan."""
    return select(*columns).cte("head").prefix_with("MATERIALIZED")


def head_then(head: CTE, rows: Any, *columns: Any) -> Select[Any]:
    """The head row joined to *rows*: one row even when *rows* is empty, NULLs then."""
    return select(*head.c, *columns).select_from(head.outerjoin(rows, true()))


def scalar(head: CTE, name: str) -> Any:
    return select(head.c[name]).scalar_subquery()


_PYTHON_RANGE = (
    literal_column("timestamptz '0001-01-02Z'", Timestamp),
    literal_column("timestamptz '9999-12-30Z'", Timestamp),
)
"""Where a timestamptz still loads as a Python datetime in any session time zone."""


def representable(run_at: ColumnElement[Any]) -> ColumnElement[Any]:
    """*run_at* unchanged, or SQLSTATE 22008 when a Python datetime cannot hold it.

    ``awa.backoff_duration`` overflows silently from attempt 44 and can yield a run_at that
    PostgreSQL stores (a BC date, say) but the driver cannot read back. Failing inside the
    statement keeps the write from ever happening; shifting an out-of-range value by 300000
    years is PostgreSQL's own "timestamp out of range". *run_at* must be a stored or computed
    column, not the volatile expression itself, which would be evaluated twice.
    """
    low, high = _PYTHON_RANGE
    inside = (run_at >= low) & (run_at < high)
    years = case((inside, ZERO), else_=literal_column("300000"))
    return run_at + func.make_interval(years, type_=INTERVAL)
