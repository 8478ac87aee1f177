"""``python -m bench``: awa-sa's per-call cost over the raw-psycopg floor, and batch throughput.

Everything runs in one process against one throwaway PostgreSQL (``awa_sa.embedded``) holding
the Alembic fixture. Variants are interleaved round by round, so drift on a busy machine (other
processes, autovacuum, a warming cache) lands on every variant alike; medians resist outliers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa_schema
from awa_sa import RetryAfter, reschedule_canonical_attempt, statements
from awa_sa import asyncio as awa_async
from awa_sa.embedded import embedded_postgres
from bench.floor import RawStatement, run_async, run_sync

Op = Callable[[int, int], Any]


def seed(engine: sa.Engine, count: int) -> Iterator[tuple[int, int]]:
    """*count* running canonical attempts, as a worker's claim leaves them."""
    with engine.begin() as conn:
        rows = conn.execute(
            sa.text(
                "INSERT INTO awa.jobs_hot (kind, queue, state, attempt, run_lease, attempted_at,"
                " heartbeat_at) SELECT 'bench', 'bench', 'running', 1, 1, now(), now()"
                " FROM generate_series(1, :n) RETURNING id, run_lease"
            ),
            {"n": count},
        ).all()
    return iter([(r.id, r.run_lease) for r in rows])


def floor_ops(dsn: str) -> tuple[Op, Callable[[], None]]:
    lock = RawStatement.of(statements.routing_lock())
    move = RawStatement.of(statements.canonical_move("retry_after", True))
    conn = psycopg.connect(dsn)

    def op(job_id: int, lease: int) -> Any:
        run_sync(conn, lock, {})
        row = run_sync(conn, move, {"guard_id": job_id, "guard_lease": lease, "b_delay": 60.0})
        conn.commit()
        return row

    return op, conn.close


def async_floor_ops(dsn: str, loop: asyncio.AbstractEventLoop) -> tuple[Op, Callable[[], None]]:
    lock = RawStatement.of(statements.routing_lock())
    move = RawStatement.of(statements.canonical_move("retry_after", True))
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(dsn))

    async def one(job_id: int, lease: int) -> Any:
        await run_async(conn, lock, {})
        params = {"guard_id": job_id, "guard_lease": lease, "b_delay": 60.0}
        row = await run_async(conn, move, params)
        await conn.commit()
        return row

    return _blocking(loop, one), lambda: loop.run_until_complete(conn.close())


def _blocking(loop: asyncio.AbstractEventLoop, fn: Callable[[int, int], Awaitable[Any]]) -> Op:
    return lambda job_id, lease: loop.run_until_complete(fn(job_id, lease))


def measure(
    variants: dict[str, Op], jobs: Iterator[tuple[int, int]], rounds: int, per_round: int
) -> dict[str, list[float]]:
    """Per-op latencies in microseconds, variants interleaved round by round."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, op in variants.items():
            for _ in range(per_round):
                job_id, lease = next(jobs)
                start = time.perf_counter_ns()
                op(job_id, lease)
                samples[name].append((time.perf_counter_ns() - start) / 1000)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args()

    with embedded_postgres() as server:
        admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE bench"))
        admin.dispose()
        url = server.url.rsplit("/", 1)[0] + "/bench"
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        engine = sa.create_engine(url, pool_size=4)
        with engine.begin() as conn:
            awa_sa_schema.build(conn, ("awa", "awa_qs"))
        loop = asyncio.new_event_loop()
        aengine = create_async_engine(url, pool_size=4)
        results = run_single(engine, aengine, dsn, loop, args)
        loop.run_until_complete(aengine.dispose())
        engine.dispose()
    report(results, args.json)


def run_single(
    engine: sa.Engine,
    aengine: Any,
    dsn: str,
    loop: asyncio.AbstractEventLoop,
    args: argparse.Namespace,
) -> dict[str, Any]:
    floor, close_floor = floor_ops(dsn)
    afloor, close_afloor = async_floor_ops(dsn, loop)
    held = engine.connect()
    aheld = loop.run_until_complete(aengine.connect())

    def on_connection(job_id: int, lease: int) -> Any:
        with held.begin():
            return reschedule_canonical_attempt(held, job_id, lease, RetryAfter(60.0))

    async def on_async_connection(job_id: int, lease: int) -> Any:
        async with aheld.begin():
            return await awa_async.reschedule_canonical_attempt(
                aheld, job_id, lease, RetryAfter(60.0)
            )

    variants: dict[str, Op] = {
        "floor (psycopg)": floor,
        "awa-sa Engine": lambda j, r: reschedule_canonical_attempt(engine, j, r, RetryAfter(60.0)),
        "awa-sa Connection": on_connection,
        "floor (psycopg async)": afloor,
        "awa-sa AsyncEngine": _blocking(
            loop,
            lambda j, r: awa_async.reschedule_canonical_attempt(aengine, j, r, RetryAfter(60.0)),
        ),
        "awa-sa AsyncConnection": _blocking(loop, on_async_connection),
    }
    total = len(variants) * (args.rounds * args.per_round + args.warmup)
    jobs = seed(engine, total)
    measure(variants, jobs, 1, args.warmup)
    samples = measure(variants, jobs, args.rounds, args.per_round)
    held.close()
    loop.run_until_complete(aheld.close())
    close_floor()
    close_afloor()
    return {"single_us": samples}


def report(results: dict[str, Any], path: Path) -> None:
    medians = {name: statistics.median(v) for name, v in results["single_us"].items()}
    floors = {False: medians["floor (psycopg)"], True: medians["floor (psycopg async)"]}
    print(f"{'single reschedule (canonical)':32} {'median µs':>10} {'vs floor':>9}")
    for name, median in medians.items():
        floor = floors["Async" in name or "async" in name]
        print(f"{name:32} {median:10.1f} {median / floor:8.2f}x")
    summary = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "single_median_us": medians,
        "single_ratio_to_floor": {
            n: m / floors["Async" in n or "async" in n] for n, m in medians.items()
        },
    }
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
