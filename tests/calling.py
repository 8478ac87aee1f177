"""One Engine-form call on any supported driver, for tests that vary the server, not the call.

Each call makes its own engine and disposes of it, so a test can point every driver at a
database that refuses connections, a standby, or a pooler, and compare what comes back.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import Attempt, AwaSAError, Outcome, Snooze

DRIVERS = ("psycopg", "psycopg-async", "psycopg2", "pg8000", "asyncpg")
"""Every supported driver; ``psycopg-async`` is psycopg 3 behind an AsyncEngine."""
SNOOZE = Snooze(30)


def driver_url(url: str | sa.URL, driver: str) -> sa.URL:
    name = "psycopg" if driver == "psycopg-async" else driver
    return sa.make_url(url).set(drivername=f"postgresql+{name}")


def is_async(driver: str) -> bool:
    return driver in ("psycopg-async", "asyncpg")


def reschedule(
    driver: str, url: str | sa.URL, attempts: list[Attempt], **engine_options: Any
) -> list[Outcome]:
    """``reschedule_canonical_attempts`` with a fresh engine of *driver* on *url*."""
    (result,) = _on_one_engine(driver, url, attempts, 1, engine_options)
    if isinstance(result, AwaSAError):
        raise result
    return result


def refusal(
    driver: str, url: str | sa.URL, attempt: Attempt, times: int = 1, **engine_options: Any
) -> AwaSAError:
    """The awa-sa error a call raises; with *times*, that many calls on the same engine (the
    pool's connection reused) must each fail, and the last error is returned."""
    results = _on_one_engine(driver, url, [attempt], times, engine_options)
    if not all(isinstance(r, AwaSAError) for r in results):
        raise AssertionError(f"{driver}: not an awa-sa error every time: {results}")
    last = results[-1]
    assert isinstance(last, AwaSAError)
    return last


def _on_one_engine(
    driver: str,
    url: str | sa.URL,
    attempts: list[Attempt],
    times: int,
    engine_options: dict[str, Any],
) -> list[list[Outcome] | AwaSAError]:
    """*times* calls in turn on one fresh engine; each call's outcomes or awa-sa error."""
    target = driver_url(url, driver)
    results: list[list[Outcome] | AwaSAError] = []
    if is_async(driver):

        async def go() -> None:
            engine = create_async_engine(target, **engine_options)
            try:
                for _ in range(times):
                    try:
                        results.append(
                            await awa_async.reschedule_canonical_attempts(engine, attempts)
                        )
                    except AwaSAError as exc:
                        results.append(exc)
            finally:
                await engine.dispose()

        asyncio.run(go())
        return results
    engine = sa.create_engine(target, **engine_options)
    try:
        for _ in range(times):
            try:
                results.append(awa_sa.reschedule_canonical_attempts(engine, attempts))
            except AwaSAError as exc:
                results.append(exc)
    finally:
        engine.dispose()
    return results


def callers(
    driver: str,
    url: str,
    job_ids: list[int],
    callers: int,
    engine_options: dict[str, Any],
    *,
    ready: Any = None,
) -> list[str]:
    """*callers* concurrent callers on one engine reschedule *job_ids* (lease 1) one by one;
    the failures, as text (an empty list when every call was ``Rescheduled``). Any exception
    counts: a misconfigured driver can fail inside itself, not only with an awa-sa error.

    Module-level and picklable, so a test can run it in another process. *ready*, a barrier
    shared with the other processes, holds the first call until every process is ready: a
    process that starts late would otherwise find the other one finished.
    """
    target = driver_url(url, driver)
    errors: list[str] = []

    def check(outcome: Outcome | Exception) -> None:
        if not isinstance(outcome, awa_sa.Rescheduled):
            errors.append(repr(outcome))

    if is_async(driver):

        async def go() -> None:
            engine = create_async_engine(target, pool_size=callers, **engine_options)
            if ready is not None:
                ready.wait()

            async def one(job_id: int) -> None:
                try:
                    check(await awa_async.reschedule_canonical_attempt(engine, job_id, 1, SNOOZE))
                except Exception as exc:
                    check(exc)

            for start in range(0, len(job_ids), callers):
                await asyncio.gather(*(one(j) for j in job_ids[start : start + callers]))
            await engine.dispose()

        asyncio.run(go())
        return errors
    engine = sa.create_engine(target, pool_size=callers, **engine_options)
    if ready is not None:
        ready.wait()

    def one(job_id: int) -> None:
        try:
            check(awa_sa.reschedule_canonical_attempt(engine, job_id, 1, SNOOZE))
        except Exception as exc:
            check(exc)

    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(one, job_ids))
    engine.dispose()
    return errors
