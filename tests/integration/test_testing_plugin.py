"""The pytest plugin, from the outside: temporary projects run by pytest in a subprocess.

The plugin is found as users find it, through its ``pytest11`` entry point. Each run is a fresh
process, so what it imports and starts is its own: a throwaway server is asked to put its
directory under ``$AWA_SA_PG_TMPDIR``, and the directory is checked afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import database_url

from awa_sa.testing.databases import NAME_PREFIX
from awa_sa.testing.server import SCRATCH_ENVIRONMENT_VARIABLE, EmbeddedPostgres, scratch_parent
from pytest_awa_sa import SERVER_URL_ENV, SERVER_URL_OPTION

pytestmark = pytest.mark.slow  # each test is a pytest subprocess, most with a server of its own
pytest_plugins = ["pytester"]

# Tests of a project that uses the kit: four pass, one fails, and no test sees another's rows.
PROJECT = """
import asyncio

import sqlalchemy as sa

from awa_sa.testing import running_attempt


def kinds(engine):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT kind FROM awa.jobs_hot ORDER BY kind")).scalars().all()


def test_first(awa_engine):
    with awa_engine.begin() as conn:
        running_attempt(conn, kind="first")
    assert kinds(awa_engine) == ["first"]


def test_second(awa_engine):
    with awa_engine.begin() as conn:
        running_attempt(conn, kind="second")
    assert kinds(awa_engine) == ["second"]


def test_wrong(awa_engine):
    assert kinds(awa_engine) == ["a row nobody wrote"]


def test_async_engine_on_the_same_database(awa_url, awa_engine, awa_async_engine):
    with awa_engine.begin() as conn:
        running_attempt(conn, kind="seen from async")

    async def read():
        async with awa_async_engine.connect() as conn:
            result = await conn.execute(sa.text("SELECT kind FROM awa.jobs_hot"))
            return result.scalars().all()

    assert asyncio.run(read()) == ["seen from async"]
    url = sa.make_url(awa_url).render_as_string()
    assert str(awa_async_engine.url) == str(awa_engine.url) == url


def test_canonical_with_both_substrates(awa_engine):
    with awa_engine.connect() as conn:
        routing = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
        substrates = conn.execute(sa.text(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'deferred_jobs'"
            " AND schemaname IN ('awa', 'awa_qs')"
        )).scalar()
    assert (routing, substrates) == (None, 2)
"""

# Reports what the run imported and whether the plugin was loaded at all.
REPORTING_CONFTEST = """
import json, os, sys

WATCHED = ("alembic", "awa_sa", "psycopg", "sqlalchemy")


def pytest_sessionfinish(session):
    loaded = sorted(m for m in sys.modules if m.startswith(WATCHED))
    report = {"plugin": session.config.pluginmanager.has_plugin("awa_sa"), "loaded": loaded}
    with open(os.environ["KIT_REPORT"], "w") as f:
        json.dump(report, f)
"""


@pytest.fixture
def scratch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where a throwaway server of the subprocess must put its directory.

    Not under pytest's ``tmp_path``: as root the server runs as ``postgres``, which may not
    enter root's private temporary directories.
    """
    path = Path(tempfile.mkdtemp(prefix="awa-sa-kit-scratch-", dir=scratch_parent()))
    path.chmod(0o755)
    monkeypatch.setenv(SCRATCH_ENVIRONMENT_VARIABLE, str(path))
    monkeypatch.delenv(SERVER_URL_ENV, raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def role(pg: EmbeddedPostgres) -> Iterator[tuple[str, sa.Engine]]:
    """A fresh role on the suite's server (its name is its password: the server asks for one),
    and an admin engine to grant it things."""
    name = f"kit_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database_url(pg, "postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{name}'")
    yield name, admin
    with admin.connect() as conn:
        # Fails while the role owns anything, such as a database the kit forgot to drop.
        conn.exec_driver_sql(f"DROP ROLE {name}")
    admin.dispose()


def kit_databases(admin: sa.Engine) -> list[str]:
    with admin.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                {"p": f"{NAME_PREFIX}%"},
            ).scalars()
        )


