"""The floors: the canonical reschedule done by hand on each raw driver, three ways.

The two-statement floor: BEGIN, the lock, the routing move, COMMIT -- four round trips, the
canonical path before the one statement, in the text awa-sa sends for those statements on that
driver (:mod:`awa_sa.core.compiled`); inside a transaction the caller has open, its lock and move
alone (two round trips) are the floor of the Connection forms. The one-statement floor: the one
statement (``statements.move_if_canonical``) alone in autocommit, one round trip. All are
prepared where the driver prepares (psycopg 3 explicitly, asyncpg always; psycopg2 binds on the
client, pg8000 prepares and drops each statement).

Each floor is sent on the server connection of the forms it is compared with, not on one of its
own (:class:`Borrowed`): on this 2-vCPU machine what a round trip costs depends on the backend
that answers it, and that changed from run to run (docs/performance.md#same-backend). What is
left between a floor and awa-sa on the same driver is then SQLAlchemy and awa-sa, nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.pool import PoolProxiedConnection

from awa_sa.core.compiled import Compiled
from awa_sa.core.internals import run_in_greenlet
from bench.workload import move_values

Op = Callable[[int, int], Any]
Step = Callable[[], Any]
Close = Callable[[], None]
Send = Callable[[Any, int, int], Any]
"""Statements sent by hand on a driver connection, for one attempt ``(id, run_lease)``."""
_P = ParamSpec("_P")
_R = TypeVar("_R")


def blocking(loop: asyncio.AbstractEventLoop, fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, _R]:
    """*fn*, called and run to its end on *loop*: an op or a step the interleaving can call."""

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return loop.run_until_complete(fn(*args, **kwargs))

    return run


@dataclass(frozen=True, slots=True)
class Raw:
    """One driver's floors, sent by hand on whatever driver connection they are handed.

    An async driver's are coroutine functions until :meth:`on` makes them blocking calls.
    """

    lock_and_move: Send
    one: Send  # on a connection in autocommit
    commit: Callable[[Any], Any]
    autocommit: Callable[[Any, bool], Any] | None  # None: a statement alone commits by itself
    begin: Callable[[Any], Any] | None = None  # None: the driver sends BEGIN itself

    def four(self, conn: Any, job_id: int, lease: int) -> Any:
        """BEGIN, the lock, the move, COMMIT: the two-statement floor."""
        if self.begin is not None:
            self.begin(conn)
        rows = self.lock_and_move(conn, job_id, lease)
        self.commit(conn)
        return rows

    def on(self, loop: asyncio.AbstractEventLoop) -> Raw:
        """The coroutine functions of an async driver's floors, each run to its end on *loop*."""

        def run(fn: Any) -> Any:
            return None if fn is None else blocking(loop, fn)

        return Raw(
            run(self.lock_and_move),
            run(self.one),
            run(self.commit),
            autocommit=run(self.autocommit),
            begin=run(self.begin),
        )


class Borrowed:
    """A connection of the forms' own pool, checked out before each call of a floor and
    returned after it, both outside the clock, in autocommit meanwhile if *switch* is given.

    What a loopback round trip costs here depends on the backend that answers it (where the
    scheduler keeps it), and a floor on a connection of its own drew its own backend: the
    ratio of a form to it moved with that draw, from run to run
    (docs/performance.md#same-backend). Borrowed, the floor's statements reach the backend the
    forms' statements reach.
    """

    __slots__ = ("conn", "engine", "fairy", "in_pool", "switch")

    def __init__(
        self,
        engine: Engine,
        in_pool: Callable[[Callable[[], Any]], Any],
        switch: Callable[[Any, bool], Any] | None = None,
    ) -> None:
        self.engine = engine
        self.in_pool = in_pool  # runs a call of the pool's (an async engine's in a greenlet)
        self.switch = switch
        self.fairy: PoolProxiedConnection | None = None
        self.conn: Any = None  # the driver connection, while borrowed

    def before(self) -> None:
        self.fairy = self.in_pool(self.engine.raw_connection)
        self.conn = self.fairy.driver_connection
        if self.switch is not None:
            self.switch(self.conn, True)

    def after(self) -> None:
        if self.switch is not None:
            self.switch(self.conn, False)
        assert self.fairy is not None
        self.in_pool(self.fairy.close)
        self.fairy = self.conn = None


