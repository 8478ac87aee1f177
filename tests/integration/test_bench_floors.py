"""Each of the bench's floors reaches the server backend of the forms it is compared with.

What a loopback round trip costs on a 2-vCPU machine depends on the backend that answers it, so
a floor on a connection of its own would be a different measurement from its form's
(docs/performance.md#same-backend). Which backend served a call is read from
``pg_stat_activity`` (the client backend whose last statement began last), between the call
and the untimed step after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from bench import endings, variants
from bench.workload import Jobs

LAST_SERVED = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    " ORDER BY query_start DESC LIMIT 1"
)
"""Client backends only: an autovacuum worker of the database shows a later ``query_start``."""


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _served(built: variants.Variants, db_url: str, jobs: Jobs) -> dict[str, int]:
    """Per variant name, the pid of the backend that answered its call."""
    served: dict[str, int] = {}
    # autocommit: pg_stat_activity is read once per transaction
    admin = sa.create_engine(db_url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for variant in built.items:
                if variant.before:
                    variant.before()
                variant.op(*jobs.take(1)[0])
                served[variant.name] = conn.exec_driver_sql(LAST_SERVED).scalar_one()
                if variant.after:
                    variant.after()
    finally:
        admin.dispose()
        built.close()
    return served


@pytest.mark.parametrize("driver", variants.DRIVERS, ids=lambda driver: driver.name)
def test_the_floors_reach_their_forms_backends(
    driver: variants.Driver, db_url: str, loop: asyncio.AbstractEventLoop
) -> None:
    url = sa.make_url(db_url)
    assert url.host is not None
    assert url.port is not None
    assert url.database is not None
    jobs = Jobs(db_url)
    jobs.seed(40)
    built = variants.build(url.host, url.port, url.database, loop, jobs, drivers={driver.name})
    assert built.skipped == {}
    served = _served(built, db_url, jobs)
    engine, connection = (
        ("AsyncEngine", "AsyncConnection") if driver.is_async else ("Engine", "Connection")
    )
    g = driver.name
    pooled = {served[f"{g} {form}"] for form in ("floor", "one-statement floor", "pool floor")}
    assert pooled == {served[f"{g} awa-sa {engine}"]}
    assert served[f"{g} in-transaction floor"] == served[f"{g} awa-sa {connection}"]
    assert served[f"{g} in-transaction floor"] not in pooled


def test_the_endings_floors_reach_their_forms_backends(db_url: str) -> None:
    jobs = Jobs(db_url)
    jobs.seed(40)
    served = _served(endings.build(db_url), db_url, jobs)
    for ending in endings.ENDINGS:
        g = f"psycopg {ending.name}"
        assert served[f"{g} floor"] == served[f"{g} awa-sa Engine"]
        assert served[f"{g} in-transaction floor"] == served[f"{g} awa-sa Connection"]
        assert served[f"{g} floor"] != served[f"{g} awa-sa Connection"]
