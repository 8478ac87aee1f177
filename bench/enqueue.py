"""Part ``enqueue`` (issue 36): new jobs, one at a time against the raw statement, and in bulk.

Two databases of their own, one canonical and one with queue storage active (built by ``awa
migrate`` and flipped by the awa CLI, or the Alembic fixture in those phases), so that every
job goes through ``awa.insert_job_compat`` to the plane of its phase.

* **One job**: awa-sa's ``enqueue`` against ``SELECT * FROM awa.insert_job_compat(...)`` sent
  by hand on psycopg 3, prepared, with the values awa-sa binds for the same job: alone in
  autocommit on the Engine form's pooled connection, checked out outside the clock (the
  floor), and inside a transaction the caller has open on the Connection form's held
  connection (the in-transaction floor), as :mod:`bench.endings` compares its endings. The
  variants are interleaved in short blocks by :func:`bench.measure.interleave`; the round
  trips per call are counted by a second, short pass through :mod:`bench.proxy` (no delay).
* **Bulk**: *size* jobs in one transaction, five ways, in :mod:`bench.enqueue_bulk`; against
  awa-pg's ``enqueue_many_copy`` and a plain INSERT in :mod:`bench.enqueue_anchor`.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import sqlalchemy as sa

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres
from bench import enqueue_anchor
from bench.enqueue_bulk import KIND, args_of, bulk_summary
from bench.floor import Borrowed, directly, set_autocommit
from bench.measure import interleave
from bench.proxy import Distant
from bench.report import spread
from bench.variants import Variant, Variants
from bench.workload import awa_cli, create_database, database_url

PLANES = {"canonical": "enqueue", "queue storage": "enqueue_qs"}
"""Each plane's database."""
RAW = (
    "SELECT * FROM awa.insert_job_compat(%s, %s, %s::jsonb, %s::awa.job_state, %s::smallint,"
    " %s::smallint, %s::timestamptz, %s::jsonb, %s::text[], %s::bytea, %s::bit(8), %s::bytea)"
)
"""The producer function called by hand, as awa-pg's own ``insert`` calls it."""


class Numbers:
    """The interleaving's supply for calls that need no running attempt: fresh numbers."""

    def __init__(self) -> None:
        self.next = 0

    def seed(self, count: int) -> None:
        pass

    def take(self, count: int) -> list[tuple[int, int]]:
        self.next += count
        return [(n, 0) for n in range(self.next - count, self.next)]


def databases(
    server: EmbeddedPostgres, cluster: str, planes: dict[str, str] = PLANES
) -> dict[str, str]:
    """Each plane's database on *server* (``awa migrate`` for *cluster* ``awa``), named as
    *planes* names it, with ``pg_stat_statements`` for every copy the bulk ways time: its URL."""
    canonical, qs = planes["canonical"], planes["queue storage"]
    create_database(server, canonical, cluster, "canonical")
    if cluster == "awa":
        # A copy of the freshly migrated database is what a second ``awa migrate`` builds, in a
        # fraction of its time.
        admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{qs}" TEMPLATE "{canonical}"'))
        admin.dispose()
        _flip_to_active(server, qs)
    else:
        create_database(server, qs, "fixture", "active")
    urls = {plane: database_url(server, name) for plane, name in planes.items()}
    for url in urls.values():
        engine = sa.create_engine(url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        engine.dispose()
    return urls


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


def build(urls: dict[str, str]) -> Variants:
    """Per plane: the raw statement's two floors and awa-sa's Engine and Connection forms."""
    out = Variants()
    for plane, url in urls.items():
        engine = sa.create_engine(url, pool_size=2)
        held = engine.connect()
        out.closers += [engine.dispose, held.close]
        out.items += _variants(f"psycopg {plane} enqueue", engine, held)
    return out


def _variants(group: str, engine: sa.Engine, held: sa.Connection) -> list[Variant]:
    alone = Borrowed(engine, directly, set_autocommit)  # the Engine form's backend

    def raw(conn: Any, n: int) -> Any:
        # What awa-sa binds for the job (awa_sa.enqueue.new_jobs.JobValues), the args serialised
        # here too.
        values = (KIND, "default", json.dumps(args_of(n)), "available", 2, 25, None, "{}")
        return conn.execute(RAW, (*values, [], None, None, None), prepare=True).fetchall()

    def held_begin() -> None:
        held.begin()
        held.exec_driver_sql("SELECT 1").all()

    return [
        Variant(group, "floor", lambda n, _: raw(alone.conn, n), alone.before, alone.after),
        Variant(
            group,
            "in-transaction floor",
            lambda n, _: raw(held.connection.driver_connection, n),
            held_begin,
            held.commit,
        ),
        Variant(group, "awa-sa Engine", lambda n, _: awa_sa.enqueue(engine, args_of(n), kind=KIND)),
        Variant(
            group,
            "awa-sa Connection",
            lambda n, _: awa_sa.enqueue(held, args_of(n), kind=KIND),
            held_begin,
            held.commit,
        ),
    ]


def round_trips(port: int, urls: dict[str, str], calls: int = 5) -> dict[str, float]:
    """Each variant's round trips per call, counted at a proxy that adds no delay."""
    # Warmed past psycopg's fifth execution of a statement, which prepares it in a round trip
    # of its own.
    with Distant(port, 0.0, seconds=120) as proxy:
        far = {
            p: sa.make_url(u).set(port=proxy.port).render_as_string(False) for p, u in urls.items()
        }
        built = build(far)
        try:
            samples = interleave(
                built.items,
                Numbers(),
                rounds=1,
                per_round=calls,
                warmup=10,
                count=proxy.round_trips,
            )
        finally:
            built.close()
    return {name: s.round_trips / s.calls for name, s in samples.items()}


def summary(result: dict[str, Any]) -> str:
    """The part's report: each ratio the issue names, with its target (the pieces that ran)."""
    lines: list[str] = []
    if "single" in result:
        lines += _single_summary(result)
    if "bulk" in result:
        lines += bulk_summary(result)
    if "anchor" in result:
        lines += enqueue_anchor.summary(result["anchor"])
    return "\n".join(lines)


def _single_summary(result: dict[str, Any]) -> list[str]:
    single, trips = result["single"], result["round_trips"]
    n = len(single["rounds"])
    lines = [
        f"enqueue: single enqueue / raw statement, psycopg 3 (insert_job_compat sent by hand; {n}"
        " rounds, median [min-max]; the Connection form against it inside an open transaction)"
    ]
    ratios = spread(single)
    for name, row in single["variants"].items():
        mid, low, high = ratios[name]
        lines.append(
            f"  {name:50} {row['wall_us']:9.1f} µs  {mid:4.2f}x [{low:4.2f}-{high:4.2f}]"
            f"  {trips[name]:4.1f} round trips"
        )
    return lines
