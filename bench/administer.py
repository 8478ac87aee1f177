"""Part ``administer`` (issue 37): the bulk verbs on *size* failed jobs against awa-pg's own.

Two databases of their own, one canonical and one with queue storage active (``awa migrate``,
then flipped by the awa CLI, as :mod:`bench.enqueue` builds them). In each, *size* jobs of one
kind (and two of another, below), enqueued by awa-pg 0.6.9's ``insert_many_copy`` with
``max_attempts=1`` before one real awa-pg worker starts (a runtime that starts on an empty
canonical database finalizes it to queue storage), then run once by it, its handler raising:
failed jobs as the runtime leaves them, then ``ANALYZE``, as a live database's autovacuum
would have. That database is a template only: every timed call gets a fresh copy of it
(``CREATE DATABASE ... TEMPLATE``, outside the clock), so each verb starts from the same
failed jobs, row for row, and a retry or a discard leaves nothing behind for the next call.

On its copy each call is first made on the two failed jobs of the other kind (the client's
connection opened, its backend's caches warmed on the same statements; outside the clock and
the count), then timed on the *size* others: awa-sa's ``retry_failed(engine, kind=...)`` and
``discard_failed(engine, kind)`` (Engine form: a transaction of its own, as awa-pg's), against
awa-pg's ``Client.retry_failed`` and ``Client.discard_failed``. The statements each sent are
those the server ran on the copy during the call (``pg_stat_statements``, top level, BEGIN and
COMMIT included, the harness's own left out). Every round makes each call once, awa-sa first
in even rounds and awa-pg first in odd ones; the median of the rounds is kept.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import awa
import sqlalchemy as sa

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres
from bench.enqueue import databases
from bench.workload import fresh_copy, server_statements

PLANES = {"canonical": "administer", "queue storage": "administer_qs"}
"""Each plane's template database, with the failed jobs."""
KIND = "bench_failed"
QUEUE = "bench_admin"
WARM_KIND = "bench_warm"
WARM = 2
"""Failed jobs of WARM_KIND, the untimed first call's: the same statements, on fewer jobs."""
VERBS = ("retry_failed", "discard_failed")
SIDES = ("awa-sa", "awa-pg")
WORKERS = 32
"""The worker's handlers at once: the failing is not measured, only waited for."""

Call = Callable[[str], int]
"""A verb on one side for a kind: how many jobs it retried or discarded."""


def run(server: EmbeddedPostgres, cluster: str, size: int, rounds: int) -> dict[str, Any]:
    """The part: the templates made, then every round; per plane, verb and side, the median
    seconds, the statements and the jobs the call reported."""
    if cluster != "awa":
        raise SystemExit(
            "part administer needs the awa CLI (awa migrate): a real awa-pg worker makes the"
            " failed jobs, and the fixture schema cannot take a queue-storage retry"
        )
    urls = databases(server, cluster, PLANES)
    for plane, url in urls.items():
        asyncio.run(_fail(url, size, plane))
        _template(url)
    seen: dict[str, dict[str, dict[str, list[tuple[float, int, int]]]]] = {
        plane: {verb: {side: [] for side in SIDES} for verb in VERBS} for plane in PLANES
    }
    for round_ in range(rounds):
        sides = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for plane, source in PLANES.items():
            for verb in VERBS:
                for side in sides:
                    seen[plane][verb][side].append(_timed(server, source, verb, side))
    return {
        "size": size,
        "rounds": rounds,
        "planes": {
            plane: {
                verb: {side: _median(samples) for side, samples in sides_seen.items()}
                for verb, sides_seen in verbs.items()
            }
            for plane, verbs in seen.items()
        },
    }


def _median(samples: list[tuple[float, int, int]]) -> dict[str, float]:
    return {
        "seconds": statistics.median(s for s, _, _ in samples),
        "statements": statistics.median(n for _, n, _ in samples),
        "jobs": statistics.median(j for _, _, j in samples),
    }


