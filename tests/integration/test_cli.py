"""The ``awa-sa`` command end to end on real servers and real rows.

As a user runs it, a subprocess, where only a real process proves it: the entry point,
``$DATABASE_URL``, the demo's own server, Ctrl-C. The rest calls the entry function in this
process (tests/command_line.py), the same command for a fraction of the CPU (issue 39).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from command_line import assert_one_line_error, awa_sa_cmd, awa_sa_in_process, printed_blocks
from conftest import Cluster, database_url
from racing import in_thread

import awa_sa_schema
from awa_sa.tables import runtime as runtime_tables
from awa_sa.tables.canonical import jobs_hot, scheduled_jobs
from awa_sa.testing.server import EmbeddedPostgres
from awa_sa.tools import scratch

OUTCOMES = ("Rescheduled", "Migrated", "CancelledDuplicate", "Stale")


def demo_databases(pg: EmbeddedPostgres) -> list[str]:
    engine = sa.create_engine(database_url(pg, "postgres"), poolclass=sa.NullPool)
    with engine.connect() as conn:
        names = conn.execute(
            sa.text("SELECT datname FROM pg_database WHERE datname LIKE 'awa_sa_demo_%'")
        ).scalars()
        found = list(names)
    engine.dispose()
    return found


# --- demo -----------------------------------------------------------------------------------


def test_demo_on_existing_server(pg: EmbeddedPostgres) -> None:
    proc = awa_sa_in_process("-v", "demo", "--url", database_url(pg, "postgres"))
    assert proc.returncode == 0, proc.stderr
    # -v: the library's own log records (logger awa_sa) reach stderr.
    assert re.search(r"awa_sa DEBUG .*Migrated", proc.stderr)
    for outcome in OUTCOMES:
        assert outcome in proc.stdout
    # Each outcome is reported with the table it was read back from.
    assert re.search(r"Rescheduled .* awa\.scheduled_jobs", proc.stdout)
    assert re.search(r"Migrated .* awa_qs\.deferred_jobs", proc.stdout)
    assert re.search(r"CancelledDuplicate .* cancelled .* awa_qs\.done_entries", proc.stdout)
    assert re.search(r"Stale .* nothing changed", proc.stdout)
    assert "Traceback" not in proc.stderr
    assert demo_databases(pg) == []


def test_demo_with_its_own_server() -> None:
    started = time.monotonic()
    proc = awa_sa_cmd("demo")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    for outcome in OUTCOMES:
        assert outcome in proc.stdout
    root = re.search(r"throwaway PostgreSQL in (\S+),", proc.stdout)
    assert root is not None
    assert not Path(root.group(1)).exists()
    assert elapsed < 60


def test_demo_interrupted_cleans_up(pg: EmbeddedPostgres) -> None:
    """Ctrl-C after the demo database exists: it is dropped and the exit status says so."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "awa_sa", "demo", "--url", database_url(pg, "postgres")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("schema:"):  # the demo database exists and is built
            break
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler prints where every thread is
        out, err = proc.communicate()
        pytest.fail(f"the demo hung after SIGINT:\n{out}\n{err}")
    assert proc.returncode in (0, 130)  # 0 only if it finished before the signal landed
    assert "Traceback" not in err
    assert demo_databases(pg) == []


def test_demo_drops_its_database_after_a_ctrl_c_in_the_middle_of_a_connect(
    pg: EmbeddedPostgres,
) -> None:
    """The interrupted connect's backend waits for the rest of the password exchange, which
    holds DROP DATABASE (its barrier) until authentication_timeout: a minute, had the demo kept
    the socket alive in the traceback."""
    url = sa.make_url(database_url(pg, "postgres"))

    def interrupted_connect(engine: sa.Engine) -> None:
        conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        half_open = psycopg.pq.PGconn.connect_start(conninfo.encode())
        # Startup sent, the server asks for SCRAM; the client's first message sent, the server
        # answers: the backend now waits for the client's proof, as a Ctrl-C leaves it.
        for _ in range(2):
            while half_open.connect_poll() != psycopg.pq.PollingStatus.READING:
                pass
            select.select([half_open.socket], [], [], 10)
        raise KeyboardInterrupt

    def walk() -> None:
        with scratch.fresh_database(url) as engine:
            interrupted_connect(engine)

    pending = in_thread(walk)
    try:  # a hang detector only: the cleanup takes well under a second
        interrupted = pending.exception(timeout=30)
    except TimeoutError:
        pytest.fail("DROP DATABASE waited for the half-open connection")
    assert type(interrupted) is KeyboardInterrupt
    assert demo_databases(pg) == []


