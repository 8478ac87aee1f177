"""Which async drivers a test of this environment can run on."""

from __future__ import annotations

from importlib.util import find_spec

from awa_sa.core.drivers import ASYNC_DRIVERS


def installed_async_drivers() -> list[str]:
    """The async drivers awa-sa supports that are installed here, psycopg 3 first.

    psycopg 3 comes with awa-sa; asyncpg with ``awa-sa[asyncpg]``. Both need greenlet, which
    the ``testing`` extra brings. A project that runs on asyncpg in production can run every
    async test on each driver with ``@pytest.fixture(params=installed_async_drivers())`` as its
    own ``awa_async_driver``.
    """
    return [driver for driver in ASYNC_DRIVERS if find_spec(driver) is not None]
