"""The floors: the canonical reschedule done by hand on each raw driver, two ways.

The two-statement floor: BEGIN, the lock, the routing move, COMMIT -- four round trips, the
canonical path before the one statement, in the text awa-sa sends for those statements on that
driver (:mod:`awa_sa.compiled`); inside a transaction the caller has open, its lock and move
alone (two round trips) are the floor of the Connection forms. The one-statement floor: the one
statement (``statements.move_if_canonical``) alone in autocommit, one round trip. All are
prepared where the driver prepares (psycopg 3 explicitly, asyncpg always; psycopg2 binds on the
client, pg8000 prepares and drops each statement). What is left between the one-statement floor
and awa-sa on the same driver is SQLAlchemy and awa-sa, nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import psycopg
from sqlalchemy.engine import Engine, make_url

from awa_sa.compiled import Compiled
from awa_sa.internals import run_in_greenlet
from bench.workload import move_values

Op = Callable[[int, int], Any]
Step = Callable[[], Any]
Close = Callable[[], None]
_P = ParamSpec("_P")
_R = TypeVar("_R")


def blocking(loop: asyncio.AbstractEventLoop, fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, _R]:
    """*fn*, called and run to its end on *loop*: an op or a step the interleaving can call."""

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return loop.run_until_complete(fn(*args, **kwargs))

    return run


def _nothing() -> None:
    """BEGIN where the driver sends it itself, before the transaction's first statement."""


@dataclass(frozen=True, slots=True)
class Floor:
    """A driver's two-statement floor, in the parts a caller's transaction has.

    Whole (:meth:`op`) it is BEGIN, the lock, the routing move, COMMIT: four round trips. Inside a
    transaction the caller has opened and already used (``begin`` then ``work``, untimed), the
    lock and the move alone are the floor of the Connection forms.
    """

    begin: Step
    work: Step  # a statement of the caller's: the transaction is open on the server
    lock_and_move: Op
    commit: Step
    close: Close

    def op(self, job_id: int, lease: int) -> Any:
        self.begin()
        out = self.lock_and_move(job_id, lease)
        self.commit()
        return out


def psycopg_floor(dsn: str, texts: tuple[Compiled, Compiled]) -> Floor:
    lock, move = texts
    conn = psycopg.connect(dsn)

    def lock_and_move(job_id: int, lease: int) -> Any:
        conn.execute(lock.sql, prepare=True).fetchall()
        rows = conn.execute(move.sql, move.params(move_values(job_id, lease)), prepare=True)
        return rows.fetchall()

    def work() -> None:
        conn.execute("SELECT 1", prepare=True).fetchall()

    return Floor(_nothing, work, lock_and_move, conn.commit, conn.close)


def psycopg_async_floor(
    dsn: str, texts: tuple[Compiled, Compiled], loop: asyncio.AbstractEventLoop
) -> Floor:
    lock, move = texts
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(dsn))

    async def lock_and_move(job_id: int, lease: int) -> Any:
        await (await conn.execute(lock.sql, prepare=True)).fetchall()
        cur = await conn.execute(move.sql, move.params(move_values(job_id, lease)), prepare=True)
        return await cur.fetchall()

    async def work() -> None:
        await (await conn.execute("SELECT 1", prepare=True)).fetchall()

    return Floor(
        _nothing,
        blocking(loop, work),
        blocking(loop, lock_and_move),
        blocking(loop, conn.commit),
        lambda: loop.run_until_complete(conn.close()),
    )


def psycopg2_floor(dsn: str, texts: tuple[Compiled, Compiled]) -> Floor:
    import psycopg2  # noqa: PLC0415 -- an optional driver; its group is skipped without it

    lock, move = texts
    conn = psycopg2.connect(dsn)

    def lock_and_move(job_id: int, lease: int) -> Any:
        with conn.cursor() as cur:
            cur.execute(lock.sql)
            cur.fetchall()
            cur.execute(move.sql, move.params(move_values(job_id, lease)))
            return cur.fetchall()

    def work() -> None:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            cur.fetchall()

    return Floor(_nothing, work, lock_and_move, conn.commit, conn.close)


def _pg8000_connect(dsn: str) -> Any:
    import pg8000.dbapi  # noqa: PLC0415 -- an optional driver; its group is skipped without it

    url = make_url(dsn)
    return pg8000.dbapi.connect(
        user=url.username,
        password=url.password,
        host=url.host,
        port=url.port,
        database=url.database,
    )


def pg8000_floor(dsn: str, texts: tuple[Compiled, Compiled]) -> Floor:
    lock, move = texts
    conn = _pg8000_connect(dsn)

    def lock_and_move(job_id: int, lease: int) -> Any:
        cur = conn.cursor()
        cur.execute(lock.sql)
        cur.fetchall()
        cur.execute(move.sql, move.params(move_values(job_id, lease)))
        return cur.fetchall()

    def work() -> None:
        cur = conn.cursor()
        cur.execute("SELECT 1")
        cur.fetchall()

    return Floor(_nothing, work, lock_and_move, conn.commit, conn.close)


