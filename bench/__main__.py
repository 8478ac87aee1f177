"""``python -m bench``: awa-sa against the raw drivers, the server's cost, distance, concurrency.

Everything runs against one throwaway PostgreSQL (``awa_sa.testing.server``) with
pg_stat_statements loaded. The main database is built by ``awa migrate`` when the awa CLI is
installed (else by the Alembic fixture) and keeps canonical routing; database ``qs`` is the
fixture flipped into ``mixed_transition`` towards ``awa_qs`` (neither is built when only
optional parts run: those build their own). Parts, in order:

1. one call, per driver and form, against that driver's raw floor (:mod:`bench.variants`), and
   which steps of SQLAlchemy the difference goes to (:mod:`bench.breakdown`), and which of
   awa-sa's layers its share over the pool floor goes to (:mod:`bench.layers`);
2. the same with the server 0.5 ms away, and the round trips each call makes
   (:mod:`bench.proxy`);
3. the database's own time per reschedule (:mod:`bench.server_cost`);
4. 1, 4 and 16 concurrent callers, and what they wait on (:mod:`bench.concurrency`);
5. routing (canonical against queue storage) and batches against single calls;
6. each ending (complete, cancel, fail) against the worker's own UPDATE (:mod:`bench.endings`),
   and the settle of a queue-storage attempt against its own statements sent raw
   (:mod:`bench.receipts`);
8. only when asked (``--only pooled``): 16 callers through PgBouncer beside 16 direct
   (:mod:`bench.pooled`);
9. only when asked (``--only enqueue``): one new job against Awa's producer function sent raw,
   10,000 in one transaction against awa-pg's COPY and single calls (:mod:`bench.enqueue`,
   :mod:`bench.enqueue_bulk`), and 10,000 and 100,000 against awa-pg's ``enqueue_many_copy``
   and a plain INSERT (:mod:`bench.enqueue_anchor`);
10. only when asked (``--only administer``): retry and discard 10,000 failed jobs against
   awa-pg's own calls (:mod:`bench.administer`);
11. only when asked (``--only reads``): a job read by id and 100 orders joined with their jobs
   on a queue-storage cluster of ``--jobs`` completed jobs, against awa-pg's ``get_job`` and
   the ``awa.jobs`` view (:mod:`bench.reads`).
12. only when asked (``--only handlers``): the README's exactly-once recipe inside a real awa-pg
   worker under load, against a handler that returns at once and one that commits its row alone
   (:mod:`bench.handlers`).

Run it as ``.venv/bin/python -m bench``; figures also go to ``bench/results.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from awa_sa import Attempt, reschedule_canonical_attempt, reschedule_canonical_attempts
from awa_sa.testing.server import EmbeddedPostgres, embedded_postgres
from bench import (
    administer,
    breakdown,
    concurrency,
    endings,
    enqueue,
    enqueue_anchor,
    enqueue_bulk,
    handlers,
    layers,
    pooled,
    reads,
    receipts,
    server_cost,
    variants,
)
from bench.measure import Supply, interleave
from bench.proxy import Distant
from bench.report import report
from bench.workload import KIND, Jobs, awa_cli, create_database, database_url, round_trip

BATCH_SIZES = (1, 10, 100, 1000)
PARTS = (
    "single",
    "breakdown",
    "layers",
    "distance",
    "server",
    "callers",
    "routing",
    "batch",
    "batch_queue_storage",
    "endings",
    "receipts",
)
OPTIONAL_PARTS = ("pooled", "enqueue", "administer", "reads", "handlers")
"""Run only when named in --only: ``pooled`` needs pgbouncer and takes a minute, ``enqueue``
writes 10,000 jobs many times over and takes minutes, ``administer`` has a real worker fail
10,000 jobs per plane and copies a database for every call, ``reads`` has a real worker
complete ``--reads-jobs`` jobs, ``handlers`` runs a real worker through thousands of jobs per
handler, plane and concurrency."""


def single_call(host: str, port: int, dbname: str, url: str, a: Any) -> dict[str, Any]:
    """Part 1 as independent rounds: each its own warm-up and interleaved measurement."""
    loop = asyncio.new_event_loop()
    jobs = Jobs(url)
    jobs.seed(64)
    built = variants.build(host, port, dbname, loop, jobs, drivers=a.drivers)
    try:
        rounds = _rounds(built.items, url, a)
    finally:
        built.close()
        loop.close()
    return {
        "variants": _medians(rounds),
        "rounds": rounds,
        "groups": {v.name: v.group for v in built.items},
        "skipped": built.skipped,
    }


def _rounds(
    items: list[variants.Variant], url: str, a: Any, supply: Supply | None = None
) -> list[dict[str, Any]]:
    """*a.single_rounds* independent measurements of *items*: fresh attempts and a warm-up
    each, so that a ratio is read as its spread across rounds, not one round's value.
    *supply* gives the attempts (canonical ``Jobs`` by default)."""
    out = []
    for _ in range(a.single_rounds):
        samples = interleave(
            items, supply or Jobs(url), rounds=a.rounds, per_round=a.per_round, warmup=a.warmup
        )
        out.append({v.name: samples[v.name].summary() for v in items})
    return out


def _medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant's figures, the median across rounds."""
    return {
        name: {key: statistics.median(r[name][key] for r in rounds) for key in row}
        for name, row in rounds[0].items()
    }


