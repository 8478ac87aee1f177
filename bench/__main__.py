"""``python -m bench``: awa-sa's per-call cost over the raw-psycopg floor, and batch throughput.

Everything runs in one process against one throwaway PostgreSQL (``awa_sa.tools.server``) holding
the Alembic fixture twice: database ``canon`` keeps canonical routing, ``qs`` is flipped into
``mixed_transition`` towards ``awa_qs``. Variants are interleaved round by round, so drift on a
busy machine (other processes, autovacuum, a warming cache) lands on every variant alike, and
medians resist outliers. Run it as ``.venv/bin/python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa_schema
from awa_sa import (
    Attempt,
    RetryAfter,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
    statements,
)
from awa_sa import asyncio as awa_async
from awa_sa.compiled import Compiled, compile_statement
from awa_sa.tools.listing import DIALECT
from awa_sa.tools.server import EmbeddedPostgres, embedded_postgres
from bench.floor import run_async, run_sync

Op = Callable[[int, int], Any]
KIND = RetryAfter(60.0)
BATCH_SIZES = (1, 10, 100, 1000)


class Jobs:
    """A supply of running canonical attempts, seeded in bulk as a worker's claims leave them."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._ids: Iterator[tuple[int, int]] = iter(())

    def seed(self, count: int) -> None:
        with self.engine.begin() as conn:
            rows = conn.execute(
                sa.text(
                    "INSERT INTO awa.jobs_hot (kind, queue, state, attempt, run_lease,"
                    " attempted_at, heartbeat_at) SELECT 'bench', 'bench', 'running', 1, 1,"
                    " now(), now() FROM generate_series(1, :n) RETURNING id, run_lease"
                ),
                {"n": count},
            ).all()
            # A live jobs_hot has statistics (autovacuum); a bulk-filled one has none, and then
            # PostgreSQL may plan a batch's join of items and rows as a quadratic nested loop.
            conn.execute(sa.text("ANALYZE awa.jobs_hot"))
        self._ids = iter([(r.id, r.run_lease) for r in rows])

    def take(self, count: int) -> list[tuple[int, int]]:
        return [next(self._ids) for _ in range(count)]


def floor_statements() -> tuple[Compiled, Compiled]:
    """The canonical reschedule's two statements, exactly as awa-sa compiles them."""
    lock = compile_statement(statements.routing_lock(), DIALECT, None)
    return lock, compile_statement(
        statements.canonical_move(routed=True, batch=False), DIALECT, None
    )


def move_params(job_id: int, lease: int) -> dict[str, Any]:
    """What awa-sa binds for ``(job_id, lease, RetryAfter(60.0))``: the single call's scalars."""
    values = (job_id, lease, "retry_after", 60.0, None, None)
    return dict(zip(statements.ITEM_PARAMS, values, strict=True))


def floor_op(dsn: str) -> tuple[Op, Callable[[], None]]:
    """The canonical reschedule's round trips, on awa-sa's own compiled text, through psycopg."""
    lock, move = floor_statements()
    conn = psycopg.connect(dsn)

    def op(job_id: int, lease: int) -> Any:
        run_sync(conn, lock, {})
        row = run_sync(conn, move, move_params(job_id, lease))
        conn.commit()
        return row

    return op, conn.close


def async_floor_op(dsn: str, loop: asyncio.AbstractEventLoop) -> tuple[Op, Callable[[], None]]:
    lock, move = floor_statements()
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(dsn))

    async def op(job_id: int, lease: int) -> Any:
        await run_async(conn, lock, {})
        row = await run_async(conn, move, move_params(job_id, lease))
        await conn.commit()
        return row

    return blocking(loop, op), lambda: loop.run_until_complete(conn.close())


def blocking(loop: asyncio.AbstractEventLoop, fn: Callable[[int, int], Awaitable[Any]]) -> Op:
    return lambda job_id, lease: loop.run_until_complete(fn(job_id, lease))


def interleave(
    variants: dict[str, Op], jobs: Jobs, rounds: int, per_round: int, warmup: int
) -> dict[str, list[float]]:
    """Per-op latencies in microseconds, variants interleaved round by round."""
    jobs.seed(len(variants) * (warmup + rounds * per_round))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds + 1):
        for name, op in variants.items():
            for job_id, lease in jobs.take(warmup if round_ == 0 else per_round):
                start = time.perf_counter_ns()
                op(job_id, lease)
                if round_:
                    samples[name].append((time.perf_counter_ns() - start) / 1000)
    return samples


def single_call(
    engine: sa.Engine, aengine: AsyncEngine, dsn: str, loop: asyncio.AbstractEventLoop, a: Any
) -> dict[str, list[float]]:
    floor, close_floor = floor_op(dsn)
    afloor, close_afloor = async_floor_op(dsn, loop)
    held = engine.connect()
    aheld = loop.run_until_complete(aengine.connect())

    def on_connection(job_id: int, lease: int) -> Any:
        with held.begin():
            return reschedule_canonical_attempt(held, job_id, lease, KIND)

    async def on_async_engine(job_id: int, lease: int) -> Any:
        return await awa_async.reschedule_canonical_attempt(aengine, job_id, lease, KIND)

    async def on_async_connection(job_id: int, lease: int) -> Any:
        async with aheld.begin():
            return await awa_async.reschedule_canonical_attempt(aheld, job_id, lease, KIND)

    variants: dict[str, Op] = {
        "floor: psycopg": floor,
        "awa-sa Engine": lambda j, r: reschedule_canonical_attempt(engine, j, r, KIND),
        "awa-sa Connection": on_connection,
        "floor: psycopg async": afloor,
        "awa-sa AsyncEngine": blocking(loop, on_async_engine),
        "awa-sa AsyncConnection": blocking(loop, on_async_connection),
    }
    try:
        return interleave(variants, Jobs(engine), a.rounds, a.per_round, a.warmup)
    finally:
        held.close()
        loop.run_until_complete(aheld.close())
        close_floor()
        close_afloor()


