"""Disposable PostgreSQL for the suite: one server, two template databases, a clone per test.

The server and the fixture template are the testing kit's (``awa_databases``, from the
``pytest_awa_sa`` plugin): a throwaway server, run as the ``postgres`` account when we are root
(PostgreSQL refuses root; CI is root), and the Alembic-built v040 fixture. The real-cluster
template is built once on the same server by the published ``awa`` CLI. Each test gets its own
``CREATE DATABASE ... TEMPLATE`` clone, so tests may commit freely and never see each other's
rows.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cpu_usage import pytest_runtest_protocol  # noqa: F401 # each test's CPU, when asked
from pytest_postgresql.janitor import DatabaseJanitor
from racing import RealTransitions
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from xdist.scheduler import LoadScopeScheduling

import awa_sa_schema  # built by awa_sa_schema/ (Alembic)
from awa_sa.testing.bindir import find_binaries
from awa_sa.testing.databases import Databases
from awa_sa.testing.errors import EmbeddedPostgresError
from awa_sa.testing.phases import PHASES
from awa_sa.testing.server import EmbeddedPostgres


def pytest_report_header() -> str:
    """Which server binaries the run uses; ``$AWA_SA_PG_MAJOR`` picks the major (CI: each)."""
    try:
        found = find_binaries()
    except EmbeddedPostgresError as exc:
        return f"awa-sa server: {exc}"
    return f"awa-sa server: PostgreSQL {found.version} ({found.source}: {found.bindir})"


QUIET = (
    "tests/integration/test_queue_storage_worker.py",
    "tests/integration/test_queue_storage_soak.py",
)
"""Modules whose real awa-pg runtimes each load both cores (three at once in the soak): each is one
group, its tests one after the other on one worker, so that no module runs two of its own
runtimes' tests at once. The two modules may run beside each other: their reads wait for the
runtime's rows, not for a quiet machine (issue 39)."""


@cache
def _shares_a_set_up(path: Path) -> bool:
    """Whether the test module at *path* defines a fixture wider than one test (a seeded
    cluster, a PgBouncer, one run of the bench), read from its source."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            for keyword in decorator.keywords:
                scope = keyword.value
                if keyword.arg == "scope" and not (
                    isinstance(scope, ast.Constant) and scope.value == "function"
                ):
                    return True
    return False


class ModuleGroups(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """``--dist loadgroup``, as this suite means it: a module's tests stay on one worker
    when they share a set-up, so that it is built once (as in a run without workers);
    every other test goes to whichever worker is free.

    The groups are decided here, on the controller, from the nodeid and the module's
    source: xdist's own loadgroup reads groups from a suffix its workers write into
    ``item._nodeid``, which pytest 9.2 no longer reads (its nodeid lives elsewhere), so
    xdist_group markers group nothing there.
    """

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", maxsplit=1)[0]
        path = self.config.rootpath / module
        if module in QUIET or (path.suffix == ".py" and _shares_a_set_up(path)):
            return module
        return nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ModuleGroups | None:
    """The scheduler of ``--dist loadgroup`` (``./dev test``, CI)."""
    if config.getoption("dist") == "loadgroup":
        return ModuleGroups(config, log)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the ``slow`` tests go first (``--no-loadscope-reorder`` keeps this
    order, and the controller schedules in the order its workers collected): a minute-long
    test started last would run on alone while the other workers sit idle.

    A worker's ``dist`` is "no" (xdist keeps only ``loadgroup`` there), so both are read.
    """
    if config.getoption("loadgroup", False) or config.getoption("dist", "no") != "no":
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def pg(awa_databases: Databases) -> EmbeddedPostgres:
    """The session's throwaway server: the testing kit's, so a run starts one server."""
    if awa_databases.server is None:
        pytest.fail("the suite runs on a throwaway server; unset $AWA_SA_TEST_SERVER_URL")
    return awa_databases.server