def completion(url: str, a: Any) -> dict[str, Any]:
    """Each ending, awa-sa against the worker's own UPDATE (:mod:`bench.endings`), as rounds."""
    return _measured(endings.build(url), url, a)


def queue_storage_settles(url: str, a: Any) -> dict[str, Any]:
    """The queue-storage settle against its own statements sent raw (:mod:`bench.receipts`)."""
    supply = receipts.Receipts(url)
    return _measured(receipts.build(url, supply), url, a, supply)


def _measured(
    built: variants.Variants, url: str, a: Any, supply: Supply | None = None
) -> dict[str, Any]:
    """*built*'s variants measured as rounds, then closed: the medians, the rounds, the groups."""
    try:
        rounds = _rounds(built.items, url, a, supply)
    finally:
        built.close()
    return {
        "variants": _medians(rounds),
        "rounds": rounds,
        "groups": {v.name: v.group for v in built.items},
    }


def enqueueing(server: EmbeddedPostgres, a: Any) -> dict[str, Any]:
    """Part 9 (:mod:`bench.enqueue`): one job against the raw statement as rounds, its round
    trips, then the bulk ways."""
    urls = enqueue.databases(server, a.cluster)
    out: dict[str, Any] = {"size": a.enqueue_size}
    if "single" in a.enqueue_parts:
        out["single"] = _measured(enqueue.build(urls), "", a, enqueue.Numbers())
        out["round_trips"] = enqueue.round_trips(server.port, urls)
    if "bulk" in a.enqueue_parts:
        out["bulk"] = enqueue_bulk.bulk(server, urls, a.enqueue_size, a.enqueue_rounds)
        out["far"] = enqueue_bulk.far(server, urls, a.enqueue_size, a.enqueue_rtt_ms)
    if "anchor" in a.enqueue_parts:
        sizes, rounds = a.enqueue_anchor_sizes, a.enqueue_anchor_rounds
        out["anchor"] = enqueue_anchor.run(server, urls, sizes, rounds)
    return out


def at_distance(port: int, dbname: str, url: str, a: Any) -> dict[str, Any]:
    """Every variant through the delaying proxy, with round trips counted per call."""
    loop = asyncio.new_event_loop()
    nominal = a.rtt_ms * 500  # µs each way
    password = sa.make_url(url).password
    with Distant(port, nominal, seconds=30) as trial:  # the proxy's own hops add a little
        added = _added_rtt(port, trial.port, dbname, password)
        delay = max(0.0, nominal - (added - 2 * nominal) / 2)
    with Distant(port, delay, seconds=170) as proxy:
        added = _added_rtt(port, proxy.port, dbname, password)
        jobs = Jobs(url)
        jobs.seed(64)
        built = variants.build("127.0.0.1", proxy.port, dbname, loop, jobs, drivers=a.drivers)
        try:
            samples = interleave(
                built.items,
                Jobs(url),
                rounds=a.far_rounds,
                per_round=a.far_per_round,
                warmup=20,
                count=proxy.round_trips,
            )
        finally:
            built.close()
            loop.close()
    return {
        "added_rtt_us": added,
        "variants": {v.name: samples[v.name].summary() for v in built.items},
        "groups": {v.name: v.group for v in built.items},
    }


