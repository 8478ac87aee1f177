"""Interleaved timing: every variant a few calls per round, round after round.

A variant's untimed steps (the Connection forms' open transaction and its commit) run around
each call, outside the clock and outside the round-trip count.

Drift on a busy machine (other processes, autovacuum, a warming cache, the scheduler moving a
backend between CPUs) then lands on every variant alike, and medians resist outliers, if the
blocks are short. Here a loopback round trip's cost moves between two levels as a run goes on:
in blocks of 40 calls a floor and its form each caught their own mix of the two (one run's
asyncpg AsyncEngine form was 1.13x its floor in one round, 1.40x in another); in blocks of five
they catch the same mix (docs/performance.md#short-blocks). The variants run in a new order
every round (the same shuffles every run), so that none keeps one neighbour: a call runs faster
after one that warmed the same code (seen: psycopg's Engine form at 1.37x its one-statement
floor in the fixed order, 1.21-1.25x once a variant on the same pool ran just before it).
Besides wall time, each call's CPU time in this thread (the client's Python, the driver and
its system calls) is kept: the server's share of a call is the same for every variant, so the
CPU column says where a gap comes from.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.variants import Variant


class Supply(Protocol):
    """What each call is given, ``(id, run_lease)``: running attempts, or plain numbers."""

    def seed(self, count: int) -> None: ...

    def take(self, count: int) -> list[tuple[int, int]]: ...


@dataclass
class Samples:
    wall_us: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    round_trips: int = 0
    calls: int = 0

    def summary(self) -> dict[str, float]:
        out = {
            "wall_us": statistics.median(self.wall_us),
            "cpu_us": statistics.median(self.cpu_us),
        }
        if self.round_trips:
            out["round_trips"] = self.round_trips / self.calls
        return out


def interleave(
    variants: Sequence[Variant],
    jobs: Supply,
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    count: Callable[[], int] | None = None,
) -> dict[str, Samples]:
    """Per-call samples of each variant; *count* (round trips so far) is read around each call,
    between its untimed steps, if it has any."""
    jobs.seed(len(variants) * (warmup + rounds * per_round))
    samples = {v.name: Samples() for v in variants}
    for round_ in range(rounds + 1):
        order = list(variants)
        random.Random(round_).shuffle(order)  # a new order, so new neighbours, every round
        for variant in order:
            s = samples[variant.name]
            counter = count if round_ else None
            for job_id, lease in jobs.take(warmup if round_ == 0 else per_round):
                if variant.before:
                    variant.before()
                start = counter() if counter else 0
                wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
                variant.op(job_id, lease)
                if round_:
                    s.cpu_us.append((time.thread_time_ns() - cpu) / 1000)
                    s.wall_us.append((time.perf_counter_ns() - wall) / 1000)
                if counter:
                    s.round_trips += counter() - start
                    s.calls += 1
                if variant.after:
                    variant.after()
    return samples