def directly(fn: Callable[[], _R]) -> _R:
    """A sync engine's pool, called as it is (an async engine's: ``blocking(loop,
    run_in_greenlet)``, where it may await a new connection or pre-ping)."""
    return fn()


def set_autocommit(conn: Any, on: bool) -> None:
    """A sync driver connection (psycopg 3, psycopg2, pg8000) switched to autocommit or back."""
    conn.autocommit = on


def _commit(conn: Any) -> Any:
    return conn.commit()


def psycopg_raw(texts: tuple[Compiled, Compiled], one: Compiled) -> Raw:
    lock, move = texts

    def lock_and_move(conn: Any, job_id: int, lease: int) -> Any:
        conn.execute(lock.sql, prepare=True).fetchall()
        rows = conn.execute(move.sql, move.params(move_values(job_id, lease)), prepare=True)
        return rows.fetchall()

    def alone(conn: Any, job_id: int, lease: int) -> Any:
        rows = conn.execute(one.sql, one.params(move_values(job_id, lease)), prepare=True)
        return rows.fetchall()

    return Raw(lock_and_move, alone, _commit, set_autocommit)


def psycopg_async_raw(texts: tuple[Compiled, Compiled], one: Compiled) -> Raw:
    lock, move = texts

    async def lock_and_move(conn: Any, job_id: int, lease: int) -> Any:
        await (await conn.execute(lock.sql, prepare=True)).fetchall()
        cur = await conn.execute(move.sql, move.params(move_values(job_id, lease)), prepare=True)
        return await cur.fetchall()

    async def alone(conn: Any, job_id: int, lease: int) -> Any:
        cur = await conn.execute(one.sql, one.params(move_values(job_id, lease)), prepare=True)
        return await cur.fetchall()

    async def autocommit(conn: Any, on: bool) -> None:
        await conn.set_autocommit(on)

    return Raw(lock_and_move, alone, _commit, autocommit)


def dbapi_raw(texts: tuple[Compiled, Compiled], one: Compiled) -> Raw:
    """psycopg2's and pg8000's: plain DBAPI cursors, closed after each use as SQLAlchemy closes
    its own (pg8000's cursor is no context manager)."""
    lock, move = texts

    def lock_and_move(conn: Any, job_id: int, lease: int) -> Any:
        with closing(conn.cursor()) as cur:
            cur.execute(lock.sql)
            cur.fetchall()
            cur.execute(move.sql, move.params(move_values(job_id, lease)))
            return cur.fetchall()

    def alone(conn: Any, job_id: int, lease: int) -> Any:
        with closing(conn.cursor()) as cur:
            cur.execute(one.sql, one.params(move_values(job_id, lease)))
            return cur.fetchall()

    return Raw(lock_and_move, alone, _commit, set_autocommit)


def asyncpg_raw(texts: tuple[Compiled, Compiled], one: Compiled) -> Raw:
    lock, move = texts

    async def lock_and_move(conn: Any, job_id: int, lease: int) -> Any:
        await conn.fetch(lock.sql)
        return await conn.fetch(move.sql, *move.params(move_values(job_id, lease)))

    async def alone(conn: Any, job_id: int, lease: int) -> Any:
        return await conn.fetch(one.sql, *one.params(move_values(job_id, lease)))

    async def begin(conn: Any) -> None:
        await conn.execute("BEGIN")  # what asyncpg's Transaction.start() sends

    async def commit(conn: Any) -> None:
        await conn.execute("COMMIT")

    # outside a transaction, asyncpg's statement commits by itself
    return Raw(lock_and_move, alone, commit, None, begin)


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
