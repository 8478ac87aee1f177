"""What every part of the bench works on: databases, running attempts, and the statements' text.

The main database is built by the published ``awa migrate`` (the awa-cli wheel) when its binary
is installed, else by the Alembic fixture; the routing and batch parts also use a fixture
database flipped into ``mixed_transition``. Attempts are seeded in bulk as a worker's claims
leave them, and each is rescheduled once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

import awa_sa_schema
from awa_sa import RetryAfter, statements
from awa_sa.compiled import Compiled, compiled
from awa_sa.statements.attempts import MoveItem, item_binds
from awa_sa.testing.server import EmbeddedPostgres

KIND = RetryAfter(60.0)
"""Every measured call: a retry in a minute, no error appended, progress cleared."""


def awa_cli() -> str | None:
    beside = Path(sys.executable).with_name("awa")
    return str(beside) if beside.exists() else shutil.which("awa")


def database_url(server: EmbeddedPostgres, name: str, driver: str = "psycopg") -> str:
    return server.database_url(name, f"postgresql+{driver}")


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
