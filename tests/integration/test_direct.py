"""The Engine form's direct path (awa_sa.core.internals.Direct): what the Connection did, kept.

Where an engine has no listener, echo or execution options, the Engine form's autocommit try
runs on a pooled connection without a ``Connection`` around it. These tests hold it to what a
user of the engine still relies on: the pool's events and pre-ping, a dead connection
invalidated with the pool's older ones, errors as awa-sa's, and the Connection back as soon
as anyone would see it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from calling import SNOOZE, driver_url
from jobs import insert_job
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import PoolResetState

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa.core.errors import CONNECTION_LOST
from awa_sa.core.internals import (
    Direct,
    autocommit_off,
    autocommit_on,
    checkout,
    direct_allowed,
    driver_isolation_level,
    lookup,
    run_in_greenlet,
)

taken = pytest.mark.skipif(
    not lookup.PATHS.direct, reason="the direct path is off (AWA_SA_PUBLIC_ONLY=1)"
)
"""For a test of the direct path being taken; the others hold of the Connection too."""


@pytest.fixture
def plain(db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url, pool_size=2)
    yield engine
    engine.dispose()


@taken
def test_an_engine_that_no_one_watches_takes_it(plain: sa.Engine, db_url: str) -> None:
    assert direct_allowed(plain)
    for driver in ("psycopg2", "pg8000"):
        other = sa.create_engine(driver_url(db_url, driver))
        assert direct_allowed(other)
        other.dispose()


@taken
@pytest.mark.skipif(not lookup.PATHS.asyncpg_context, reason="asyncpg keeps the Connection")
async def test_asyncpg_takes_it_with_its_contexts_steps(db_url: str) -> None:
    """asyncpg's execution context stamps each cursor with the time the dialect last saw the
    schema change, and moves that time on after a statement fails for a changed schema, so
    that every connection prepares afresh. The direct path does both in the driver's own
    transaction: a statement whose prepared plan a schema change broke fails once, and runs
    again on the same connection. In autocommit it fetches natively, and asyncpg re-prepares
    the statement by itself: it does not fail."""
    engine = create_async_engine(driver_url(db_url, "asyncpg"), pool_size=1)
    try:
        assert direct_allowed(engine.sync_engine)
        async with engine.begin() as conn:
            await conn.exec_driver_sql("CREATE TABLE direct_schema (x int)")
            await conn.exec_driver_sql("INSERT INTO direct_schema VALUES (1)")
        select = "SELECT * FROM direct_schema"
        for autocommit in (True, False):
            assert await run_in_greenlet(_direct_send, engine.sync_engine, select, autocommit) == [
                (1,)
            ]
        async with engine.begin() as conn:  # the pool's one connection: it sees no error
            await conn.exec_driver_sql("ALTER TABLE direct_schema ALTER x TYPE bigint")
        before = engine.dialect._invalidate_schema_cache_asof  # type: ignore[attr-defined]
        assert await run_in_greenlet(_direct_send, engine.sync_engine, select) == [(1,)]
        assert engine.dialect._invalidate_schema_cache_asof == before  # type: ignore[attr-defined]
        with pytest.raises(sa.exc.DBAPIError, match="InvalidCachedStatement"):
            await run_in_greenlet(_direct_send, engine.sync_engine, select, False)
        assert engine.dialect._invalidate_schema_cache_asof > before  # type: ignore[attr-defined]
        assert await run_in_greenlet(_direct_send, engine.sync_engine, select, False) == [(1,)]
        async with engine.begin() as conn:
            job = await conn.run_sync(insert_job)
        outcome = await awa_async.reschedule_canonical_attempt(engine, job, 1, SNOOZE)
        assert isinstance(outcome, awa_sa.Rescheduled)
    finally:
        async with engine.begin() as conn:
            await conn.exec_driver_sql("DROP TABLE IF EXISTS direct_schema")
        await engine.dispose()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_async_drivers_natively_answer_and_fail_as_their_adapters(
    db_url: str, driver: str
) -> None:
    """In autocommit the direct path sends by the async driver's own API, not through
    SQLAlchemy's adapter: the same rows, the same translated error, the connection out of
    autocommit after, and a dead connection invalidated as the adapter's would be
    (awa_sa.core.internals.Direct)."""
    engine = create_async_engine(driver_url(db_url, driver), pool_size=1)
    sync = engine.sync_engine
    answer = "SELECT 1 AS one, 'two' AS two"
    if driver == "asyncpg" and not lookup.PATHS.asyncpg_native:
        pytest.skip("asyncpg's lone statement goes through its adapter")
    try:
        assert await run_in_greenlet(_direct_send, sync, answer) == [(1, "two")]
        adapted = await run_in_greenlet(lambda: checkout(sync))
        assert not adapted.dbapi_connection.autocommit  # type: ignore[union-attr]
        if driver == "asyncpg":
            cache = adapted.dbapi_connection._prepared_statement_cache  # type: ignore[union-attr]
            assert answer not in cache  # asyncpg's statement cache had it, not the adapter's
        await run_in_greenlet(adapted.close)
        assert await run_in_greenlet(_direct_send, sync, answer, False) == [(1, "two")]
        failures = []
        for autocommit in (True, False):
            with pytest.raises(sa.exc.DBAPIError) as raised:
                await run_in_greenlet(_direct_send, sync, "SELECT 1 / 0", autocommit)
            failures.append((type(raised.value), type(raised.value.orig)))
            assert raised.value.orig.sqlstate == "22012"  # type: ignore[union-attr]
            adapted = await run_in_greenlet(lambda: checkout(sync))
            assert not adapted.dbapi_connection.autocommit  # type: ignore[union-attr]
            await run_in_greenlet(adapted.close)
        assert failures[0] == failures[1]
        ((pid,),) = await run_in_greenlet(_direct_send, sync, "SELECT pg_backend_pid()")
        killer = sa.create_engine(db_url, poolclass=sa.NullPool)
        with killer.connect() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(%(pid)s)", {"pid": pid})
        killer.dispose()
        with pytest.raises(sa.exc.DBAPIError) as lost:
            await run_in_greenlet(_direct_send, sync, answer)
        assert lost.value.connection_invalidated
        assert await run_in_greenlet(_direct_send, sync, answer) == [(1, "two")]
    finally:
        await engine.dispose()


def _direct_send(
    engine: sa.Engine, statement: str, autocommit: bool = True
) -> list[tuple[object, ...]]:
    """*statement* sent as the Engine form's direct path sends its own (alone in autocommit,
    or in the driver's own transaction, rolled back at checkin), its rows as tuples."""
    fairy = checkout(engine)
    direct = Direct(engine, fairy)
    switched = autocommit_on(direct) if autocommit else None
    try:
        return [tuple(row) for row in direct.send(statement, ())]
    finally:
        if switched is not None:
            autocommit_off(direct, switched)
        fairy.close()


