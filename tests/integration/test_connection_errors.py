"""Connection failures are classified by cause, the same on every driver, and write nothing.

* The server refused the connection: its own SQLSTATE (3D000, 28000, 28P01, 53300, 57P03),
  although libpq keeps none for a connection it could not open (psycopg 3, psycopg2).
* Nothing answered: 08001 (``CANNOT_CONNECT``).
* Connected, but the session cannot write (``default_transaction_read_only``, a hot standby):
  :class:`~awa_sa.ReadOnlyTransaction`, SQLSTATE 25006, and ``pool_pre_ping`` does not help
  (its ping passes, and the next call on the pooled connection fails alike).
* A connection lost during a call is 08006: ``test_drivers.py``'s fault tests kill the backend
  before and after every statement, on every driver.

Each case runs on psycopg 3 (sync and async), psycopg2, pg8000 and asyncpg; the job is read
back unchanged after all of them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import sqlalchemy as sa
from calling import DRIVERS, refusal, reschedule
from jobs import insert_job
from racing import fingerprint, wait_for

from awa_sa import Attempt, DatabaseError, ReadOnlyTransaction, Rescheduled, Snooze
from awa_sa.core.errors import CANNOT_CONNECT
from awa_sa.testing.server import EmbeddedPostgres, embedded_postgres


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _roles(pg: EmbeddedPostgres, *specs: str) -> Iterator[list[str]]:
    """Roles created with ``CREATE ROLE <name> <spec>`` (password: the name), dropped after."""
    names = [f"r_{uuid.uuid4().hex[:10]}" for _ in specs]
    admin = sa.create_engine(pg.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        for name, spec in zip(names, specs, strict=True):
            conn.exec_driver_sql(f"CREATE ROLE {name} {spec} PASSWORD '{name}'")
    try:
        yield names
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.exec_driver_sql(f"DROP ROLE {name}")
        admin.dispose()


def _running_job(engine: sa.Engine) -> Attempt:
    with engine.begin() as conn:
        return Attempt(insert_job(conn), 1, Snooze(5))


def _classified_alike(
    targets: dict[str, tuple[sa.URL, str]], attempt: Attempt, engine: sa.Engine
) -> None:
    before = fingerprint(engine)
    seen = {
        (case, driver): refusal(driver, url, attempt)
        for case, (url, _) in targets.items()
        for driver in DRIVERS
    }
    wrong = {
        key: (type(exc).__name__, getattr(exc, "sqlstate", None), str(exc))
        for key, exc in seen.items()
        if type(exc) is not DatabaseError or exc.sqlstate != targets[key[0]][1]
    }
    assert not wrong
    assert fingerprint(engine) == before


def test_refused_connections_keep_the_servers_code_on_every_driver(
    pg: EmbeddedPostgres, db_url: str, engine: sa.Engine
) -> None:
    attempt = _running_job(engine)
    url = sa.make_url(db_url)
    with _roles(pg, "NOLOGIN", "LOGIN CONNECTION LIMIT 0") as (nologin, limited):
        targets = {
            "missing database": (url.set(database="no_such_database"), "3D000"),
            # scram-sha-256 answers an unknown role as a wrong password, not to reveal it.
            "missing role": (url.set(username="no_such_role"), "28P01"),
            "role without LOGIN": (url.set(username=nologin, password=nologin), "28000"),
            "wrong password": (url.set(password="wrong"), "28P01"),
            "too many connections": (url.set(username=limited, password=limited), "53300"),
            "closed port": (url.set(port=_closed_port()), CANNOT_CONNECT),
        }
        _classified_alike(targets, attempt, engine)


def _psycopg_error(url: str) -> str:
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError as exc:
        return str(exc)
    return ""


def test_a_server_shutting_down_is_57P03_on_every_driver() -> None:
    with embedded_postgres() as other:
        admin = sa.create_engine(other.url, poolclass=sa.NullPool)
        with admin.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (x int)")
        url = sa.make_url(other.url)
        libpq = other.database_url("postgres", "postgresql")
        with psycopg.connect(libpq) as held:  # a smart shutdown waits for this session
            _as_server_account(
                other, "pg_ctl", "-D", str(other.datadir), "-m", "smart", "-W", "stop"
            )
            wait_for(lambda: "shutting down" in _psycopg_error(libpq), what="shutdown")
            targets = {"shutting down": (url, "57P03")}
            seen = {d: refusal(d, url, Attempt(1, 1, Snooze(1))) for d in DRIVERS}
            assert {
                d: (type(e), getattr(e, "sqlstate", None)) for d, e in seen.items()
            } == dict.fromkeys(DRIVERS, (DatabaseError, "57P03")), targets
            held.execute("SELECT 1")  # the old session still works
        admin.dispose()


def _as_server_account(pg: EmbeddedPostgres, tool: str, *args: str) -> None:
    subprocess.run(
        [str(pg.bindir / tool), *args],
        check=True,
        capture_output=True,
        text=True,
        user="postgres" if os.geteuid() == 0 else None,
        cwd=pg.root,
        timeout=120,
    )


@contextmanager
def _standby(primary: EmbeddedPostgres) -> Iterator[EmbeddedPostgres]:
    """A streaming hot standby of *primary* (pg_basebackup -R), same roles and password."""
    standby = EmbeddedPostgres(password=primary.password)
    try:
        _as_server_account(
            primary,
            "pg_basebackup",
            *("-h", str(primary.root), "-p", str(primary.port), "-U", primary.user),
            *("-D", str(standby.datadir), "-R", "-X", "stream", "-c", "fast", "--no-sync"),
        )
        options = " ".join(
            [f"-p {standby.port} -k {standby.root} -c listen_addresses={standby.host}"]
            + [f"-c {name}={value}" for name, value in _settings_to_match(primary)]
        )
        _as_server_account(
            standby,
            "pg_ctl",
            *("-D", str(standby.datadir), "-o", options, "-l", str(standby.root / "log")),
            *("-w", "-t", "60", "start"),
        )
        yield standby
    finally:
        standby.stop()


def _settings_to_match(primary: EmbeddedPostgres) -> list[tuple[str, str]]:
    """A hot standby refuses to start with fewer connection slots than its primary."""
    engine = sa.create_engine(primary.url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT name, setting FROM pg_settings WHERE name IN"
            " ('max_connections', 'fsync', 'max_worker_processes', 'max_wal_senders')"
        ).all()
    engine.dispose()
    return [(name, setting) for name, setting in rows]


def _caught_up(primary: sa.Engine, standby: sa.Engine) -> Callable[[], bool]:
    with primary.connect() as conn:
        lsn = conn.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar()

    def replayed() -> bool:
        with standby.connect() as conn:
            return bool(
                conn.execute(
                    sa.text("SELECT pg_last_wal_replay_lsn() >= CAST(:l AS pg_lsn)"), {"l": lsn}
                ).scalar()
            )

    return replayed


def test_read_only_database_and_standby_are_read_only_transaction_on_every_driver(
    pg: EmbeddedPostgres, db_url: str, engine: sa.Engine
) -> None:
    attempt = _running_job(engine)
    dbname = sa.make_url(db_url).database
    with engine.begin() as conn:
        conn.exec_driver_sql(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    before = fingerprint(engine)
    with _standby(pg) as standby:
        standby_url = sa.make_url(standby.database_url(dbname or ""))
        standby_engine = sa.create_engine(standby_url, poolclass=sa.NullPool)
        wait_for(_caught_up(engine, standby_engine), what="standby replay")
        assert fingerprint(standby_engine) == before
        for where, url in (("read-only database", sa.make_url(db_url)), ("standby", standby_url)):
            for driver in DRIVERS:
                # Twice on one pool: the second checkout pings, and the ping passes.
                exc = refusal(driver, url, attempt, times=2, pool_pre_ping=True)
                assert isinstance(exc, ReadOnlyTransaction), (where, driver, exc)
                assert isinstance(exc, DatabaseError)
                assert exc.sqlstate == "25006"
        assert fingerprint(standby_engine) == before
        standby_engine.dispose()
        assert fingerprint(engine) == before

        # A multi-host URL asking for a writable session skips the standby (libpq, asyncpg);
        # asking for one on the standby alone finds none: 08001.
        with engine.begin() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        hosts = [f"127.0.0.1:{standby.port}", f"127.0.0.1:{pg.port}"]
        query = {"host": hosts, "target_session_attrs": "read-write"}
        both = standby_url.set(host=None, port=None, query=query)
        alone = standby_url.set(query={"target_session_attrs": "read-write"})
        for driver in ("psycopg", "psycopg-async", "psycopg2", "asyncpg"):
            exc = refusal(driver, alone, attempt)
            assert (type(exc), getattr(exc, "sqlstate", None)) == (DatabaseError, CANNOT_CONNECT)
        for driver in DRIVERS:
            if driver == "pg8000":  # one host per URL, no target_session_attrs
                continue
            job = attempt if driver == "psycopg" else _running_job(engine)
            (outcome,) = reschedule(driver, both, [job])
            assert isinstance(outcome, Rescheduled), (driver, outcome)
            with engine.connect() as conn:
                state = conn.execute(
                    sa.text("SELECT state FROM awa.scheduled_jobs WHERE id = :i"), {"i": job.job_id}
                ).scalar()
            assert state == "scheduled", driver