def routing(canon: sa.Engine, qs: sa.Engine, a: Any) -> dict[str, list[float]]:
    """The same Engine-form call routed canonically (Rescheduled) and to awa_qs (Migrated)."""
    lanes = {"canonical": (canon, Jobs(canon)), "queue storage": (qs, Jobs(qs))}
    for _, jobs in lanes.values():
        jobs.seed(a.warmup + a.rounds * a.per_round)
    out: dict[str, list[float]] = {name: [] for name in lanes}
    for round_ in range(a.rounds + 1):
        for name, (engine, jobs) in lanes.items():
            for job_id, lease in jobs.take(a.warmup if round_ == 0 else a.per_round):
                start = time.perf_counter_ns()
                reschedule_canonical_attempt(engine, job_id, lease, KIND)
                if round_:
                    out[name].append((time.perf_counter_ns() - start) / 1000)
    return out


def batches(engine: sa.Engine, rounds: int) -> dict[int, dict[str, float]]:
    """Attempts per second: one batch call of N against N single calls, per N."""
    jobs = Jobs(engine)
    jobs.seed(2 * (rounds + 1) * sum(BATCH_SIZES))
    out: dict[int, dict[str, float]] = {}
    for size in BATCH_SIZES:
        batch_s: list[float] = []
        single_s: list[float] = []
        for round_ in range(rounds + 1):
            items = [Attempt(j, r, KIND) for j, r in jobs.take(size)]
            start = time.perf_counter()
            reschedule_canonical_attempts(engine, items)
            if round_:
                batch_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            for job_id, lease in jobs.take(size):
                reschedule_canonical_attempt(engine, job_id, lease, KIND)
            if round_:
                single_s.append(time.perf_counter() - start)
        out[size] = {
            "batch_per_s": size / statistics.median(batch_s),
            "single_per_s": size / statistics.median(single_s),
        }
    return out


def create_database(server: EmbeddedPostgres, name: str, phase: str) -> sa.Engine:
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    engine = sa.create_engine(server.url.rsplit("/", 1)[0] + f"/{name}", pool_size=4)
    with engine.begin() as conn:
        awa_sa_schema.build(conn, ("awa", "awa_qs"))
        awa_sa_schema.set_phase(conn, phase, "awa_qs")
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--per-round", type=int, default=50, help="calls per variant and round")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per variant")
    parser.add_argument("--batch-rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    a = parser.parse_args()

    started = time.perf_counter()
    with embedded_postgres() as server:
        canon = create_database(server, "canon", "canonical")
        qs = create_database(server, "qs", "mixed_transition")
        loop = asyncio.new_event_loop()
        aengine = create_async_engine(canon.url, pool_size=4)
        dsn = canon.url.render_as_string(hide_password=False).replace("+psycopg", "")
        results = {
            "single_us": single_call(canon, aengine, dsn, loop, a),
            "routing_us": routing(canon, qs, a),
            "batch": batches(canon, a.batch_rounds),
            "batch_queue_storage": batches(qs, a.batch_rounds),
        }
        loop.run_until_complete(aengine.dispose())
        loop.close()
        canon.dispose()
        qs.dispose()
    report(results, a.json, time.perf_counter() - started)


def report(results: dict[str, Any], path: Path, seconds: float) -> None:
    single = {name: statistics.median(v) for name, v in results["single_us"].items()}

    def floor_of(name: str) -> float:
        return single["floor: psycopg async" if "sync" in name.lower() else "floor: psycopg"]

    ratios = {name: m / floor_of(name) for name, m in single.items()}
    print("single reschedule, canonical routing (median per call)")
    for name, median in single.items():
        print(f"  {name:26} {median:9.1f} µs  {ratios[name]:5.2f}x floor")
    routed = {name: statistics.median(v) for name, v in results["routing_us"].items()}
    print("routing, Engine form (median per call)")
    for name, median in routed.items():
        print(f"  {name:26} {median:9.1f} µs")
    for key, title in (("batch", "canonical"), ("batch_queue_storage", "queue storage")):
        print(f"batch vs single calls, {title} routing (attempts per second)")
        for size, row in results[key].items():
            speedup = row["batch_per_s"] / row["single_per_s"]
            print(
                f"  N={size:<5} batch {row['batch_per_s']:10.0f}/s   single"
                f" {row['single_per_s']:8.0f}/s   {speedup:6.1f}x"
            )
    summary = {
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "seconds": seconds,
        "single_median_us": single,
        "single_ratio_to_floor": ratios,
        "routing_median_us": routed,
        "batch": results["batch"],
        "batch_queue_storage": results["batch_queue_storage"],
    }
    path.write_text(json.dumps(summary, indent=2))
    print(f"{seconds:.0f} s; figures written to {path}")


if __name__ == "__main__":
    main()