@pytest.mark.parametrize(
    "watched",
    ["before_cursor_execute", "engine_connect", "begin", "handle_error", "options", "echo"],
)
def test_an_engine_someone_watches_keeps_its_connection(db_url: str, watched: str) -> None:
    engine = sa.create_engine(db_url, echo=watched == "echo")
    seen: list[str] = []
    if watched == "options":
        engine = engine.execution_options(logging_token="awa")
    elif watched != "echo":
        event.listen(engine, watched, lambda *args, **kw: seen.append(watched))
    try:
        assert not direct_allowed(engine)
        with engine.begin() as conn:
            job = insert_job(conn)
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE), awa_sa.Rescheduled
        )
        if watched in ("before_cursor_execute", "engine_connect", "begin"):
            assert seen
    finally:
        engine.dispose()


def test_on_the_public_paths_the_engine_form_keeps_its_connection(
    plain: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a private name moved (here: all of them, as AWA_SA_PUBLIC_ONLY=1 has it), the
    Engine form runs in a Connection, its statement by ``exec_driver_sql``, and settles the
    same: the one statement alone in autocommit, the connection back out of autocommit."""
    monkeypatch.setattr(lookup, "PATHS", lookup.look_up(public_only=True))
    assert not direct_allowed(plain)
    with plain.begin() as conn:
        job = insert_job(conn)
    outcome = awa_sa.reschedule_canonical_attempt(plain, job, 1, SNOOZE)
    assert isinstance(outcome, awa_sa.Rescheduled)
    with plain.connect() as conn:
        assert conn.connection.dbapi_connection.autocommit is False  # type: ignore[union-attr]
        moved = "SELECT count(*) FROM awa.scheduled_jobs WHERE id = %(id)s"
        assert conn.exec_driver_sql(moved, {"id": job}).scalar() == 1


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2", "psycopg async", "asyncpg"])
async def test_a_connections_driver_tells_the_engines_isolation_level(
    db_url: str, driver: str
) -> None:
    """What the Engine form reads where the dialect's private level is not read: each driver
    connection's own, as ``create_engine(isolation_level=...)`` set it, without a round trip."""
    levels: dict[str | None, str | None] = {}
    for asked in (None, "SERIALIZABLE", "REPEATABLE READ", "AUTOCOMMIT"):
        if driver in ("psycopg async", "asyncpg"):
            url = driver_url(db_url, driver.split(maxsplit=1)[0])
            engine = create_async_engine(url, isolation_level=asked).sync_engine
            fairy = await run_in_greenlet(lambda engine=engine: checkout(engine))
            levels[asked] = driver_isolation_level(fairy)
            await run_in_greenlet(fairy.close)
            await run_in_greenlet(engine.dispose)
        else:
            engine = sa.create_engine(driver_url(db_url, driver), isolation_level=asked)
            fairy = checkout(engine)
            levels[asked] = driver_isolation_level(fairy)
            fairy.close()
            engine.dispose()
    normal = {k: v if v is None else v.upper().replace("_", " ") for k, v in levels.items()}
    assert normal == {
        None: None,
        "SERIALIZABLE": "SERIALIZABLE",
        "REPEATABLE READ": "REPEATABLE READ",
        "AUTOCOMMIT": "AUTOCOMMIT",
    }


def test_info_logging_of_sqlalchemy_keeps_the_connection(
    plain: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"):
        assert not direct_allowed(plain)
        awa_sa.reschedule_canonical_attempt(plain, 10**9, 1, SNOOZE)
    assert any("awa.jobs_hot" in record.getMessage() for record in caplog.records)
    assert direct_allowed(plain) == lookup.PATHS.direct


@taken
def test_the_pools_events_fire_once_a_call(plain: sa.Engine) -> None:
    """Checkout, reset and checkin, as for a Connection that ended its transaction: the reset
    is told so, and the connection goes back with no transaction open, no ROLLBACK sent."""
    fired: list[str] = []
    for name in ("checkout", "checkin"):
        event.listen(plain.pool, name, lambda *args, name=name: fired.append(name))

    def reset(dbapi: object, record: object, state: PoolResetState) -> None:
        fired.append(f"reset, transaction was reset: {state.transaction_was_reset}")
        status = dbapi.info.transaction_status  # type: ignore[attr-defined]
        assert status == psycopg.pq.TransactionStatus.IDLE

    event.listen(plain.pool, "reset", reset)
    assert direct_allowed(plain)  # pool events are the pool's: the path stays direct
    with plain.begin() as conn:
        job = insert_job(conn)
    fired.clear()
    assert isinstance(
        awa_sa.reschedule_canonical_attempt(plain, job, 1, SNOOZE), awa_sa.Rescheduled
    )
    assert fired == ["checkout", "reset, transaction was reset: True", "checkin"]


def _kill_all(engine: sa.Engine, db_url: str) -> None:
    """Terminate every backend of *engine*'s pool, from a connection of another engine."""
    admin = sa.create_engine(db_url, poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
    finally:
        admin.dispose()


def _warm(engine: sa.Engine, n: int) -> None:
    """*n* connections in the pool, each checked in."""
    held = [engine.connect() for _ in range(n)]
    for conn in held:
        conn.exec_driver_sql("SELECT 1")
        conn.close()


def test_pre_ping_replaces_a_dead_connection_before_the_call(db_url: str) -> None:
    engine = sa.create_engine(db_url, pool_size=1, pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            job = insert_job(conn)
        _warm(engine, 1)
        _kill_all(engine, db_url)
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE), awa_sa.Rescheduled
        )
    finally:
        engine.dispose()


def test_a_dead_connection_is_invalidated_with_the_pools_older_ones(db_url: str) -> None:
    """As the Connection does: the call that finds its connection dead fails as lost, and the
    pool's other connections, as old, are replaced at their next checkout rather than failing
    the next call too."""
    engine = sa.create_engine(db_url, pool_size=2)
    try:
        with engine.begin() as conn:
            job = insert_job(conn)
        _warm(engine, 2)
        _kill_all(engine, db_url)
        with pytest.raises(awa_sa.DatabaseError) as lost:
            awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE)
        assert lost.value.sqlstate == CONNECTION_LOST
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE), awa_sa.Rescheduled
        )
    finally:
        engine.dispose()


