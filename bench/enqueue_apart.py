"""Where a bulk way's time goes (issue 36): ``python -m bench.enqueue_apart [rounds]``.

The bulk ways of :mod:`bench.enqueue_bulk` but the single calls, each call started as the bench
starts it (a fresh copy of the plane's database, warmed by two jobs, checkpointed), with what
the wall time alone does not say: the client thread's CPU, the CPU of the call's backends
(``/proc/<pid>/schedstat``) and the time the garbage collector ran during the call, with the
generation-2 (full) collections counted (``gc.callbacks``). Medians of *rounds* (8), the order
turning each round. This is how docs/performance.md#enqueue splits the ways' times; it needs
the awa CLI.

Then, on queue storage, ``enqueue_many`` with the session's ``client_min_messages`` at
PostgreSQL's default and at ``warning``, alternating: Awa's function there raises notices for
every job, which the driver reads into Python (docs/enqueue.md#notices).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any

import sqlalchemy as sa

from awa_sa.testing.server import embedded_postgres
from bench import enqueue, server_cost
from bench.enqueue_bulk import WAYS, args_of, warmed
from bench.open_receipts import cpu_ms

NAMES = [name for name in WAYS if name != "awa-sa enqueue x N"]


class Collector:
    """The collector's time and full collections since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full += info["generation"] == 2


def _call(server: Any, template: str, name: str, collector: Collector) -> list[float]:
    """One call of way *name*: wall, thread and backend ms, collector ms, full collections."""
    with warmed(server, template, WAYS[name]) as (engine, client, admin):
        with admin.connect() as conn:
            pids = list(
                conn.execute(
                    sa.text(
                        "SELECT pid FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalars()
            )
        args = [args_of(n, name) for n in range(10_000)]
        backend = sum(cpu_ms(pid) for pid in pids)
        collector.reset()
        thread, wall = time.thread_time(), time.perf_counter()
        WAYS[name](engine, client, args)
        wall, thread = time.perf_counter() - wall, time.thread_time() - thread
        backend = sum(cpu_ms(pid) for pid in pids) - backend
        return [wall * 1000, thread * 1000, backend, collector.seconds * 1000, collector.full]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    collector = Collector()
    with embedded_postgres(server_cost.SETTINGS) as server:
        urls = enqueue.databases(server, "awa")
        for plane, url in urls.items():
            template = sa.make_url(url).database or ""
            seen: dict[str, list[list[float]]] = {name: [] for name in NAMES}
            for round_ in range(rounds):
                turn = round_ % len(NAMES)
                for name in NAMES[turn:] + NAMES[:turn]:
                    seen[name].append(_call(server, template, name, collector))
            print(f"{plane}: medians of {rounds} calls, ms")
            for name, calls in seen.items():
                wall, thread, backend, collecting = (
                    statistics.median(call[n] for call in calls) for n in range(4)
                )
                full = sum(int(call[4]) for call in calls)
                print(
                    f"  {name:28} wall {wall:6.0f} client thread {thread:4.0f}"
                    f" backends {backend:6.0f} collector {collecting:3.0f}"
                    f" (full collections in {full} of {rounds} calls)"
                )
        notices(server, sa.make_url(urls["queue storage"]).database or "", rounds)


def notices(server: Any, template: str, rounds: int) -> None:
    """``enqueue_many`` of 10,000 jobs with the server's notices sent, and without."""
    seen: dict[str, list[tuple[float, float]]] = {"notice": [], "warning": []}
    for round_ in range(rounds):
        for level in ("notice", "warning") if round_ % 2 == 0 else ("warning", "notice"):
            options = {"options": f"-c client_min_messages={level}"}
            batch = WAYS["awa-sa enqueue_many"]
            with warmed(server, template, batch, connect_args=options) as (engine, client, _):
                args = [args_of(n, level) for n in range(10_000)]
                thread, wall = time.thread_time(), time.perf_counter()
                batch(engine, client, args)
                wall, thread = time.perf_counter() - wall, time.thread_time() - thread
                seen[level].append((wall * 1000, thread * 1000))
    print(f"queue storage, enqueue_many, client_min_messages: medians of {rounds} calls, ms")
    for level, calls in seen.items():
        wall, thread = (statistics.median(call[n] for call in calls) for n in range(2))
        print(f"  {level:8} wall {wall:6.0f} client thread {thread:5.0f}")
    ratios = [w[0] / n[0] for w, n in zip(seen["warning"], seen["notice"], strict=True)]
    print(f"  warning / notice, round by round: {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
