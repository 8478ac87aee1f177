"""What every part of the bench works on: databases, running attempts, and the statements' text.

The main database is built by the published ``awa migrate`` (the awa-cli wheel) when its binary
is installed, else by the Alembic fixture; the routing and batch parts also use a fixture
database flipped into ``mixed_transition``. Attempts are seeded in bulk as a worker's claims
leave them, and each is rescheduled once.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Dialect

import awa_sa_schema
from awa_sa import RetryAfter, statements
from awa_sa.core.compiled import Compiled, compiled
from awa_sa.settle.statements.attempts import MoveItem, item_binds
from awa_sa.testing.server import EmbeddedPostgres

KIND = RetryAfter(60.0)
"""Every measured call: a retry in a minute, no error appended, progress cleared."""


def awa_cli() -> str | None:
    beside = Path(sys.executable).with_name("awa")
    return str(beside) if beside.exists() else shutil.which("awa")


def database_url(server: EmbeddedPostgres, name: str, driver: str = "psycopg") -> str:
    return server.database_url(name, f"postgresql+{driver}")


def round_trip(url: str, calls: int) -> float:
    """The median seconds of one prepared ``SELECT 1`` on psycopg at *url* (a libpq URL): a
    round trip as the driver sees it, a proxy's own cost included."""
    with psycopg.connect(url) as conn:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            conn.execute("SELECT 1", prepare=True).fetchall()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextmanager
def fresh_copy(server: EmbeddedPostgres, source: str, *, file_copy: bool = False) -> Iterator[str]:
    """A copy of database *source* for one timed call, every connection to it tracked by
    ``pg_stat_statements`` (:func:`server_statements`), dropped afterwards: its URL.

    *file_copy* copies the files (``STRATEGY FILE_COPY``, with its checkpoint) instead of
    logging every page.
    """
    name = f"{source}_copy"
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        # Nothing may be connected to a template while it is copied.
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                " WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": source},
        )
        strategy = " STRATEGY FILE_COPY" if file_copy else ""
        conn.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE "{source}"{strategy}'))
        # The server tracks nothing (bench.server_cost), and a copy takes no per-database
        # setting: every connection to it tracked from here on.
        conn.execute(sa.text(f'ALTER DATABASE "{name}" SET pg_stat_statements.track = top'))
    try:
        yield database_url(server, name)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


def server_statements(admin: sa.Engine, reset: bool = False) -> int:
    """Top-level statements this database ran since the last reset (after it, with *reset*),
    but the harness's own (in autocommit, so no BEGIN or COMMIT of its own either)."""
    with admin.connect() as conn:
        if reset:
            conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        return int(
            conn.execute(
                sa.text(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                    " AND query NOT LIKE '%pg_stat_statements%'"
                )
            ).scalar_one()
        )


def create_database(server: EmbeddedPostgres, name: str, build: str, phase: str) -> None:
    """Database *name*, built by ``awa migrate`` (*build* ``awa``) or the fixture, in *phase*."""
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    if build == "awa":
        cli = awa_cli()
        assert cli is not None
        env = {
            **os.environ,
            "DATABASE_URL": server.database_url(name, "postgres"),
            "RUST_LOG": "warn",
        }
        subprocess.run([cli, "migrate"], env=env, check=True, capture_output=True, timeout=120)
        assert phase == "canonical", "the bench flips only fixture databases"
        return
    engine = sa.create_engine(database_url(server, name), poolclass=sa.NullPool)
    with engine.begin() as conn:
        awa_sa_schema.build(conn, ("awa", "awa_qs"))
        awa_sa_schema.set_phase(conn, phase, "awa_qs")
    engine.dispose()


class Jobs:
    """A supply of running canonical attempts ``(id, run_lease)``, seeded in bulk."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._ids: Iterator[tuple[int, int]] = iter(())

    @classmethod
    def on(cls, engine: sa.Engine) -> Jobs:
        """Jobs in *engine*'s database (its URL with the password, which ``str()`` masks)."""
        return cls(engine.url.render_as_string(hide_password=False))

    def seed(self, count: int) -> None:
        engine = sa.create_engine(self.url, poolclass=sa.NullPool)
        with engine.begin() as conn:
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
        engine.dispose()
        self._ids = iter([(r.id, r.run_lease) for r in rows])

    def take(self, count: int) -> list[tuple[int, int]]:
        return [next(self._ids) for _ in range(count)]


def canonical_texts(dialect: Dialect) -> tuple[Compiled, Compiled]:
    """The two statements of the path before the one statement (the lock, the routing move),
    as awa-sa sends them on *dialect* when it goes on from the one statement."""
    return (
        compiled(statements.routing_lock(), dialect),
        compiled(statements.canonical_move(routed=True, batch=False), dialect),
    )


def one_statement_text(dialect: Dialect) -> Compiled:
    """The canonical reschedule's one statement exactly as awa-sa sends it on *dialect*."""
    return compiled(statements.move_if_canonical(batch=False), dialect)


def move_values(job_id: int, lease: int) -> dict[str, Any]:
    """What awa-sa binds for ``(job_id, lease, RetryAfter(60.0))``: the single call's scalars.

    ``Compiled.params`` lays them out for the driver (a dict, or a tuple in placeholder order).
    """
    return dict(item_binds([MoveItem(job_id, lease, "retry_after", 60.0, None, None)]))