@pytest.mark.parametrize("level", ["pg8000", "SERIALIZABLE"])
def test_a_call_that_may_not_run_alone_runs_in_the_drivers_transaction(
    db_url: str, level: str
) -> None:
    """pg8000 (several exchanges per statement) and an engine at another isolation level keep
    BEGIN: the direct path runs the try in the driver's own transaction, commits what it
    settled and puts the connection back idle; a try that must go on rolls back and goes on
    in a transaction of its own (here a shared key, one attempt at a time)."""
    if level == "pg8000":
        engine = sa.create_engine(driver_url(db_url, "pg8000"), pool_size=1)
    else:
        engine = sa.create_engine(db_url, pool_size=1, isolation_level=level)
    try:
        assert direct_allowed(engine) == lookup.PATHS.direct
        with engine.begin() as conn:
            job, other = insert_job(conn), insert_job(conn)
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE), awa_sa.Rescheduled
        )
        batch = [awa_sa.Attempt(other, 1, SNOOZE), awa_sa.Attempt(other, 1, SNOOZE)]
        outcomes = awa_sa.reschedule_canonical_attempts(engine, batch)
        assert [type(o) for o in outcomes] == [awa_sa.Rescheduled, awa_sa.Stale]
        with engine.connect() as conn:  # the pool's one connection, back out of its transaction
            moved = sa.text("SELECT count(*) FROM awa.scheduled_jobs WHERE id IN (:a, :b)")
            assert conn.execute(moved, {"a": job, "b": other}).scalar() == 2
        observer = sa.create_engine(db_url, poolclass=sa.NullPool)
        with observer.connect() as conn:
            states = (
                conn.exec_driver_sql(
                    "SELECT state FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                )
                .scalars()
                .all()
            )
        observer.dispose()
        assert states == ["idle"]
    finally:
        engine.dispose()


@taken
def test_pg8000_commits_in_one_exchange(db_url: str) -> None:
    """Its own commit() is three exchanges (an unnamed prepared COMMIT); the direct path's is
    a simple query: BEGIN, the statement's three, COMMIT."""
    engine = sa.create_engine(driver_url(db_url, "pg8000"), pool_size=1)
    try:
        with engine.begin() as conn:
            job = insert_job(conn)
        _warm(engine, 1)
        with engine.connect() as conn:
            pg8000 = conn.connection.dbapi_connection
        sent: list[str] = []
        sock = pg8000._sock  # type: ignore[union-attr]
        flush = sock.flush

        def counted() -> None:
            sent.append("flush")  # each exchange ends with a flush, then waits for the answer
            flush()

        sock.flush = counted
        try:
            outcome = awa_sa.reschedule_canonical_attempt(engine, job, 1, SNOOZE)
        finally:
            sock.flush = flush
        assert isinstance(outcome, awa_sa.Rescheduled)
        assert len(sent) == 5
        assert not pg8000._in_transaction  # type: ignore[union-attr]
    finally:
        engine.dispose()