def asyncpg_floor(
    dsn: str, texts: tuple[Compiled, Compiled], loop: asyncio.AbstractEventLoop
) -> Floor:
    import asyncpg  # noqa: PLC0415 -- an optional driver; its group is skipped without it

    lock, move = texts
    conn = loop.run_until_complete(asyncpg.connect(dsn))
    transaction: list[Any] = []

    async def begin() -> None:
        transaction[:] = [conn.transaction()]
        await transaction[0].start()

    async def lock_and_move(job_id: int, lease: int) -> Any:
        await conn.fetch(lock.sql)
        return await conn.fetch(move.sql, *move.params(move_values(job_id, lease)))

    async def work() -> None:
        await conn.fetch("SELECT 1")

    async def commit() -> None:
        await transaction.pop().commit()

    return Floor(
        blocking(loop, begin),
        blocking(loop, work),
        blocking(loop, lock_and_move),
        blocking(loop, commit),
        lambda: loop.run_until_complete(conn.close()),
    )


# -- the one statement, alone in autocommit: one round trip, prepared where the driver prepares


def psycopg_one_floor(dsn: str, one: Compiled) -> tuple[Op, Close]:
    conn = psycopg.connect(dsn, autocommit=True)

    def op(job_id: int, lease: int) -> Any:
        rows = conn.execute(one.sql, one.params(move_values(job_id, lease)), prepare=True)
        return rows.fetchall()

    return op, conn.close


def psycopg_async_one_floor(
    dsn: str, one: Compiled, loop: asyncio.AbstractEventLoop
) -> tuple[Op, Close]:
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(dsn, autocommit=True))

    async def op(job_id: int, lease: int) -> Any:
        cur = await conn.execute(one.sql, one.params(move_values(job_id, lease)), prepare=True)
        return await cur.fetchall()

    return blocking(loop, op), lambda: loop.run_until_complete(conn.close())


def psycopg2_one_floor(dsn: str, one: Compiled) -> tuple[Op, Close]:
    import psycopg2  # noqa: PLC0415 -- an optional driver; its group is skipped without it

    conn = psycopg2.connect(dsn)
    conn.autocommit = True

    def op(job_id: int, lease: int) -> Any:
        with conn.cursor() as cur:
            cur.execute(one.sql, one.params(move_values(job_id, lease)))
            return cur.fetchall()

    return op, conn.close


def pg8000_one_floor(dsn: str, one: Compiled) -> tuple[Op, Close]:
    conn = _pg8000_connect(dsn)
    conn.autocommit = True

    def op(job_id: int, lease: int) -> Any:
        cur = conn.cursor()
        cur.execute(one.sql, one.params(move_values(job_id, lease)))
        return cur.fetchall()

    return op, conn.close


def asyncpg_one_floor(dsn: str, one: Compiled, loop: asyncio.AbstractEventLoop) -> tuple[Op, Close]:
    import asyncpg  # noqa: PLC0415 -- an optional driver; its group is skipped without it

    conn = loop.run_until_complete(asyncpg.connect(dsn))

    async def op(job_id: int, lease: int) -> Any:
        return await conn.fetch(one.sql, *one.params(move_values(job_id, lease)))

    return blocking(loop, op), lambda: loop.run_until_complete(conn.close())


# -- the one statement on a pooled connection: what the Engine form keeps, and nothing else


def pool_floor(engine: Engine, one: Compiled) -> Op:
    """The one statement on a connection of *engine*'s pool, with no Connection and nothing of
    awa-sa around it: the checkout and checkin (events, reset), the autocommit switch (pg8000:
    the driver's BEGIN and COMMIT sent as a query, as the Engine form sends them), the
    statement and its rows. The Engine form can be no cheaper than this."""
    alone = engine.dialect.driver != "pg8000"

    def op(job_id: int, lease: int) -> Any:
        fairy = engine.raw_connection()
        try:
            dbapi = fairy.dbapi_connection
            assert dbapi is not None
            cursor = fairy.cursor()
            if alone:
                dbapi.autocommit = True
            cursor.execute(one.sql, one.params(move_values(job_id, lease)))
            rows = cursor.fetchall()
            if alone:
                dbapi.autocommit = False
            else:
                cursor.execute("COMMIT", ())
            cursor.close()
            return rows
        finally:
            fairy.close()

    return op


def native_pool_floor(engine: Engine, one: Compiled) -> Callable[[int, int], Awaitable[Any]]:
    """The async pool floor with the statement sent on the driver's own connection, not
    through SQLAlchemy's adapter of it: the checkout and the checkin each in a greenlet (the
    pool is sync code, and may await: a new connection, pre-ping, the reset), the statement
    awaited natively between them. What an AsyncEngine form would cost that kept the pool and
    went around everything else SQLAlchemy has (docs/performance.md)."""
    asyncpg = engine.dialect.driver == "asyncpg"

    async def op(job_id: int, lease: int) -> Any:
        fairy = await run_in_greenlet(engine.raw_connection)
        try:
            conn: Any = fairy.driver_connection
            values = one.params(move_values(job_id, lease))
            if asyncpg:  # outside a transaction, asyncpg's statement commits by itself
                return await conn.fetch(one.sql, *values)
            await conn.set_autocommit(True)
            cursor = conn.cursor()
            await cursor.execute(one.sql, values)
            rows = await cursor.fetchall()
            await conn.set_autocommit(False)
            await cursor.close()
            return rows
        finally:
            await run_in_greenlet(fairy.close)

    return op
