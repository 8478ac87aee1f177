"""``python -m bench.enqueue_many``: 10,000 new jobs, three ways, on both planes.

* awa-sa's ``enqueue_many`` (Engine form): one statement for the whole batch;
* awa-pg 0.6.9's ``Client.insert_many_copy``: its COPY-based bulk insert;
* 10,000 of awa-sa's single ``enqueue`` in one transaction (Connection form).

Each on a database built by ``awa migrate``, canonical and then with queue storage active
(``awa storage prepare``, ``enter-mixed-transition --quiesced``, ``finalize``). Besides the
time, the statements the server ran for each (``pg_stat_statements``, top level, utility
statements such as BEGIN, COMMIT and COPY included, the harness's own subtracted): a proxy for
round trips that counts awa-pg's the same way as ours. Rounds alternate the three, and the
median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import awa
import sqlalchemy as sa

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres, embedded_postgres
from bench.workload import awa_cli, create_database, database_url

Way = Callable[[list[dict[str, Any]]], None]
SETTINGS = ("shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=top")


def _jobs(size: int, tag: str) -> list[dict[str, Any]]:
    return [{"n": n, "round": tag, "to": f"user{n}@example.com"} for n in range(size)]


def _queries(engine: sa.Engine) -> list[tuple[int, str]]:
    """What the server ran since the reset: (calls, the query's first 60 characters)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT calls, left(query, 60) FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND query NOT LIKE '%pg_stat_statements%' ORDER BY calls DESC"
            )
        )
        return [(int(calls), str(query)) for calls, query in rows]


def _statements(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                    "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " AND query NOT LIKE '%pg_stat_statements%'"
                )
            ).scalar_one()
        )


def _reset(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        conn.commit()


def _awa_sa_batch(engine: sa.Engine, args: list[dict[str, Any]]) -> None:
    awa_sa.enqueue_many(engine, [awa_sa.NewJob(a, kind="bench") for a in args])


def _awa_sa_singles(engine: sa.Engine, args: list[dict[str, Any]]) -> None:
    with engine.connect() as conn:
        for a in args:
            awa_sa.enqueue(conn, a, kind="bench")
        conn.commit()


def _measure(engine: sa.Engine, ways: dict[str, Way], a: Any) -> dict[str, dict[str, float]]:
    _reset(engine)
    harness = _statements(engine)  # the reset's and this read's own, in every count below
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    statements: dict[str, list[int]] = {name: [] for name in ways}
    for round_ in range(a.rounds + 1):  # round 0 warms up
        for name, way in ways.items():
            args = _jobs(a.size, f"{name}-{round_}")
            _reset(engine)
            start = time.perf_counter()
            way(args)
            took = time.perf_counter() - start
            sent = _statements(engine) - harness
            if a.show_statements and round_ == 1:
                print(name, _queries(engine))
            if round_:
                seconds[name].append(took)
                statements[name].append(sent)
    return {
        name: {
            "seconds": statistics.median(seconds[name]),
            "jobs_per_s": a.size / statistics.median(seconds[name]),
            "statements": statistics.median(statements[name]),
        }
        for name in ways
    }


def _flip_to_active(server: EmbeddedPostgres, name: str) -> None:
    cli = awa_cli()
    assert cli is not None
    env = {**os.environ, "DATABASE_URL": server.database_url(name, "postgres"), "RUST_LOG": "warn"}
    for args in (
        ["storage", "prepare-queue-storage-schema", "--schema", "awa_qs"],
        ["storage", "prepare", "--engine", "queue_storage", "--details", '{"schema": "awa_qs"}'],
        ["storage", "enter-mixed-transition", "--quiesced"],
        ["storage", "finalize"],
    ):
        subprocess.run([cli, *args], env=env, check=True, capture_output=True, timeout=120)


def _ways(engine: sa.Engine, client: awa.Client) -> dict[str, Way]:
    def copy(args: list[dict[str, Any]]) -> None:
        client.insert_many_copy(args, kind="bench")

    return {
        "awa-sa enqueue_many": lambda args: _awa_sa_batch(engine, args),
        "awa-pg insert_many_copy": copy,
        "awa-sa enqueue x N": lambda args: _awa_sa_singles(engine, args),
    }


def run(server: EmbeddedPostgres, a: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for plane in ("canonical", "queue storage"):
        name = "canonical" if plane == "canonical" else "qs"
        create_database(server, name, "awa", "canonical")
        if plane != "canonical":
            _flip_to_active(server, name)
        url = database_url(server, name)
        engine = sa.create_engine(url, pool_size=2)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        client = awa.Client(sa.make_url(url).set(drivername="postgresql").render_as_string(False))
        try:
            out[plane] = _measure(engine, _ways(engine, client), a)
        finally:
            client.close()
            engine.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.enqueue_many")
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--show-statements", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("bench/results_enqueue.json"))
    a = parser.parse_args()
    with embedded_postgres(SETTINGS) as server:
        results = run(server, a)
    for plane, ways in results.items():
        print(f"{plane}: {a.size} jobs, median of {a.rounds} rounds")
        for name, figures in ways.items():
            print(
                f"  {name:<26} {figures['seconds'] * 1000:9.1f} ms "
                f"{figures['jobs_per_s']:9.0f} jobs/s {figures['statements']:8.0f} statements"
            )
    a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
