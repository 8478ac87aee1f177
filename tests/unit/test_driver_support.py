"""Which drivers awa-sa accepts, and how it lays out values for positional ones: no server.

The same drivers against real databases are tests/integration/test_drivers.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa
from recording import recording
from sqlalchemy.dialects import registry, sqlite
from sqlalchemy.dialects.postgresql import asyncpg as sa_asyncpg
from sqlalchemy.dialects.postgresql import pg8000 as sa_pg8000
from sqlalchemy.dialects.postgresql import psycopg as sa_psycopg
from sqlalchemy.dialects.postgresql import psycopg2 as sa_psycopg2
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
from awa_sa import Attempt, Snooze, ValidationError, compiled, statements
from awa_sa.drivers import ASYNC_DRIVERS, SYNC_DRIVERS, check_dialect

# -- binds awa-sa does not support -----------------------------------------------------------


class UntestedDialect(sa_psycopg2.PGDialect_psycopg2):
    driver = "untested"


def test_unsupported_binds_are_refused_before_any_statement() -> None:
    sqlite = sa.create_engine("sqlite://")
    sync_names = "postgresql+psycopg, postgresql+psycopg2, postgresql+pg8000"
    with recording(sqlite) as sent:
        with pytest.raises(ValidationError, match=re.escape(sync_names)):
            awa_sa.reschedule_canonical_attempt(sqlite, 1, 1, Snooze(1))
        with sqlite.connect() as conn, pytest.raises(ValidationError, match="sqlite"):
            awa_sa.reschedule_canonical_attempts(conn, [Attempt(1, 1, Snooze(1))])
    assert sent == []  # no statement, and no transaction begun either
    # A PostgreSQL driver nobody tested (a dialect registered under another driver name).
    registry.register("postgresql.untested", __name__, "UntestedDialect")
    untested = sa.create_engine("postgresql+untested://nobody@localhost/none")
    with pytest.raises(ValidationError, match=re.escape("postgresql+untested")):
        awa_sa.reschedule_canonical_attempt(untested, 1, 1, Snooze(1))
    # An async driver's engine handed to the sync face.
    on_asyncpg = create_async_engine("postgresql+asyncpg://nobody@localhost/none")
    with pytest.raises(ValidationError, match=r"awa_sa\.asyncio"):
        awa_sa.reschedule_canonical_attempt(on_asyncpg.sync_engine, 1, 1, Snooze(1))


@pytest.mark.parametrize(
    ("dialect", "is_async", "names"),
    [
        (sa_pg8000.dialect(), True, "postgresql+psycopg, postgresql+asyncpg"),
        (sqlite.dialect(), True, "postgresql+psycopg, postgresql+asyncpg"),
        (sa_psycopg2.dialect(), False, None),
        (sa_pg8000.dialect(), False, None),
        (sa_psycopg.dialect(), False, None),
        (sa_psycopg.dialect_async(), True, None),
        (sa_asyncpg.dialect(), True, None),
    ],
)
def test_supported_drivers_by_face(dialect: Any, is_async: bool, names: str | None) -> None:
    if names is None:
        check_dialect(dialect, is_async)
    else:
        with pytest.raises(ValidationError, match=re.escape(names)):
            check_dialect(dialect, is_async)
    assert set(SYNC_DRIVERS) | set(ASYNC_DRIVERS) == {"psycopg", "psycopg2", "pg8000", "asyncpg"}


# -- positional drivers: how named values become placeholders ------------------------------


@pytest.mark.parametrize(
    "dialect", [sa_asyncpg.dialect(), sa_pg8000.dialect()], ids=["asyncpg", "pg8000"]
)
def test_positional_layout_names_every_placeholder(dialect: Any) -> None:
    """Each placeholder maps to a bind of the statement, in order, and every bind is used."""
    for builder in statements.all_builders():
        for schema in ("awa", "awa_qs"):
            sent = compiled.compiled(builder(), dialect, schema)
            assert sent.positions is not None
            names = {b.key for b in builder().compile(dialect=dialect).binds.values()}
            assert set(sent.positions) == names
            if dialect.paramstyle == "format":
                assert sent.sql.count("%s") == len(sent.positions)
                assert sent.positions or "%" not in sent.sql  # pg8000 sends these as they are
            else:
                numbers = {int(n) for n in re.findall(r"\$(\d+)", sent.sql)}
                assert numbers == set(range(1, len(sent.positions) + 1))
            values = {name: name for name in names}
            assert sent.params(values) == tuple(sent.positions)
