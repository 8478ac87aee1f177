"""16 callers through PgBouncer (transaction pooling, 4 server connections) beside 16 direct.

Each caller is a thread with its own client connection, in one of two processes (so the GIL of
one process does not cap them). Every caller takes running canonical attempts no other caller
is given and reschedules each once (``Snooze``, the Engine form), for a fixed time. Then the
database is read back: every call must have been ``Rescheduled`` and every job it named must
have ended exactly once (one row in ``awa.scheduled_jobs``, none left in ``awa.jobs_hot``),
the jobs no caller reached must still be running. The same load runs on a direct connection
per caller, for the throughput beside it.

Run alone with ``python -m bench.pooled [--seconds 30]``, or as the ``pooled`` part of
``python -m bench --only pooled``. Needs Debian's pgbouncer (``./dev`` installs it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa

from awa_sa import Rescheduled, Snooze, reschedule_canonical_attempt
from awa_sa.testing.pooler import pgbouncer
from awa_sa.testing.server import EmbeddedPostgres, embedded_postgres
from bench.workload import create_database, database_url

CALLERS = 16
PROCESSES = 2
SERVER_CONNECTIONS = 4
PER_PROCESS_JOBS = 200_000
"""More than a process gets through in the longest run; a caller never runs out."""
PSYCOPG_UNDER_POOLING = {"connect_args": {"prepare_threshold": None}}


def _process(url: str, first_id: int, last_id: int, threads: int, seconds: float) -> dict[str, Any]:
    """*threads* callers on ids ``first_id..last_id`` for *seconds*; what each call returned."""
    engine = sa.create_engine(url, pool_size=threads, max_overflow=0, **PSYCOPG_UNDER_POOLING)
    ids = iter(range(first_id, last_id + 1))
    take = threading.Lock()
    deadline = time.monotonic() + seconds
    called: list[int] = []
    failures: list[str] = []

    def caller() -> None:
        while time.monotonic() < deadline:
            with take:
                job_id = next(ids)
            try:
                outcome = reschedule_canonical_attempt(engine, job_id, 1, Snooze(60))
            except Exception as exc:  # a bench reports every failure, whatever its type
                failures.append(f"{job_id}: {exc!r}")
                continue
            if isinstance(outcome, Rescheduled):
                called.append(job_id)
            else:
                failures.append(f"{job_id}: {outcome!r}")

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(caller)
    elapsed = time.monotonic() - started
    engine.dispose()
    return {"called": called, "failures": failures, "seconds": elapsed}


def _seed(url: str, count: int) -> tuple[int, int]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.begin() as conn:
        low, high = conn.execute(
            sa.text(
                "WITH new AS (INSERT INTO awa.jobs_hot (kind, queue, state, attempt, run_lease,"
                " attempted_at, heartbeat_at) SELECT 'bench', 'bench', 'running', 1, 1, now(),"
                " now() FROM generate_series(1, :n) RETURNING id) SELECT min(id), max(id) FROM new"
            ),
            {"n": count},
        ).one()
        conn.exec_driver_sql("ANALYZE awa.jobs_hot")
    engine.dispose()
    return int(low), int(high)


def _read_back(url: str, low: int, high: int, called: list[int]) -> dict[str, int]:
    """How the jobs of ``low..high`` ended: moved once, moved twice or more, still running."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        moved: dict[int, int] = dict(
            conn.execute(
                sa.text(
                    "SELECT id, count(*) FROM awa.scheduled_jobs WHERE id BETWEEN :l AND :h"
                    " GROUP BY id"
                ),
                {"l": low, "h": high},
            ).all()
        )
        running = conn.scalar(
            sa.text("SELECT count(*) FROM awa.jobs_hot WHERE id BETWEEN :l AND :h"),
            {"l": low, "h": high},
        )
    engine.dispose()
    return {
        "calls": len(called),
        "distinct_jobs_called": len(set(called)),
        "moved_once": sum(1 for n in moved.values() if n == 1),
        "moved_more_than_once": sum(1 for n in moved.values() if n > 1),
        "moved_but_not_called": len(set(moved) - set(called)),
        "called_but_not_moved": len(set(called) - set(moved)),
        "still_running": int(running or 0),
        "seeded": high - low + 1,
    }


def _load(url: str, seconds: float) -> dict[str, Any]:
    low, high = _seed(url, PROCESSES * PER_PROCESS_JOBS)
    spans = [
        (url, low + k * PER_PROCESS_JOBS, low + (k + 1) * PER_PROCESS_JOBS - 1) for k in range(2)
    ]
    threads = CALLERS // PROCESSES
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(PROCESSES) as pool:
        parts = pool.starmap(_process, [(u, a, b, threads, seconds) for u, a, b in spans])
    called = [job for part in parts for job in part["called"]]
    failures = [f for part in parts for f in part["failures"]]
    ended = _read_back(url, low, high, called)
    elapsed = max(part["seconds"] for part in parts)
    exactly_once = (
        not failures
        and ended["distinct_jobs_called"] == ended["calls"] == ended["moved_once"]
        and ended["moved_more_than_once"] == ended["moved_but_not_called"] == 0
        and ended["called_but_not_moved"] == 0
        and ended["still_running"] == ended["seeded"] - ended["calls"]
    )
    return {
        "calls_per_s": len(called) / elapsed,
        "seconds": elapsed,
        "failures": failures[:20],
        "failure_count": len(failures),
        "ended": ended,
        "exactly_once": exactly_once,
    }


def run(server: EmbeddedPostgres, seconds: float = 30.0) -> dict[str, Any]:
    """Both loads on fresh fixture databases of *server*: through PgBouncer, then direct."""
    out: dict[str, Any] = {
        "callers": CALLERS,
        "processes": PROCESSES,
        "server_connections_pooled": SERVER_CONNECTIONS,
        "load_average_before": os.getloadavg(),
    }
    create_database(server, "pooled", "fixture", "canonical")
    create_database(server, "direct", "fixture", "canonical")
    with pgbouncer(server, pool_size=SERVER_CONNECTIONS) as bouncer:
        out["pgbouncer"] = _load(bouncer.database_url("pooled"), seconds)
    out["direct"] = _load(database_url(server, "direct"), seconds)
    out["load_average_after"] = os.getloadavg()
    return out


def summary(result: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.1f}" for x in result["load_average_before"])
    lines = [f"{result['callers']} callers, {result['processes']} processes (load average {load}):"]
    for name in ("pgbouncer", "direct"):
        r = result[name]
        lines.append(
            f"  {name:9} {r['calls_per_s']:8.0f} calls/s over {r['seconds']:.1f} s;"
            f" {r['ended']['calls']} calls, {r['failure_count']} failures,"
            f" exactly once: {r['exactly_once']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pooled", description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--json", default="bench/results-pooled.json")
    a = parser.parse_args()
    with embedded_postgres() as server:
        result = run(server, a.seconds)
    print(summary(result))
    if a.json:
        with open(a.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
