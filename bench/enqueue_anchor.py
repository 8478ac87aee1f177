"""Part ``enqueue``, against awa-pg's fastest bulk path: ``enqueue_many_copy`` (the anchor).

On queue storage (active), *size* jobs of one kind, each a list of args under one ``kind``,
go in one transaction four ways: awa-sa's ``enqueue_many`` (Engine form), awa-pg 0.6.9's
``Client.enqueue_many_copy`` (COPY into a staging table, then set-based writes: the anchor),
its ``Client.insert_many_copy`` (the producer function once per job; only up to
:data:`PER_JOB_UP_TO` jobs, at a minute per 100,000), and the **floor**: the same ready rows
written by one plain ``INSERT ... SELECT`` over the bound JSON array, nothing else (no lane,
no segment, no NOTIFY, nothing back). On the canonical plane, where every way ends in the
producer function, ``enqueue_many`` against ``insert_many_copy`` and the function alone.

Each call starts as :mod:`bench.enqueue_bulk` starts it (a fresh copy of the plane's database,
warmed by two jobs, checkpointed), the order turning each round. Per call: wall time, the
client process's CPU (all its threads: awa-pg's runtime runs outside the calling one), and
the CPU of every backend of the database (``/proc/<pid>/schedstat``). Medians of the rounds;
each ratio the median of its round-by-round ratios, with their spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import awa
import sqlalchemy as sa

import awa_sa
from awa_sa.enqueue.statements import args_array
from awa_sa.testing.server import EmbeddedPostgres
from bench.enqueue_bulk import FUNCTION_ALONE, KIND, Way, args_of, warmed
from bench.open_receipts import cpu_ms

PER_JOB_UP_TO = 10_000
"""``insert_many_copy`` calls the producer function per job: 5-6 s per 10,000 on queue storage."""

FLOOR = sa.text(
    "INSERT INTO awa_qs.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,"
    " priority, attempt, run_lease, max_attempts, lane_seq, enqueue_shard, run_at, created_at)"
    " SELECT ring.current_slot, ring.generation, given.id, :kind, 'default', given.args, 2, 0,"
    " 0, 25, given.id, 0, now(), now()"
    " FROM (SELECT nextval('awa_qs.job_id_seq') AS id, args"
    " FROM jsonb_array_elements(CAST(:args AS jsonb)) AS args) AS given"
    " CROSS JOIN (SELECT current_slot, generation FROM awa_qs.queue_ring_state) AS ring"
)
"""The ready rows ``enqueue_many_copy`` writes for the batch, by one plain statement: what no
bulk path can beat on the rows alone (ids drawn, args parsed and stored, the index written)."""


def _enqueue_many(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    awa_sa.enqueue_many(engine, args, kind=KIND)


def _enqueue_many_copy(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    client.enqueue_many_copy(args, kind=KIND)


def _insert_many_copy(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    client.insert_many_copy(args, kind=KIND)


def _floor(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        conn.execute(FLOOR, {"kind": KIND, "args": args_array(args)})


def _function_alone(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        conn.execute(FUNCTION_ALONE, {"kind": KIND, "args": args_array(args)}).scalar_one()


ANCHOR = "awa-pg enqueue_many_copy"
PER_JOB = "awa-pg insert_many_copy"
QUEUE_STORAGE: dict[str, Way] = {
    "awa-sa enqueue_many": _enqueue_many,
    ANCHOR: _enqueue_many_copy,
    PER_JOB: _insert_many_copy,
    "floor: one plain INSERT": _floor,
}
CANONICAL: dict[str, Way] = {
    "awa-sa enqueue_many": _enqueue_many,
    PER_JOB: _insert_many_copy,
    "insert_job_compat alone": _function_alone,
}


def run(
    server: EmbeddedPostgres, urls: dict[str, str], sizes: list[int], rounds: int
) -> dict[str, Any]:
    """Per plane and size, each way's calls: ``[wall, client CPU, backends' CPU]`` in ms."""
    out: dict[str, Any] = {}
    for plane, ways, plane_sizes in (
        ("queue storage", QUEUE_STORAGE, sizes),
        ("canonical", CANONICAL, [min(sizes)]),
    ):
        template = sa.make_url(urls[plane]).database or ""
        for size in plane_sizes:
            names = [n for n in ways if n != PER_JOB or size <= PER_JOB_UP_TO]
            calls: dict[str, list[list[float]]] = {name: [] for name in names}
            for round_ in range(rounds):
                turn = round_ % len(names)
                for name in names[turn:] + names[:turn]:
                    args = [args_of(n, f"{name} {round_}") for n in range(size)]
                    calls[name].append(_call(server, template, ways[name], args))
            out[f"{plane}, {size}"] = calls
    return out


def _call(
    server: EmbeddedPostgres,
    template: str,
    way: Callable[[sa.Engine, awa.Client, list[dict[str, Any]]], None],
    args: list[dict[str, Any]],
) -> list[float]:
    with warmed(server, template, way) as (engine, client, admin):
        with admin.connect() as conn:
            pids = list(
                conn.execute(
                    sa.text(
                        "SELECT pid FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalars()
            )
        backend = sum(cpu_ms(pid) for pid in pids)
        cpu, wall = time.process_time(), time.perf_counter()
        way(engine, client, args)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        backend = sum(cpu_ms(pid) for pid in pids) - backend
        return [wall * 1000, cpu * 1000, backend]


def summary(result: dict[str, Any]) -> list[str]:
    """Each plane and size: the ways' medians, and each way over the anchor (or, canonical,
    over ``insert_many_copy``), round by round."""
    lines = []
    for label, calls in result.items():
        base = ANCHOR if ANCHOR in calls else PER_JOB
        rounds = len(calls[base])
        lines.append(f"enqueue against {base}: {label} jobs, medians of {rounds} rounds")
        for name, seen in calls.items():
            wall, cpu, backend = (statistics.median(c[i] for c in seen) for i in range(3))
            ratios = [c[0] / b[0] for c, b in zip(seen, calls[base], strict=True)]
            lines.append(
                f"  {name:26} wall {wall:8.0f} ms  client CPU {cpu:6.0f}  backends CPU"
                f" {backend:7.0f}  {statistics.median(ratios):5.2f}x"
                f" [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    return lines
