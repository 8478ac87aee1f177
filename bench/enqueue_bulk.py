"""Part ``enqueue``, in bulk (issue 36): *size* jobs in one transaction, five ways.

awa-sa's ``enqueue_many`` (Engine form) called as awa-pg's ``insert_many_copy`` is, with the
same list of args and ``kind``, and again with a ``NewJob`` per job (the form for jobs that
differ in more than their args); awa-pg 0.6.9's ``Client.insert_many_copy`` (COPY into
a staging table, then the producer function once per job), *size* single ``enqueue`` calls
(Connection form), and the server calling ``insert_job_compat`` for each job with nothing of a
client around it (:data:`FUNCTION_ALONE`, the floor of both bulk paths). Each way runs once per
round on a fresh copy of the plane's database (:func:`bulk` says why), the order turning each
round, and its median is kept, with the statements the server ran for it
(``pg_stat_statements``, top level, BEGIN, COMMIT and COPY included, the harness's own
subtracted): awa-pg's counted the same way as ours. :func:`far` times the batch and the single
calls again with the server further away.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import awa
import sqlalchemy as sa

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres
from bench.proxy import Distant
from bench.workload import fresh_copy, round_trip, server_statements

KIND = "bench"


def args_of(n: int, tag: str = "") -> dict[str, Any]:
    return {"n": n, "round": tag, "to": f"user{n}@example.com"}


TARGETS = {"enqueue_many / COPY": ("<=", 1.0), "singles / enqueue_many": (">=", 20.0)}
"""Issue 36's: ``enqueue_many``'s time over ``insert_many_copy``'s at most, and *size* single
``enqueue`` calls' over ``enqueue_many``'s at least."""

Way = Callable[[sa.Engine, "awa.Client", list[dict[str, Any]]], None]


def bulk(server: EmbeddedPostgres, urls: dict[str, str], size: int, rounds: int) -> dict[str, Any]:
    """Per plane, each way's median seconds, jobs per second and statements.

    Every timed call gets the same start: a fresh copy of the plane's database, its
    connections opened and warmed by two jobs, then a checkpoint, all outside the clock. On
    one growing database each way met tables the ways before it had filled and whatever
    checkpoint or write-back they had left due, so a way's time depended on its place in the
    round (COPY's median moved by a third between two quiet runs). The ways' order also turns
    by one each round.
    """
    out: dict[str, Any] = {}
    for plane, url in urls.items():
        out[plane] = _measure(server, sa.make_url(url).database or "", size, rounds)
    return out


def _measure(server: EmbeddedPostgres, template: str, size: int, rounds: int) -> dict[str, Any]:
    names = list(WAYS)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    statements: dict[str, list[int]] = {name: [] for name in names}
    for round_ in range(rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            took, count = _timed(server, template, WAYS[name], _round(size, f"{name} {round_}"))
            seconds[name].append(took)
            statements[name].append(count)
    return {
        name: {
            "seconds": statistics.median(seconds[name]),
            "jobs_per_s": size / statistics.median(seconds[name]),
            "statements": statistics.median(statements[name]),
            "rounds": seconds[name],
        }
        for name in names
    }


def far(
    server: EmbeddedPostgres, urls: dict[str, str], size: int, rtts_ms: list[float]
) -> dict[str, Any]:
    """Per plane and added round trip, ``enqueue_many``'s and the single calls' seconds with
    the Engine's connections through :mod:`bench.proxy`, each on fresh copies: the batch's
    median of three (one slow sample moved the ratio by a fifth), the singles once (at tens
    of seconds, far steadier).

    On loopback a single call's round trip is short beside what the function costs the server
    per job, which no caller can avoid; a real service's database is further away, and this
    is what the singles' ratio becomes there.
    """
    out: dict[str, Any] = {}
    for plane, url in urls.items():
        template = sa.make_url(url).database or ""
        out[plane] = {}
        for rtt in rtts_ms:
            row: dict[str, float] = {}
            with Distant(server.port, rtt * 500, seconds=3600) as proxy:
                for name, rounds in (("awa-sa enqueue_many", 3), ("awa-sa enqueue x N", 1)):
                    way, args = WAYS[name], _round(size, name)
                    took = [
                        _timed(server, template, way, args, proxy.port)[0] for _ in range(rounds)
                    ]
                    row[name] = statistics.median(took)
                distant = sa.make_url(url).set(drivername="postgresql", port=proxy.port)
                row["round trip"] = round_trip(distant.render_as_string(False), 50)
            out[plane][f"{rtt:g}"] = row
    return out


def _round(size: int, tag: str) -> list[dict[str, Any]]:
    return [args_of(n, tag) for n in range(size)]


@contextmanager
def warmed(
    server: EmbeddedPostgres,
    template: str,
    way: Way,
    *,
    port: int | None = None,
    connect_args: Mapping[str, Any] | None = None,
) -> Iterator[tuple[sa.Engine, awa.Client, sa.Engine]]:
    """The start every timed call gets: a fresh copy of *template*, *way*'s Engine and
    awa-pg's client on it, warmed by two jobs, then a checkpoint. Yields them with an
    autocommit engine for the harness's own statements; the Engine's connections through
    *port* where one is given, made with *connect_args*."""
    with fresh_copy(server, template, file_copy=True) as url:
        engine = sa.create_engine(
            sa.make_url(url).set(port=port) if port else url,
            pool_size=2,
            connect_args=dict(connect_args or {}),
        )
        admin = sa.create_engine(url, pool_size=1, isolation_level="AUTOCOMMIT")
        client = awa.Client(sa.make_url(url).set(drivername="postgresql").render_as_string(False))
        try:
            way(engine, client, [args_of(-n, "warm") for n in range(1, 3)])
            with admin.connect() as conn:
                conn.execute(sa.text("CHECKPOINT"))
            yield engine, client, admin
        finally:
            client.close()
            engine.dispose()
            admin.dispose()


def _timed(
    server: EmbeddedPostgres,
    template: str,
    way: Way,
    args: list[dict[str, Any]],
    port: int | None = None,
) -> tuple[float, int]:
    """*way*'s seconds for *args* on a fresh copy of *template*, and the statements it sent;
    the Engine's connections through *port* where one is given."""
    with warmed(server, template, way, port=port) as (engine, client, admin):
        server_statements(admin, reset=True)
        start = time.perf_counter()
        way(engine, client, args)
        took = time.perf_counter() - start
        return took, server_statements(admin)


def _batch(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    awa_sa.enqueue_many(engine, args, kind=KIND)


def _batch_of_new_jobs(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    awa_sa.enqueue_many(engine, [awa_sa.NewJob(a, kind=KIND) for a in args])


def _copy(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    client.insert_many_copy(args, kind=KIND)


def _singles(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    with engine.connect() as conn:
        for a in args:
            awa_sa.enqueue(conn, a, kind=KIND)
        conn.commit()


def _function_alone(engine: sa.Engine, client: awa.Client, args: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        conn.execute(FUNCTION_ALONE, {"kind": KIND, "args": json.dumps(args)}).scalar_one()


FUNCTION_ALONE = sa.text(
    "SELECT count(*) FROM jsonb_array_elements(CAST(:args AS jsonb)) AS given(args)"
    " CROSS JOIN LATERAL awa.insert_job_compat("
    "CAST(:kind AS text), 'default', given.args, 'available', 2::smallint, 25::smallint,"
    " NULL, '{}'::jsonb, ARRAY[]::text[], NULL, NULL, NULL) AS job"
)
"""Awa's producer function called once per job by the server alone: no row goes back and no
client checks or hashes anything, so its time is what any caller of the function pays at
least: the floor of ``enqueue_many`` and of ``insert_many_copy``, which calls it once per job
too, and, over *size* single calls, the ceiling of any batch's ratio
(docs/contract.md#enqueue-bounds)."""
WAYS: dict[str, Way] = {
    "awa-sa enqueue_many": _batch,
    "awa-pg insert_many_copy": _copy,
    "awa-sa enqueue_many NewJob": _batch_of_new_jobs,
    "awa-sa enqueue x N": _singles,
    "insert_job_compat alone": _function_alone,
}
"""The bulk ways, each given the Engine and awa-pg's client on the same fresh database; the
pair with a target side by side, so that a round's two samples meet the same machine."""


def bulk_summary(result: dict[str, Any]) -> list[str]:
    """The bulk ways' lines of the part's report: each ratio the issue names, with its
    target, and the bounds beside them."""
    lines: list[str] = []
    for plane, ways in result["bulk"].items():
        lines.append(f"enqueue: {result['size']} jobs in one transaction, {plane}")
        for name, row in ways.items():
            lines.append(
                f"  {name:26} {row['seconds'] * 1000:9.1f} ms {row['jobs_per_s']:9.0f} jobs/s"
                f" {row['statements']:8.0f} statements"
            )
        batch, copy = "awa-sa enqueue_many", "awa-pg insert_many_copy"
        singles, alone = "awa-sa enqueue x N", "insert_job_compat alone"
        for label, top, bottom in (
            ("enqueue_many / COPY", batch, copy),
            ("singles / enqueue_many", singles, batch),
        ):
            ratio, spread = _per_round(ways, top, bottom)
            bound, target = TARGETS[label]
            met = ratio <= target if bound == "<=" else ratio >= target
            verdict = "met" if met else "MISSED"
            lines.append(
                f"  {label:26} {ratio:6.2f}x {spread}  target {bound} {target:.1f}x {verdict}"
            )
        for label, top, bottom, note in (
            ("NewJob form / COPY", "awa-sa enqueue_many NewJob", copy, ""),
            ("function alone / COPY", alone, copy, "  (any caller's floor)"),
            ("singles / function alone", singles, alone, "  (any batch's ceiling)"),
        ):
            ratio, spread = _per_round(ways, top, bottom)
            lines.append(f"  {label:26} {ratio:6.2f}x {spread}{note}")
        for rtt, far_ways in result["far"][plane].items():
            ratio = far_ways["awa-sa enqueue x N"] / far_ways["awa-sa enqueue_many"]
            trip = far_ways["round trip"] * 1000
            label = f"singles / enqueue_many, proxy +{rtt} ms (round trip {trip:.2f} ms)"
            lines.append(
                f"  {label}: {ratio:.2f}x ({far_ways['awa-sa enqueue x N']:.1f} s / "
                f"{far_ways['awa-sa enqueue_many'] * 1000:.0f} ms)"
            )
    return lines


def _per_round(ways: dict[str, Any], top: str, bottom: str) -> tuple[float, str]:
    """*top*'s time over *bottom*'s, round by round (the two ran minutes apart at most, on
    fresh copies of one database): the median, and its ``[min-max]`` across rounds. Single
    samples on this kind of machine move by a tenth; a round's pair moves together."""
    ratios = [a / b for a, b in zip(ways[top]["rounds"], ways[bottom]["rounds"], strict=True)]
    return statistics.median(ratios), f"[{min(ratios):.2f}-{max(ratios):.2f}]"
