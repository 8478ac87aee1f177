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
from sqlalchemy.dialects.postgresql import psycopg2cffi as sa_psycopg2cffi
from sqlalchemy.dialects.sqlite import aiosqlite as sa_aiosqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
from awa_sa import Attempt, Snooze, ValidationError, statements
from awa_sa.core import compiled
from awa_sa.core.drivers import check_dialect

# -- binds awa-sa does not support -----------------------------------------------------------


class UntestedDialect(sa_psycopg2.PGDialect_psycopg2):
    driver = "untested"


registry.register("postgresql.untested", __name__, "UntestedDialect")
UNTESTED_URL = "postgresql+untested://nobody@localhost/none"
"""A PostgreSQL driver nobody tested: a dialect registered under another driver name."""


def test_unsupported_binds_are_refused_before_any_statement() -> None:
    sqlite = sa.create_engine("sqlite://")
    sync_names = "postgresql+psycopg, postgresql+psycopg2, postgresql+pg8000"
    with recording(sqlite) as sent:
        with pytest.raises(ValidationError, match=re.escape(sync_names)):
            awa_sa.reschedule_canonical_attempt(sqlite, 1, 1, Snooze(1))
        with sqlite.connect() as conn, pytest.raises(ValidationError, match="sqlite"):
            awa_sa.reschedule_canonical_attempts(conn, [Attempt(1, 1, Snooze(1))])
    assert sent == []  # no statement, and no transaction begun either
    untested = sa.create_engine(UNTESTED_URL)
    with pytest.raises(ValidationError, match=re.escape("postgresql+untested")):
        awa_sa.reschedule_canonical_attempt(untested, 1, 1, Snooze(1))
    # An async driver's engine handed to the sync face.
    on_asyncpg = create_async_engine("postgresql+asyncpg://nobody@localhost/none")
    with pytest.raises(ValidationError, match=r"awa_sa\.asyncio"):
        awa_sa.reschedule_canonical_attempt(on_asyncpg.sync_engine, 1, 1, Snooze(1))


def _shipped() -> list[Dialect]:
    """Every PostgreSQL dialect SQLAlchemy ships, one nobody tested, and another database's, sync
    and async: the drivers a caller could hand either face."""
    return [
        sa_psycopg.dialect(),
        sa_psycopg.dialect_async(),
        sa_psycopg2.dialect(),
        sa_psycopg2cffi.dialect(),
        sa_pg8000.dialect(),
        sa_asyncpg.dialect(),
        sa.create_engine(UNTESTED_URL).dialect,
        sqlite.dialect(),
        sa_aiosqlite.dialect(),
    ]


def _accepted(is_async: bool) -> set[str]:
    """What the face takes of :func:`_shipped`, as ``name+driver`` (``(async)`` if async).

    An ``AsyncEngine``'s dialect is always async (``create_async_engine`` refuses the others);
    an ``Engine``'s may be either, since ``AsyncEngine.sync_engine`` is one.
    """
    taken = set()
    for dialect in _shipped():
        if is_async and not dialect.is_async:
            continue
        try:
            check_dialect(dialect, is_async)
        except ValidationError:
            continue
        taken.add(f"{dialect.name}+{dialect.driver}{' (async)' if dialect.is_async else ''}")
    return taken


def test_each_face_accepts_exactly_the_tested_drivers() -> None:
    """The drivers tests/integration/test_drivers.py runs on, and no other: asked of
    ``check_dialect`` for each dialect, not read from the module's constants."""
    assert _accepted(is_async=False) == {
        "postgresql+psycopg",
        "postgresql+psycopg2",
        "postgresql+pg8000",
    }
    assert _accepted(is_async=True) == {"postgresql+psycopg (async)", "postgresql+asyncpg (async)"}


@pytest.mark.parametrize(
    ("dialect", "is_async", "names"),
    [
        (sa_pg8000.dialect(), True, "postgresql+psycopg, postgresql+asyncpg"),
        (sqlite.dialect(), True, "postgresql+psycopg, postgresql+asyncpg"),
        (
            sa_psycopg2cffi.dialect(),
            False,
            "postgresql+psycopg, postgresql+psycopg2, postgresql+pg8000",
        ),
        (sa_asyncpg.dialect(), False, "use awa_sa.asyncio"),
    ],
)
def test_a_refusal_names_what_the_face_takes(dialect: Dialect, is_async: bool, names: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(names)):
        check_dialect(dialect, is_async)


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