def test_a_project_using_the_fixtures_passes_fails_and_is_isolated(
    pytester: pytest.Pytester, scratch: Path
) -> None:
    pytester.makepyfile(test_project=PROJECT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*test_wrong*", "*a row nobody wrote*"])
    assert list(scratch.iterdir()) == []  # the throwaway server is gone


ASYNC_PROJECT = """
import pytest
import sqlalchemy as sa

from awa_sa import CancelledDuplicate, UniqueConflict, Snooze
from awa_sa.asyncio import reschedule_canonical_attempt
from awa_sa.testing import contested_attempt, installed_async_drivers, set_phase


@pytest.fixture(params=installed_async_drivers())
def awa_async_driver(request):
    return request.param


@pytest.mark.asyncio
async def test_a_duplicate_on_each_driver(awa_async_engine, awa_async_driver):
    assert awa_async_engine.dialect.driver == awa_async_driver
    async with awa_async_engine.begin() as conn:
        job = await conn.run_sync(contested_attempt)
    with pytest.raises(UniqueConflict):
        await reschedule_canonical_attempt(awa_async_engine, job.job_id, job.run_lease, Snooze(1))
    async with awa_async_engine.begin() as conn:
        await conn.run_sync(set_phase, "mixed_transition")
    outcome = await reschedule_canonical_attempt(
        awa_async_engine, job.job_id, job.run_lease, Snooze(1)
    )
    assert isinstance(outcome, CancelledDuplicate)


@pytest.mark.asyncio
@pytest.mark.parametrize("awa_async_driver", ["asyncpg"])
async def test_one_test_chooses_its_driver(awa_async_engine):
    async with awa_async_engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT 1"))).scalar() == 1
    assert awa_async_engine.dialect.driver == "asyncpg"
"""


def test_async_tests_of_a_fresh_project_run_on_each_async_driver(
    pytester: pytest.Pytester, scratch: Path
) -> None:
    """No configuration: pytest-asyncio (the testing extra's) in its default strict mode."""
    pytester.makepyfile(test_async_project=ASYNC_PROJECT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_a_duplicate_on_each_driver?psycopg?*PASSED*"])
    result.stdout.fnmatch_lines(["*test_a_duplicate_on_each_driver?asyncpg?*PASSED*"])


def test_no_server_starts_when_no_fixture_is_used(
    pytester: pytest.Pytester, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = pytester.path / "report.json"
    monkeypatch.setenv("KIT_REPORT", str(report))
    pytester.makeconftest(REPORTING_CONFTEST)
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    # pytest-postgresql, installed for this suite, imports psycopg as it loads.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:pytest_postgresql")
    result.assert_outcomes(passed=1)
    assert json.loads(report.read_text()) == {"plugin": True, "loaded": []}
    assert list(scratch.iterdir()) == []


def test_an_existing_server_and_xdist_workers_with_a_template_each(
    pytester: pytest.Pytester,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    pg: EmbeddedPostgres,
    role: tuple[str, sa.Engine],
) -> None:
    name, admin = role
    with admin.connect() as conn:
        conn.exec_driver_sql(f"ALTER ROLE {name} CREATEDB")  # CREATEDB is enough, no superuser
    ours = kit_databases(admin)  # this suite's own session runs on the same server
    seen = pytester.path / "seen"
    seen.mkdir()
    monkeypatch.setenv(SERVER_URL_ENV, f"postgresql://{name}:{name}@{pg.host}:{pg.port}/postgres")
    monkeypatch.setenv("KIT_SEEN", str(seen))
    pytester.makepyfile(
        test_shared="""
import os, pathlib, pytest
import sqlalchemy as sa

@pytest.mark.parametrize("n", range(6))
def test_database(awa_engine, n):
    with awa_engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO awa.jobs_hot (kind) VALUES ('mine')")
        count = conn.exec_driver_sql("SELECT count(*) FROM awa.jobs_hot").scalar()
        name = conn.exec_driver_sql("SELECT current_database()").scalar()
    pathlib.Path(os.environ["KIT_SEEN"], name).touch()
    assert count == 1
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=6)
    names = sorted(path.name for path in seen.iterdir())
    assert len(names) == 6
    sessions = {name.removeprefix(NAME_PREFIX).split("_")[0] for name in names}
    assert len(sessions) == 2  # one template per worker, distinct names
    # The project's clones and templates are dropped; `role` checks ownership.
    assert kit_databases(admin) == ours
    assert list(scratch.iterdir()) == []  # no throwaway server was started


def test_a_server_without_createdb_is_refused_clearly(
    pytester: pytest.Pytester, scratch: Path, pg: EmbeddedPostgres, role: tuple[str, sa.Engine]
) -> None:
    name, _ = role
    pytester.makepyfile(test_refused="def test_needs(awa_url):\n    pass\n")
    url = f"postgresql://{name}:{name}@{pg.host}:{pg.port}/postgres"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"{SERVER_URL_OPTION}={url}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*awa_sa.testing:*lacks CREATEDB*"])


HIDDEN_BINARIES = """
import awa_sa.testing.bindir as bindir

bindir._system = lambda: []
bindir._wheels = lambda: []
"""


def test_missing_binaries_are_reported_once_per_test(
    pytester: pytest.Pytester, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWA_SA_PG_BINDIR", raising=False)
    pytester.makeconftest(HIDDEN_BINARIES)
    pytester.makepyfile(test_needs="def test_needs(awa_url):\n    pass\n")
    # -rN: no short summary, whose line pytest cuts to the terminal's width except where $CI is set.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rN")
    result.assert_outcomes(errors=1)
    assert result.stdout.str().count("no PostgreSQL server binaries found") == 1
    assert "During handling" not in result.stdout.str()


def test_xdist_workers_start_a_throwaway_server_each(
    pytester: pytest.Pytester, scratch: Path
) -> None:
    pytester.makepyfile(
        test_two="""
import os, pathlib, sqlalchemy as sa

def port(url):
    return sa.make_url(url).port

def test_a(awa_url):
    pathlib.Path(os.environ["AWA_SA_PG_TMPDIR"], f"port-{port(awa_url)}").touch()

def test_b(awa_url):
    pathlib.Path(os.environ["AWA_SA_PG_TMPDIR"], f"port-{port(awa_url)}").touch()
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "each")
    result.assert_outcomes(passed=4)
    # Two servers on two ports, each removed afterwards (only the markers are left).
    assert len([path for path in scratch.iterdir() if path.name.startswith("port-")]) == 2
    assert [path.name for path in scratch.iterdir() if not path.name.startswith("port-")] == []


def test_the_core_imports_no_tool() -> None:
    """``import awa_sa`` (and its async face) loads neither the kit nor pytest nor Alembic."""
    code = (
        "import sys, awa_sa, awa_sa.asyncio; print(sorted(m for m in sys.modules if "
        "m.startswith(('awa_sa.testing', 'awa_sa.tools', 'awa_sa_schema', 'pytest', 'alembic', "
        "'click'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