def test_demo_unreachable_server() -> None:
    proc = awa_sa_in_process("demo", "--url", "postgresql://postgres@127.0.0.1:1/postgres")
    assert_one_line_error(proc, "Connection refused")


# --- sql (what needs no server is in tests/unit/test_listing.py) -----------------------------


def as_prepare(sql: str, name: str) -> str:
    """``PREPARE`` text for a pyformat statement: each distinct bind becomes ``$n``."""
    numbers: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        return f"${numbers.setdefault(m.group(1), len(numbers) + 1)}"

    return f"PREPARE {name} AS " + re.sub(r"%\((\w+)\)s", number, sql)


FIXTURE_LACKS = re.compile(
    r"\binsert_job_compat\b|\.(?:"
    + "|".join(table.name for table in runtime_tables.metadata.tables.values())
    + r")\b"
)
"""What a statement may name that only an ``awa migrate`` cluster has (awa_sa.tables.runtime)."""


@pytest.mark.parametrize("kind", ["fixture", "real"])
def test_every_printed_statement_prepares(
    kind: str, request: pytest.FixtureRequest, clone_database: Callable[[str], str]
) -> None:
    """PostgreSQL parses and plans each printed statement against a v040 schema with awa_qs."""
    url = clone_database(request.getfixturevalue(f"{kind}_template"))
    proc = awa_sa_in_process("sql", "--schema", "awa_qs")
    assert proc.returncode == 0, proc.stderr
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        for n, (title, sql) in enumerate(printed_blocks(proc.stdout)):
            if kind == "fixture" and FIXTURE_LACKS.search(sql):
                continue  # Awa's producer function and the runtime's tables: not in the fixture
            try:
                conn.exec_driver_sql(as_prepare(sql, f"s{n}"))
            except sa.exc.DBAPIError as exc:
                pytest.fail(f"{title} does not prepare: {exc.orig}")
        conn.rollback()
    engine.dispose()


# --- status ---------------------------------------------------------------------------------


def status_json(url: str) -> dict[str, object]:
    proc = awa_sa_in_process("status", "--url", url, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert isinstance(data, dict)
    return data


def insert_canonical(engine: sa.Engine, table: sa.Table, states: Sequence[str]) -> None:
    with engine.begin() as conn:
        for state in states:
            conn.execute(
                sa.insert(table).values(kind="cli", queue="q", args={}, state=state, run_lease=1)
            )


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("canonical", ("canonical", 0, "canonical")),
        ("prepared", ("prepared", 1, "canonical")),
        ("mixed_transition", ("mixed_transition", 2, "awa_qs")),
        ("active", ("active", 3, "awa_qs")),
    ],
)
def test_status_on_fixture_in_each_phase(
    engine: sa.Engine, db_url: str, phase: str, expected: tuple[str, int, str]
) -> None:
    state, epoch, routing = expected
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, phase, "awa_qs")
    insert_canonical(engine, jobs_hot, ["running", "running", "completed"])
    insert_canonical(engine, scheduled_jobs, ["retryable"])
    data = status_json(db_url)
    assert (data["phase"], data["epoch"], data["routing"]) == (state, epoch, routing)
    assert data["schema_version"] == 40
    assert data["jobs_hot"] == {"running": 2, "completed": 1}
    assert data["scheduled_jobs"] == {"retryable": 1}
    assert data["canonical_live_backlog"] == 3
    assert data["finalize_ready"] is False

    text = awa_sa_in_process("status", "--url", db_url)
    assert text.returncode == 0, text.stderr
    assert f"phase        {state} (epoch {epoch})" in text.stdout
    assert "awa.jobs_hot: running 2, completed 1" in text.stdout


