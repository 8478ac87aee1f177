"""Where SQLAlchemy's share of a call goes, each step timed alone in client CPU.

Client CPU (this thread's), not wall time: the server does the same work whichever side sends
a statement, so a difference in client CPU is exactly the layer's own cost. Each step is timed
on its own, interleaved round by round:

* the pool: ``Engine.connect()`` and ``close()`` (checkout, the ``Connection``, checkin);
* each statement: ``exec_driver_sql`` and reading its result, against the same text on the
  same connection through the raw driver, in the same transaction (the move names no job, so it
  moves nothing and can repeat);
* async only: one greenlet round (``greenlet_spawn`` of a no-op, a new greenlet, and
  ``awa_sa.core.internals.run_in_greenlet`` of one, a kept greenlet, against awaiting a no-op), and
  each statement through SQLAlchemy's async adaptation inside one greenlet against the same
  statement awaited on the raw async driver.

Each step runs many times in a row here, so its code stays in the CPU's caches; in a real call
(part 1) it runs once among everything else, and costs more. The steps say which part of
SQLAlchemy the time goes to; part 1 says how much there is.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.util import greenlet_spawn

from awa_sa.core.internals import run_in_greenlet
from bench.workload import canonical_texts, move_values

Step = Callable[[], object]
NOTHING = move_values(-1, 1)  # no such job: the move runs in full and moves nothing


def _time(steps: dict[str, Step], rounds: int, per_round: int) -> dict[str, float]:
    """Median client CPU per run of each step, in µs."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            start = time.thread_time_ns()
            for _ in range(per_round):
                step()
            if round_:
                samples[name].append((time.thread_time_ns() - start) / per_round / 1000)
    return {name: statistics.median(v) for name, v in samples.items()}


def sync(url: str, rounds: int, per_round: int) -> dict[str, float]:
    engine = sa.create_engine(url, pool_size=2)  # one held, one for the pool steps
    lock, move = canonical_texts(engine.dialect)
    held = engine.connect()
    raw: Any = held.connection.dbapi_connection
    outer = held.begin()

    def pool() -> None:
        with engine.connect():
            pass

    steps: dict[str, Step] = {
        "pool": pool,
        "lock": lambda: held.exec_driver_sql(lock.sql).first(),
        "lock raw": lambda: raw.execute(lock.sql, prepare=True).fetchall(),
        "move": lambda: held.exec_driver_sql(move.sql, move.params(NOTHING)).all(),
        "move raw": lambda: raw.execute(move.sql, move.params(NOTHING), prepare=True).fetchall(),
    }
    try:
        t = _time(steps, rounds, per_round)
    finally:
        outer.rollback()
        held.close()
        engine.dispose()
    return {
        "pool: checkout, Connection, checkin": t["pool"],
        "lock statement over the raw driver": t["lock"] - t["lock raw"],
        "move statement over the raw driver": t["move"] - t["move raw"],
    }


def asynchronous(url: str, rounds: int, per_round: int) -> dict[str, float]:
    """The same for an async driver, plus the greenlet round; statements inside one greenlet."""
    loop = asyncio.new_event_loop()
    engine = create_async_engine(url, pool_size=2)  # one held, one for the pool steps
    lock, move = canonical_texts(engine.dialect)
    held = loop.run_until_complete(engine.connect())
    loop.run_until_complete(held.begin())
    raw: Any = loop.run_until_complete(held.get_raw_connection()).driver_connection
    sync_conn = held.sync_connection
    assert sync_conn is not None
    asyncpg = engine.dialect.driver == "asyncpg"

    async def nothing() -> None:
        return None

    async def awaits() -> None:
        for _ in range(per_round):
            await nothing()

    async def greenlets() -> None:
        for _ in range(per_round):
            await greenlet_spawn(lambda: None)

    async def kept() -> None:
        for _ in range(per_round):
            await run_in_greenlet(lambda: None)

    async def raw_lock() -> Any:
        if asyncpg:
            return await raw.fetch(lock.sql)
        return await (await raw.execute(lock.sql, prepare=True)).fetchall()

    async def raw_move() -> Any:
        if asyncpg:
            return await raw.fetch(move.sql, *move.params(NOTHING))
        cur = await raw.execute(move.sql, move.params(NOTHING), prepare=True)
        return await cur.fetchall()

    def run(make: Callable[[], Awaitable[Any]]) -> Step:
        async def many() -> None:
            for _ in range(per_round):
                await make()

        return lambda: loop.run_until_complete(many())

    def in_greenlet(fn: Callable[[], Any]) -> Step:
        def many() -> None:
            for _ in range(per_round):
                fn()

        return lambda: loop.run_until_complete(greenlet_spawn(many))

    def pool() -> None:
        engine.sync_engine.connect().close()

    steps: dict[str, Step] = {
        "await": lambda: loop.run_until_complete(awaits()),
        "greenlet": lambda: loop.run_until_complete(greenlets()),
        "kept greenlet": lambda: loop.run_until_complete(kept()),
        "pool": in_greenlet(pool),
        "lock": in_greenlet(lambda: sync_conn.exec_driver_sql(lock.sql).first()),
        "lock raw": run(raw_lock),
        "move": in_greenlet(
            lambda: sync_conn.exec_driver_sql(move.sql, move.params(NOTHING)).all()
        ),
        "move raw": run(raw_move),
    }
    try:
        t = _time(steps, rounds, 1)
    finally:
        loop.run_until_complete(held.rollback())
        loop.run_until_complete(held.close())
        loop.run_until_complete(engine.dispose())
        loop.close()
    n = per_round
    return {
        "one new greenlet (greenlet_spawn, as run_sync)": (t["greenlet"] - t["await"]) / n,
        "one kept greenlet (a whole awa-sa async call)": (t["kept greenlet"] - t["await"]) / n,
        "pool: checkout, Connection, checkin": t["pool"] / n,
        "lock statement over the raw driver": (t["lock"] - t["lock raw"]) / n,
        "move statement over the raw driver": (t["move"] - t["move raw"]) / n,
    }


def run(urls: dict[str, str], rounds: int = 7, per_round: int = 100) -> dict[str, Any]:
    """Per driver group (``psycopg``, ``psycopg async``, ``asyncpg``): the steps, in µs."""
    out: dict[str, Any] = {}
    for group, url in urls.items():
        is_async = group != "psycopg"
        out[group] = (asynchronous if is_async else sync)(url, rounds, per_round)
    return out
