"""A private name gone: the path that needed it falls back to SQLAlchemy's public API, with one
warning per process and no error (awa_sa.core.internals.lookup).

SQLAlchemy is changed in place (a private method removed, another given a new signature), the
lookup is run again as it runs at import, and the paths it answers are put in force for the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection, Pool
from sqlalchemy.dialects import postgresql

from awa_sa.core import compiled
from awa_sa.core.internals import (
    PrivatePathUnavailable,
    connect_isolation_level,
    direct_allowed,
    lookup,
)
from awa_sa.core.internals.connecting import UNKNOWN_LEVEL
from awa_sa.tables import queue_storage


def _changed_invalidate(self: Pool, record: object) -> None:
    """``Pool._invalidate`` as a release might reshape it: another first parameter."""


def test_the_lookup_finds_every_name_on_this_sqlalchemy() -> None:
    found = lookup.look_up(public_only=False)
    assert found.missing == ()
    assert all(getattr(found, name) for name in found.__slots__ if name != "missing")
    assert found == lookup.PATHS or lookup.PUBLIC_ONLY


def test_a_missing_or_changed_name_takes_the_public_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(Connection, "_execute_context")
    monkeypatch.setattr(Pool, "_invalidate", _changed_invalidate)
    monkeypatch.setattr(lookup, "_warned", False)
    with pytest.warns(PrivatePathUnavailable) as warned:
        paths = lookup.look_up(public_only=False)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "Connection._execute_context" in message
    assert "Pool._invalidate" in message
    assert paths.missing == ("Connection._execute_context", "Pool._invalidate")
    assert not paths.lean
    assert not paths.direct
    assert not paths.asyncpg_context  # a part of the direct path, off with it
    assert not paths.asyncpg_native
    assert (paths.kept_greenlet, paths.isolation, paths.schema_map) == (True, True, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup.look_up(public_only=False) == paths  # once per process

    monkeypatch.setattr(lookup, "PATHS", paths)
    engine = sa.create_engine("postgresql+psycopg://nobody@localhost/none")
    assert not direct_allowed(engine)  # the Engine form keeps the Connection


def test_public_only_turns_every_path_off_in_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup, "_warned", False)
    monkeypatch.delattr(Connection, "_execute_context")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = lookup.look_up(public_only=True)
    assert not any(getattr(paths, name) for name in paths.__slots__ if name != "missing")
    assert paths.missing == ()
    assert not lookup._warned


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_environment_is_read_at_import(value: str) -> None:
    """``AWA_SA_PUBLIC_ONLY=1`` at import: every path off, and no warning (``-W error``)."""
    script = (
        "from awa_sa.core.internals import lookup; print(lookup.PUBLIC_ONLY, lookup.PATHS.direct)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        env={**os.environ, "AWA_SA_PUBLIC_ONLY": value, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
    )
    public = value == "1"
    assert done.stdout.split() == [str(public), str(not public)]
    assert done.stderr == ""


def _on_public_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup, "PATHS", lookup.look_up(public_only=True))


@pytest.mark.parametrize("isolation", [None, "SERIALIZABLE"])
def test_without_the_dialects_level_the_level_is_unknown(
    monkeypatch: pytest.MonkeyPatch, isolation: str | None
) -> None:
    """Unknown, so the Engine form asks the pooled connection; an execution option names it."""
    engine = sa.create_engine(
        "postgresql+psycopg://nobody@localhost/none", isolation_level=isolation
    )
    monkeypatch.setattr(lookup, "PATHS", lookup.look_up(public_only=False))
    assert connect_isolation_level(engine) == isolation
    _on_public_paths(monkeypatch)
    assert connect_isolation_level(engine) == UNKNOWN_LEVEL
    optioned = engine.execution_options(isolation_level="READ COMMITTED")
    assert connect_isolation_level(optioned) == "READ COMMITTED"


def test_a_translated_function_compiles_the_same_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ensure: Callable[..., Any] = queue_storage.ensure_lane_sequences
    statement = sa.select(ensure(sa.literal("q"), sa.literal(1), sa.literal(0)))
    dialect = postgresql.psycopg.dialect()
    private = compiled.compile_statement(statement, dialect, "awa_qs").sql
    _on_public_paths(monkeypatch)
    assert compiled.compile_statement(statement, dialect, "awa_qs").sql == private
    assert "awa_qs.ensure_lane_sequences(" in private