def test_status_on_real_cluster(
    pg: EmbeddedPostgres, real_db_url: str, real_engine: sa.Engine
) -> None:
    """A database built by ``awa migrate``, moved through phases by awa's own CLI."""
    cluster = Cluster("real", pg, real_db_url, real_engine)
    insert_canonical(cluster.engine, jobs_hot, ["running", "available", "cancelled"])
    data = status_json(cluster.url)
    assert (data["phase"], data["epoch"], data["routing"]) == ("canonical", 0, "canonical")
    assert data["jobs_hot"] == {"available": 1, "running": 1, "cancelled": 1}
    assert data["canonical_live_backlog"] == 2

    cluster.set_phase("mixed_transition", "awa_qs")
    data = status_json(cluster.url)
    assert (data["phase"], data["epoch"], data["routing"]) == ("mixed_transition", 2, "awa_qs")
    assert data["queue_storage_schema"] == "awa_qs"
    assert data["deferred_jobs"] == {}
    text = awa_sa_in_process("status", "--url", cluster.url)
    assert "finalize     blocked: canonical live backlog 2" in text.stdout

    with cluster.engine.begin() as conn:
        conn.execute(sa.delete(jobs_hot).where(jobs_hot.c.state != "cancelled"))
    data = status_json(cluster.url)
    assert data["canonical_live_backlog"] == 0
    assert data["finalize_ready"] is True
    cluster.awa("storage", "finalize")  # and awa agrees
    assert status_json(cluster.url)["phase"] == "active"


def test_status_url_from_environment(db_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": db_url}
    proc = subprocess.run(
        [sys.executable, "-m", "awa_sa", "status"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "phase        canonical (epoch 0)" in proc.stdout
    assert "plane        canonical: every running attempt is a row of awa.jobs_hot" in proc.stdout


def test_status_accepts_awa_style_url(pg: EmbeddedPostgres, db_url: str) -> None:
    """``postgres://`` is what awa's own CLI takes in DATABASE_URL."""
    dbname = sa.make_url(db_url).database
    assert dbname is not None
    data = status_json(pg.database_url(dbname, "postgres"))
    assert data["phase"] == "canonical"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("not a url", "--url is not a database URL"),
        ("mysql://root@localhost/db", "--url is not a PostgreSQL URL"),
        ("postgresql://postgres@127.0.0.1:1/postgres", "Connection refused"),
    ],
)
def test_status_bad_urls(url: str, fragment: str) -> None:
    assert_one_line_error(awa_sa_in_process("status", "--url", url), fragment)


def test_status_missing_database(pg: EmbeddedPostgres) -> None:
    proc = awa_sa_in_process("status", "--url", database_url(pg, "no_such_db"))
    assert_one_line_error(proc, 'database "no_such_db" does not exist')


def test_status_not_an_awa_cluster(pg: EmbeddedPostgres) -> None:
    proc = awa_sa_in_process("status", "--url", database_url(pg, "postgres"))
    assert_one_line_error(proc, "not an Awa cluster")


def test_status_wrong_version(engine: sa.Engine, db_url: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO awa.schema_version (version, description, applied_at) "
            "VALUES (43, 'newer awa', now())"
        )
    assert_one_line_error(awa_sa_in_process("status", "--url", db_url), "Awa schema is v043")


def test_status_hides_password() -> None:
    proc = awa_sa_in_process("status", "--url", "postgresql://u:s3cret@127.0.0.1:1/db")
    assert_one_line_error(proc)
    assert "s3cret" not in proc.stderr


def test_help() -> None:
    proc = awa_sa_cmd("--help")
    assert proc.returncode == 0
    for command in ("demo", "sql", "status"):
        assert command in proc.stdout


def test_the_listing_of_a_fresh_interpreter_is_the_one_tested_in_process() -> None:
    """The other listing tests run the command in the test's process, where anything the suite
    imported first is already there; a fresh ``awa-sa sql`` must print the same."""
    fresh = awa_sa_cmd("sql", "--schema", "awa_qs")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout == awa_sa_in_process("sql", "--schema", "awa_qs").stdout
