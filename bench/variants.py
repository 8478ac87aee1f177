"""Every way the bench reschedules one canonical attempt, grouped by driver.

Per driver: the raw floors (:mod:`bench.floor`: BEGIN/lock/move/COMMIT; its lock and move
inside an open transaction; the one statement alone in autocommit), each sent by hand on the
driver connection of the forms it is compared with, checked out and returned outside the
clock; the one statement with the pool's checkout and checkin inside the clock, the least the
Engine form keeps: "pool floor"; async drivers also with the statement sent on the driver's own
connection between the pool's checkout and checkin: "pool floor, native"); SQLAlchemy's
minimal path, ``exec_driver_sql`` of the one statement's text with its rows read, through an
``Engine`` (or ``AsyncEngine``) made with ``isolation_level="AUTOCOMMIT"`` and through a held
``Connection``; and awa-sa in the same two forms. The SQLAlchemy rows show how much of the gap
between awa-sa and the one-statement floor is SQLAlchemy's own, and the awa-sa rows what is
left ours. Every row reaches one of two backends, the pool's free connection or the held one,
but SQLAlchemy's Engine row, whose AUTOCOMMIT engine has a pool of its own.

The Connection forms are timed as a caller composes them: inside a transaction it has begun and
already used (``before``, untimed), committed after (``after``, untimed), against the lock and
move sent by hand on the same held connection, inside a transaction opened by the same steps
("in-transaction floor").

A form awa-sa cannot run on a driver yet is left out and said so (``skipped``), so the bench
still runs while a driver is being brought up.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from awa_sa import asyncio as awa_async
from awa_sa import reschedule_canonical_attempt
from awa_sa.core.compiled import Compiled
from awa_sa.core.errors import AwaSAError
from awa_sa.core.internals import run_in_greenlet
from bench import floor
from bench.floor import Borrowed, Close, Op, Raw, Step, blocking
from bench.workload import KIND, Jobs, canonical_texts, move_values, one_statement_text


@dataclass(frozen=True, slots=True)
class Driver:
    name: str  # the group and the floor's label
    url_driver: str  # postgresql+<url_driver>://
    is_async: bool
    raw: Callable[[tuple[Compiled, Compiled], Compiled], Raw]  # its floors


DRIVERS = (
    Driver("psycopg", "psycopg", False, floor.psycopg_raw),
    Driver("psycopg async", "psycopg", True, floor.psycopg_async_raw),
    Driver("psycopg2", "psycopg2", False, floor.dbapi_raw),
    Driver("pg8000", "pg8000", False, floor.dbapi_raw),
    Driver("asyncpg", "asyncpg", True, floor.asyncpg_raw),
)


@dataclass(frozen=True, slots=True)
class Variant:
    group: str  # the driver; its floor is the variant named "<group> floor"
    form: str  # "floor", "SQLAlchemy Engine", "awa-sa AsyncConnection", ...
    op: Op
    before: Step | None = None  # untimed, before each call: the caller's open transaction
    after: Step | None = None  # untimed, after each call: its commit

    @property
    def name(self) -> str:
        return f"{self.group} {self.form}"


@dataclass
class Variants:
    """The variants on one server address, and how to release everything they hold."""

    items: list[Variant] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    closers: list[Close] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def build(
    host: str,
    port: int,
    dbname: str,
    loop: asyncio.AbstractEventLoop,
    jobs: Jobs,
    *,
    drivers: Collection[str] | None = None,
) -> Variants:
    """All variants against ``host:port/dbname``, of *drivers* (by name; None: all); *jobs*
    supplies the probe of each awa-sa form."""
    out = Variants()
    password = sa.make_url(jobs.url).password  # the throwaway server's, same behind the proxy
    for driver in DRIVERS:
        if drivers is not None and driver.name not in drivers:
            continue
        if importlib.util.find_spec(driver.url_driver) is None:
            out.skipped[driver.name] = f"{driver.url_driver} is not installed"
            continue
        url = f"postgresql+{driver.url_driver}://postgres:{password}@{host}:{port}/{dbname}"
        if driver.is_async:
            _async_driver(out, driver, url, loop=loop, jobs=jobs)
        else:
            _sync_driver(out, driver, url, jobs)
    return out


def _sync_driver(out: Variants, driver: Driver, url: str, jobs: Jobs) -> None:
    engine = sa.create_engine(url, pool_size=2)
    autocommit = sa.create_engine(url, pool_size=2, isolation_level="AUTOCOMMIT")
    one = one_statement_text(engine.dialect)
    held = engine.connect()
    out.closers += [engine.dispose, autocommit.dispose, held.close]

    def begin() -> None:
        held.begin()
        held.exec_driver_sql("SELECT 1").all()

    def sa_engine(job_id: int, lease: int) -> Any:
        with autocommit.connect() as conn:
            return conn.exec_driver_sql(one.sql, one.params(move_values(job_id, lease))).all()

    def sa_connection(job_id: int, lease: int) -> Any:
        return held.exec_driver_sql(one.sql, one.params(move_values(job_id, lease))).all()

    def awa_engine(job_id: int, lease: int) -> Any:
        return reschedule_canonical_attempt(engine, job_id, lease, KIND)

    def awa_connection(job_id: int, lease: int) -> Any:
        return reschedule_canonical_attempt(held, job_id, lease, KIND)

    g = driver.name
    raw = driver.raw(canonical_texts(engine.dialect), one)
    out.items += [
        *_floors(
            g,
            raw,
            engine=engine,
            in_pool=floor.directly,
            held=_driver_of(held),
            begin=begin,
            commit=held.commit,
        ),
        Variant(g, "pool floor", floor.pool_floor(engine, one)),
        Variant(g, "SQLAlchemy Engine", sa_engine),
        Variant(g, "SQLAlchemy Connection", sa_connection, begin, held.commit),
    ]
    _awa(out, Variant(g, "awa-sa Engine", awa_engine), jobs)
    _awa(out, Variant(g, "awa-sa Connection", awa_connection, begin, held.commit), jobs)


def _floors(
    group: str,
    raw: Raw,
    *,
    engine: sa.Engine,
    in_pool: Callable[[Callable[[], Any]], Any],
    held: Callable[[], Any],
    begin: Step,
    commit: Step,
) -> list[Variant]:
    """*raw*'s three floors, each on the server connection of the forms it is compared with:
    a connection of *engine*'s pool (the Engine forms'), and *held*'s driver connection inside
    the transaction the Connection forms run in (*begin*, *commit*: the same untimed steps)."""
    pooled, alone = Borrowed(engine, in_pool), Borrowed(engine, in_pool, raw.autocommit)

    def four(job_id: int, lease: int) -> Any:
        return raw.four(pooled.conn, job_id, lease)

    def inside(job_id: int, lease: int) -> Any:
        return raw.lock_and_move(held(), job_id, lease)

    def one(job_id: int, lease: int) -> Any:
        return raw.one(alone.conn, job_id, lease)

    return [
        Variant(group, "floor", four, pooled.before, pooled.after),
        Variant(group, "in-transaction floor", inside, begin, commit),
        Variant(group, "one-statement floor", one, alone.before, alone.after),
    ]


def _async_driver(
    out: Variants,
    driver: Driver,
    url: str,
    *,
    loop: asyncio.AbstractEventLoop,
    jobs: Jobs,
) -> None:
    engine = create_async_engine(url, pool_size=2)
    autocommit = create_async_engine(url, pool_size=2, isolation_level="AUTOCOMMIT")
    one = one_statement_text(engine.dialect)
    held: AsyncConnection = loop.run_until_complete(engine.connect())
    out.closers += [
        lambda: loop.run_until_complete(engine.dispose()),
        lambda: loop.run_until_complete(autocommit.dispose()),
        lambda: loop.run_until_complete(held.close()),
    ]

    async def begin_async() -> None:
        await held.begin()
        (await held.exec_driver_sql("SELECT 1")).all()

    begin, commit = blocking(loop, begin_async), blocking(loop, held.commit)

    async def sa_engine(job_id: int, lease: int) -> Any:
        async with autocommit.connect() as conn:
            params = one.params(move_values(job_id, lease))
            return (await conn.exec_driver_sql(one.sql, params)).all()

    async def sa_connection(job_id: int, lease: int) -> Any:
        params = one.params(move_values(job_id, lease))
        return (await held.exec_driver_sql(one.sql, params)).all()

    pooled = floor.pool_floor(engine.sync_engine, one)

    async def pool(job_id: int, lease: int) -> Any:
        return await run_in_greenlet(pooled, job_id, lease)  # as the AsyncEngine form runs

    async def awa_engine(job_id: int, lease: int) -> Any:
        return await awa_async.reschedule_canonical_attempt(engine, job_id, lease, KIND)

    async def awa_connection(job_id: int, lease: int) -> Any:
        return await awa_async.reschedule_canonical_attempt(held, job_id, lease, KIND)

    g = driver.name
    raw = driver.raw(canonical_texts(engine.dialect), one).on(loop)
    out.items += [
        *_floors(
            g,
            raw,
            engine=engine.sync_engine,
            in_pool=blocking(loop, run_in_greenlet),
            held=_driver_of(held),
            begin=begin,
            commit=commit,
        ),
        Variant(g, "pool floor", blocking(loop, pool)),
        Variant(
            g,
            "pool floor, native",
            blocking(loop, floor.native_pool_floor(engine.sync_engine, one)),
        ),
        Variant(g, "SQLAlchemy AsyncEngine", blocking(loop, sa_engine)),
        Variant(g, "SQLAlchemy AsyncConnection", blocking(loop, sa_connection), begin, commit),
    ]
    _awa(out, Variant(g, "awa-sa AsyncEngine", blocking(loop, awa_engine)), jobs)
    connection = Variant(g, "awa-sa AsyncConnection", blocking(loop, awa_connection), begin, commit)
    _awa(out, connection, jobs)


def _driver_of(held: sa.Connection | AsyncConnection) -> Callable[[], Any]:
    """*held*'s driver connection, read when called (the connection it holds may change)."""
    if isinstance(held, AsyncConnection):
        return lambda: held.sync_connection.connection.driver_connection  # type: ignore[union-attr]
    return lambda: held.connection.driver_connection


def _awa(out: Variants, variant: Variant, jobs: Jobs) -> None:
    """Keep *variant* if one call on a live attempt works on its driver; else say why not."""
    try:
        if variant.before:
            variant.before()
        try:
            variant.op(*jobs.take(1)[0])
        finally:
            if variant.after:
                variant.after()
    except AwaSAError as exc:
        out.skipped[variant.name] = str(exc).splitlines()[0][:120]
        return
    out.items.append(variant)