async def _fail(url: str, size: int, plane: str) -> None:
    """*size* jobs of KIND, failed by one real awa-pg worker (max_attempts 1, a handler that
    raises); back once every one is failed, on the plane its database was built for."""
    client = awa.AsyncClient(sa.make_url(url).set(drivername="postgresql").render_as_string(False))

    async def fails(job: Any) -> Any:
        raise RuntimeError("failed for the bench")

    # The jobs before the worker: a runtime that starts on an empty canonical database
    # finalizes it to queue storage on its own.
    for kind, count in ((WARM_KIND, WARM), (KIND, size)):
        client.task(dict, kind=kind, queue=QUEUE)(fails)
        jobs = [{"n": n} for n in range(count)]
        await client.insert_many_copy(jobs, kind=kind, queue=QUEUE, max_attempts=1)
    schema = None if plane == "canonical" else "awa_qs"  # the flip's schema
    await client.start([(QUEUE, WORKERS)], queue_storage_schema=schema)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    # The compatibility view lists the routing plane's jobs, on either plane.
    failed = sa.text("SELECT count(*) FROM awa.jobs WHERE state = 'failed'")
    routing = sa.text("SELECT awa.active_queue_storage_schema()")
    try:
        deadline = time.monotonic() + 60 + size / 50
        while True:
            with engine.connect() as conn:
                if conn.execute(failed).scalar_one() == size + WARM:
                    assert conn.execute(routing).scalar_one() == schema, plane
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not fail {size} jobs ({plane})")
            await asyncio.sleep(0.1)  # the worker's own pace
    finally:
        engine.dispose()
        await client.shutdown()
        await client.close()


def _template(url: str) -> None:
    """Statistics as a live database has them, for every copy."""
    engine = sa.create_engine(url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()


def _timed(server: EmbeddedPostgres, source: str, verb: str, side: str) -> tuple[float, int, int]:
    """One call of *verb* by *side* on a fresh copy of *source*: seconds, statements, jobs."""
    with fresh_copy(server, source) as url:
        counter = sa.create_engine(url, pool_size=1, isolation_level="AUTOCOMMIT")
        call, close = _side(verb, side, url)
        try:
            assert call(WARM_KIND) == WARM
            server_statements(counter, reset=True)
            start = time.perf_counter()
            jobs = call(KIND)
            took = time.perf_counter() - start
            return took, server_statements(counter), jobs
        finally:
            close()
            counter.dispose()


def _side(verb: str, side: str, url: str) -> tuple[Call, Callable[[], None]]:
    """*side*'s *verb* on the database at *url*, and what closes its connections."""
    if side == "awa-sa":
        engine = sa.create_engine(url, pool_size=1)
        if verb == "retry_failed":
            return lambda kind: len(awa_sa.retry_failed(engine, kind=kind).jobs), engine.dispose
        return lambda kind: awa_sa.discard_failed(engine, kind), engine.dispose
    client = awa.Client(sa.make_url(url).set(drivername="postgresql").render_as_string(False))
    if verb == "retry_failed":
        return lambda kind: len(client.retry_failed(kind=kind).jobs), client.close
    return lambda kind: int(client.discard_failed(kind)), client.close


def summary(result: dict[str, Any]) -> str:
    """The part's report: per plane and verb, each side's time and statements, and the ratio."""
    lines = [
        f"administer: {result['size']} failed jobs of one kind, awa-sa (Engine form) against"
        f" awa-pg's Client, a fresh copy each call (median of {result['rounds']} rounds)"
    ]
    for plane, verbs in result["planes"].items():
        for verb, sides in verbs.items():
            for side, row in sides.items():
                lines.append(
                    f"  {plane:13} {verb:14} {side:6} {row['seconds'] * 1000:10.1f} ms"
                    f" {row['statements']:8.0f} statements {row['jobs']:7.0f} jobs"
                )
            ratio = sides["awa-sa"]["seconds"] / sides["awa-pg"]["seconds"]
            lines.append(f"  {plane:13} {verb:14} awa-sa / awa-pg {ratio:6.2f}x")
    return "\n".join(lines)
