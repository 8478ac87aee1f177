"""The server finder: its order of choice, the major it is asked for, and the server it starts.

CI runs the real-cluster tests once per supported major by setting ``$AWA_SA_PG_MAJOR``; the
first test here is what proves that such a run really ran on that major.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from awa_sa.testing import bindir
from awa_sa.testing.bindir import BINDIR_ENV, MAJOR_ENV, WHEELS, candidates, find_binaries
from awa_sa.testing.errors import EmbeddedPostgresError
from awa_sa.testing.server import EmbeddedPostgres


def server_version(pg: EmbeddedPostgres) -> str:
    engine = sa.create_engine(pg.url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar())
    finally:
        engine.dispose()


def test_the_suite_runs_on_the_major_it_was_asked_for(pg: EmbeddedPostgres) -> None:
    version = server_version(pg)
    assert version.split()[0] == find_binaries().version
    wanted = os.environ.get(MAJOR_ENV)
    if wanted:
        assert re.match(rf"{wanted}\.\d+", version), version
    assert int(version.split(".")[0]) in bindir.SUPPORTED_MAJORS


def test_system_binaries_come_before_the_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BINDIR_ENV, raising=False)
    sources = [b.source for b in candidates()]
    installed = [
        name.replace("_", "-") for name, _ in WHEELS if importlib.util.find_spec(name) is not None
    ]
    assert [s for s in sources if s != "system"] == installed
    assert sources[: sources.count("system")] == ["system"] * sources.count("system")
    for found in candidates():
        if found.source != "system":
            assert found.major == dict(WHEELS)[found.source.replace("-", "_")]


def test_the_bindir_variable_wins_and_a_wrong_one_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    last = candidates()[-1]
    monkeypatch.setenv(BINDIR_ENV, str(last.bindir))
    assert [b.bindir for b in candidates()] == [last.bindir]
    monkeypatch.setenv(BINDIR_ENV, str(tmp_path))
    with pytest.raises(EmbeddedPostgresError, match=re.escape(str(tmp_path))):
        candidates()


def test_the_major_variable_picks_that_major_or_says_none_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BINDIR_ENV, raising=False)
    for found in candidates():
        monkeypatch.setenv(MAJOR_ENV, str(found.major))
        assert find_binaries().major == found.major
    monkeypatch.setenv(MAJOR_ENV, "9")
    with pytest.raises(EmbeddedPostgresError, match=r"PostgreSQL 9 found.*awa-sa\[testing\]"):
        find_binaries()