def database_url(pg: EmbeddedPostgres, dbname: str, driver: str = "psycopg") -> str:
    return pg.database_url(dbname, f"postgresql+{driver}")


def _janitor(
    pg: EmbeddedPostgres, dbname: str, *, template: str | None = None, as_template: bool = False
) -> DatabaseJanitor:
    return DatabaseJanitor(
        user=pg.user,
        host=pg.host,
        port=pg.port,
        password=pg.password,
        dbname=dbname,
        template_dbname=template,
        as_template=as_template,
    )


def awa_cli() -> str:
    """The ``awa`` binary from the awa-cli wheel installed beside this interpreter."""
    beside = Path(sys.executable).with_name("awa")
    found = str(beside) if beside.exists() else shutil.which("awa")
    if not found:
        pytest.fail("the awa CLI (pip install awa-cli==0.6.9) is not installed")
    return found


@cache
def awa_release() -> str:
    """The installed awa-cli's version (``0.6.9``); CI runs the real clusters on 0.6.6 too."""
    return subprocess.run(
        [awa_cli(), "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]


@cache
def _has_quiesced_flag() -> bool:
    help_text = subprocess.run(
        [awa_cli(), "storage", "enter-mixed-transition", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "--quiesced" in help_text


QUIESCED_FLIP = ("storage", "enter-mixed-transition", "--quiesced")


def run_awa(pg: EmbeddedPostgres, dbname: str, *args: str) -> str:
    """Run the real Awa CLI against *dbname* and return its stdout.

    awa-cli 0.6.6 has no ``enter-mixed-transition --quiesced``: its gate always wants a live
    queue-storage target runtime. There the flip runs with one registered for the command and
    marked gone after it (as :class:`racing.RealTransitions` does), so the phase reached is the
    same on every release.
    """
    if args == QUIESCED_FLIP and not _has_quiesced_flag():
        engine = sa.create_engine(pg.database_url(dbname), poolclass=sa.NullPool)
        runtime = RealTransitions(engine)
        runtime._runtime(live=True)
        try:
            return _run_awa(pg, dbname, *args[:-1])
        finally:
            runtime._runtime(live=False)
    return _run_awa(pg, dbname, *args)


def _run_awa(pg: EmbeddedPostgres, dbname: str, *args: str) -> str:
    env = {**os.environ, "DATABASE_URL": pg.database_url(dbname, "postgres")}
    env.setdefault("RUST_LOG", "warn")
    # The bound only stops a hang: `awa migrate` takes seconds on a quiet machine, and CI runs its
    # jobs and their xdist workers side by side on 2 cores, where 120 s is within reach.
    proc = subprocess.run(
        [awa_cli(), *args], env=env, capture_output=True, text=True, check=False, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"awa {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


@pytest.fixture(scope="session")
def fixture_template(awa_databases: Databases) -> str:
    """The kit's template: the Alembic-built v040 fixture, queue storage in awa and awa_qs."""
    return awa_databases.template


@pytest.fixture(scope="session")
def real_template(pg: EmbeddedPostgres) -> Iterator[str]:
    """Template database built by the published awa CLI 0.6.9, plus the awa_qs substrate."""
    name = "awa_real_tmpl"
    janitor = _janitor(pg, name, as_template=True)
    janitor.init()
    run_awa(pg, name, "migrate")
    run_awa(pg, name, "storage", "prepare-queue-storage-schema", "--schema", "awa_qs")
    yield name
    janitor.drop()


@contextmanager
def cloned(pg: EmbeddedPostgres, databases: Databases, source: str) -> Iterator[str]:
    """The URL of a new database copied from *source*, dropped on leaving.

    The source must have no open connections (a template has none between tests). The kit's
    pooled maintenance connection makes and drops them: a connection per database would cost
    a backend and a password exchange each, some 2,800 times in a CI run. A set-up wider than
    a test uses this; a test, :func:`clone_database`.
    """
    name = databases.create(source)
    try:
        yield database_url(pg, name)
    finally:
        databases.drop(name)


@pytest.fixture
def clone_database(
    pg: EmbeddedPostgres, awa_databases: Databases
) -> Iterator[Callable[[str], str]]:
    """Factory: ``clone(source_dbname) -> url`` of a new database copied from the source,
    dropped after the test (:func:`cloned`)."""
    with ExitStack() as stack:
        yield lambda source: stack.enter_context(cloned(pg, awa_databases, source))


def _engine(url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url, pool_size=10, max_overflow=10)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def db_url(clone_database: Callable[[str], str], fixture_template: str) -> str:
    """A fresh clone of the fixture database for this test alone."""
    return clone_database(fixture_template)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    yield from _engine(db_url)


@pytest.fixture
async def async_engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(db_url, pool_size=10, max_overflow=10)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def real_db_url(clone_database: Callable[[str], str], real_template: str) -> str:
    """A fresh clone of the awa-CLI-built database for this test alone."""
    return clone_database(real_template)


@pytest.fixture
def real_engine(real_db_url: str) -> Iterator[sa.Engine]:
    yield from _engine(real_db_url)


class Cluster:
    """A database plus the way to move it between storage phases.

    ``kind == "fixture"`` writes the phase rows directly (``awa_sa_schema.set_phase``);
    ``kind == "real"`` drives the published ``awa storage`` commands against a database built
    by ``awa migrate``, so every scenario test can run on both.
    """

    def __init__(self, kind: str, pg: EmbeddedPostgres, url: str, engine: sa.Engine) -> None:
        self.kind = kind
        self.pg = pg
        self.url = url
        self.engine = engine
        self.dbname = sa.make_url(url).database or ""

    def set_phase(self, phase: str, schema: str) -> None:
        """Move from a fresh canonical cluster to *phase*, routing to *schema* once flipped."""
        if phase not in PHASES:
            raise ValueError(phase)
        if self.kind == "fixture":
            with self.engine.begin() as conn:
                awa_sa_schema.set_phase(conn, phase, schema)
            return
        if phase == "canonical":
            return
        details = f'{{"schema": "{schema}"}}'
        self.awa("storage", "prepare", "--engine", "queue_storage", "--details", details)
        if phase in ("mixed_transition", "active", "aborted"):
            self.awa(*QUIESCED_FLIP)
        if phase == "active":
            self.awa("storage", "finalize")
        if phase == "aborted":
            self.awa("storage", "abort")

    def awa(self, *args: str) -> str:
        return run_awa(self.pg, self.dbname, *args)


@pytest.fixture(params=["canonical", "active"])
def real_plane(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
    real_template: str,
) -> Iterator[Cluster]:
    """An ``awa migrate`` database on each plane: canonical, and queue storage active."""
    url = clone_database(real_template)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        found = Cluster("real", pg, url, engine)
        found.set_phase(request.param, "awa_qs")
        yield found
    finally:
        engine.dispose()


@pytest.fixture(params=["real"])
def cluster(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
) -> Iterator[Cluster]:
    """Each scenario on an ``awa migrate`` database, its phases moved by ``awa storage``.

    Until 2026-12-06 each ran on the Alembic fixture too. That run proved nothing more about
    awa-sa: what a statement reaches is the real catalog on the fixture
    (test_catalog_parity.py: relations, triggers, the routing functions byte for byte), and
    its phase rows are what ``awa storage`` writes (test_testing_helpers.py); the rest was the
    harness's emulation of the phase functions, which test_faults.py runs on its own. It cost
    some 45 CPU-s of a main run and more in every real-cluster job. Where a test needs the
    fixture itself (the kit's template), it builds a ``Cluster("fixture", ...)``.
    """
    template = request.getfixturevalue(f"{request.param}_template")
    url = clone_database(template)
    for engine in _engine(url):
        yield Cluster(request.param, pg, url, engine)