def _added_rtt(port: int, far: int, dbname: str, password: str | None) -> float:
    """What the proxy really adds to one round trip (sleeps overshoot): median, in µs."""
    url = f"postgresql://postgres:{password}@127.0.0.1:{{}}/{dbname}"
    near = round_trip(url.format(port), 200)
    return (round_trip(url.format(far), 200) - near) * 1e6


def routing(canon: sa.Engine, qs: sa.Engine, a: Any) -> dict[str, float]:
    """The same Engine-form call routed canonically (Rescheduled) and to awa_qs (Migrated)."""
    lanes = {"canonical": (canon, Jobs.on(canon)), "queue storage": (qs, Jobs.on(qs))}
    for _, jobs in lanes.values():
        jobs.seed(a.warmup + a.rounds * a.per_round // 2)
    out: dict[str, list[float]] = {name: [] for name in lanes}
    for round_ in range(a.rounds // 2 + 1):
        for name, (engine, jobs) in lanes.items():
            for job_id, lease in jobs.take(a.warmup if round_ == 0 else a.per_round):
                start = time.perf_counter_ns()
                reschedule_canonical_attempt(engine, job_id, lease, KIND)
                if round_:
                    out[name].append((time.perf_counter_ns() - start) / 1000)
    return {name: statistics.median(v) for name, v in out.items()}


def batches(engine: sa.Engine, rounds: int) -> dict[int, dict[str, float]]:
    """Attempts per second: one batch call of N against N single calls, per N."""
    jobs = Jobs.on(engine)
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


def _postmaster(server: EmbeddedPostgres) -> int:
    """The pid of *server*'s postmaster, which every backend is forked from."""
    return int((server.datadir / "postmaster.pid").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--single-rounds",
        type=int,
        default=3,
        help="independent measurements of parts 1 and 6, each with its own warm-up",
    )
    parser.add_argument("--rounds", type=int, default=160, help="interleaved rounds")
    parser.add_argument(
        "--per-round",
        type=int,
        default=5,
        help="calls per variant and round: few, so that drift lands on every variant alike",
    )
    parser.add_argument("--warmup", type=int, default=150, help="untimed calls per variant")
    parser.add_argument("--rtt-ms", type=float, default=0.5, help="round trip the proxy adds")
    parser.add_argument("--far-rounds", type=int, default=5)
    parser.add_argument("--far-per-round", type=int, default=16)
    parser.add_argument("--server-calls", type=int, default=500)
    parser.add_argument("--callers-seconds", type=float, default=1.0)
    parser.add_argument("--callers-rounds", type=int, default=2)
    parser.add_argument("--batch-rounds", type=int, default=5)
    parser.add_argument("--pooled-seconds", type=float, default=30.0)
    parser.add_argument("--enqueue-size", type=int, default=10_000, help="jobs per bulk way")
    parser.add_argument("--enqueue-rounds", type=int, default=6, help="bulk rounds, median")
    parser.add_argument(
        "--enqueue-rtt-ms",
        type=lambda text: [float(rtt) for rtt in text.split(",")],
        default=[0.5, 2.5],
        help="round trips the proxy adds to the bulk singles and enqueue_many, comma-separated",
    )
    parser.add_argument(
        "--enqueue-parts",
        type=lambda names: set(names.split(",")),
        default={"single", "bulk", "anchor"},
        help="which of part enqueue's pieces run: single, bulk (with far), anchor",
    )
    parser.add_argument(
        "--enqueue-anchor-sizes",
        type=lambda text: [int(size) for size in text.split(",")],
        default=[10_000, 100_000],
        help="jobs per call against enqueue_many_copy, comma-separated",
    )
    parser.add_argument("--enqueue-anchor-rounds", type=int, default=3, help="rounds, median")
    parser.add_argument("--administer-size", type=int, default=10_000, help="failed jobs")
    parser.add_argument("--administer-rounds", type=int, default=3, help="rounds, median")
    parser.add_argument("--reads-jobs", type=int, default=10_000, help="completed jobs (reads)")
    parser.add_argument("--reads-calls", type=int, default=200, help="awa-sa reads timed")
    parser.add_argument(
        "--jobs", type=int, default=2000, help="handlers: jobs a run at concurrency 16 (fewer at 1)"
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="handlers: then grow each plane to this many finished jobs and measure again",
    )
    parser.add_argument(
        "--handlers-concurrency",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 16],
        help="handlers: the queue's concurrencies, comma-separated",
    )
    parser.add_argument(
        "--handlers-planes",
        type=lambda text: text.split(","),
        default=list(handlers.PLANES),
        help="handlers: comma-separated, of " + ", ".join(handlers.PLANES),
    )
    parser.add_argument("--handlers-rounds", type=int, default=2, help="handlers: rounds")
    parser.add_argument(
        "--cluster", choices=("awa", "fixture"), default="awa" if awa_cli() else "fixture"
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts ({', '.join(PARTS + OPTIONAL_PARTS)})",
    )
    parser.add_argument(
        "--drivers",
        type=lambda names: set(names.split(",")),
        help="comma-separated driver groups of parts 1 and 2 (default: all): "
        + ", ".join(driver.name for driver in variants.DRIVERS),
    )
    parser.add_argument(
        "--one-core",
        action="store_true",
        help="run the bench and its server on one CPU: no cross-core wake-ups (see"
        " docs/performance.md#one-core); the concurrency parts then share that CPU",
    )
    a = parser.parse_args()
    only = set(a.only.split(","))
    if a.one_core:  # before the server starts: its processes inherit the affinity
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    # Stopped from outside, still stop the server and the proxy (their finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.perf_counter()
    parts: dict[str, float] = {}

    results: dict[str, Any] = {}

    def timed(name: str, fn: Any, *args: Any) -> None:
        if name in only:
            t = time.perf_counter()
            results[name] = fn(*args)
            parts[name] = time.perf_counter() - t

    load_before = os.getloadavg()
    with embedded_postgres(server_cost.SETTINGS) as server:
        server_cpus = sorted(os.sched_getaffinity(_postmaster(server)))
        if only & set(PARTS):  # the optional parts build databases of their own
            create_database(server, "main", a.cluster, "canonical")
            create_database(server, "qs", "fixture", "mixed_transition")
        url = database_url(server, "main")
        timed("single", single_call, server.host, server.port, "main", url, a)
        breakdown_urls = {
            "psycopg": url,
            "psycopg async": url,
            "asyncpg": database_url(server, "main", "asyncpg"),
        }
        timed("breakdown", breakdown.run, breakdown_urls)
        timed("layers", layers.run, url, a.rounds, 5 * a.per_round, a.warmup)
        timed("distance", at_distance, server.port, "main", url, a)
        timed("server", server_cost.measure, url, "main", a.server_calls)
        timed("callers", concurrency.run, url, a.callers_seconds, a.callers_rounds)
        canon = sa.create_engine(url, pool_size=2)
        qs = sa.create_engine(database_url(server, "qs"), pool_size=2)
        timed("routing", routing, canon, qs, a)
        timed("batch", batches, canon, a.batch_rounds)
        timed("batch_queue_storage", batches, qs, a.batch_rounds)
        timed("endings", completion, url, a)
        timed("receipts", queue_storage_settles, database_url(server, "qs"), a)
        canon.dispose()
        qs.dispose()
        timed("pooled", pooled.run, server, a.pooled_seconds)
        timed("enqueue", enqueueing, server, a)
        size, rounds = a.administer_size, a.administer_rounds
        timed("administer", administer.run, server, a.cluster, size, rounds)
        timed("reads", reads.run, server, a.cluster, a.reads_jobs, a.reads_calls)
        if "handlers" in only and a.cluster != "awa":
            raise SystemExit("part handlers needs the awa CLI (awa migrate) for its clusters")
        timed("handlers", handlers.run, server, a)
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "server_cpu_affinity": server_cpus,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cluster": "awa migrate (awa-cli)" if a.cluster == "awa" else "Alembic fixture",
    }
    results["machine"] = machine
    results["seconds"] = time.perf_counter() - started
    results["parts_seconds"] = parts
    report(results)
    if "pooled" in results:
        print(pooled.summary(results["pooled"]))
    if "enqueue" in results:
        print(enqueue.summary(results["enqueue"]))
    if "administer" in results:
        print(administer.summary(results["administer"]))
    if "reads" in results:
        print(reads.summary(results["reads"]))
    if "handlers" in results:
        print(handlers.summary(results["handlers"]))
    a.json.write_text(json.dumps(results, indent=2, default=str))
    print(f"{results['seconds']:.0f} s; figures written to {a.json}")


if __name__ == "__main__":
    main()
