"""The driver matrix: psycopg2, pg8000 (sync), asyncpg and psycopg async do what psycopg 3 does.

psycopg 3 (sync) runs the whole suite; each other driver runs a smaller matrix that still reaches
every outcome and every exception type, on the Alembic fixture and on an ``awa migrate`` cluster:

* one scripted walk (:func:`walk`) through decision-table rows 1-10, the batch API, repeats
  and guard misses, bad input the database judges, and JSON that drivers are known to treat
  differently. It runs on a clone of one seeded database per driver and once with psycopg 3 on
  another clone; the outcomes, the errors (type, SQLSTATE, constraint), the statements sent,
  the log records and every row of every table must be the same. The only values masked are
  those no two databases can share: each transaction's ``now()`` and the wall clock
  (``clock_timestamp()``, the worker clock in the lifecycle error), which become a marker or an
  offset from that transaction's ``now()``, and the phase rows the test's own storage
  transition writes at its own moment;
* the transaction forms (Engine, Connection: the caller's rollback and commit, the savepoint
  that keeps the caller's transaction usable, the canonical conflict that aborts it), the
  AUTOCOMMIT refusal and the canonical statement budget; a raw driver connection, refused;
* faults: lock timeout (55P03), cancel (57014), serialization failure (40001) and a connection
  killed under the call (:data:`awa_sa.core.errors.CONNECTION_LOST`), psycopg 3 included.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from conftest import Cluster, _janitor, cloned
from jobs import (
    CANONICAL_TABLES,
    QS_TABLES,
    advance_all,
    canonical_state,
    duplicate_mask,
    insert_holder,
    insert_job,
    snapshot,
)
from racing import fingerprint, held, in_thread, wait_for, wait_until_blocked
from recording import Sent, recording
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.util import greenlet_spawn

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import (
    Attempt,
    AwaSAError,
    CancelledDuplicate,
    DatabaseError,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    UniqueConflict,
    ValidationError,
)
from awa_sa.core.errors import CONNECTION_LOST
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

T = TypeVar("T")

DRIVERS = ("psycopg2", "pg8000", "asyncpg", "psycopg-async")
"""Every supported driver but psycopg 3 sync, which the rest of the suite runs on."""

KINDS = ("real",)
"""The walk's clusters: the real one alone, as for the ``cluster`` fixture (tests/conftest.py says
why the fixture's run proved nothing more)."""


# -- one driver behind one interface --------------------------------------------------------


class Face:
    """One driver's binds on one database: the reschedule calls, sync or async, made alike."""

    def __init__(self, driver: str, url: str) -> None:
        self.driver = driver
        self.is_async = driver in ("asyncpg", "psycopg-async")
        name = "psycopg" if driver == "psycopg-async" else driver
        target = sa.make_url(url).set(drivername=f"postgresql+{name}")
        self.async_engine: AsyncEngine | None = None
        if self.is_async:
            self._loop = asyncio.Runner()
            self.async_engine = create_async_engine(target)
            self.engine = self.async_engine.sync_engine  # for events; never called directly
        else:
            self.engine = sa.create_engine(target)
        event.listen(self.engine, "connect", _remember_pid)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def bind(self, **options: Any) -> Any:
        """The Engine form's bind (an ``AsyncEngine`` for async drivers)."""
        engine = self.async_engine or self.engine
        return engine.execution_options(**options) if options else engine

    def call(self, job_id: int, lease: int, kind: Kind, bind: Any = None, **kw: Any) -> Outcome:
        bind = self.bind() if bind is None else bind
        if self.is_async:
            return self.run(awa_async.reschedule_canonical_attempt(bind, job_id, lease, kind, **kw))
        return awa_sa.reschedule_canonical_attempt(bind, job_id, lease, kind, **kw)

    def calls(self, attempts: list[Attempt], bind: Any = None) -> list[Outcome]:
        bind = self.bind() if bind is None else bind
        if self.is_async:
            return self.run(awa_async.reschedule_canonical_attempts(bind, attempts))
        return awa_sa.reschedule_canonical_attempts(bind, attempts)

    @contextmanager
    def transaction(self, **options: Any) -> Iterator[Tx]:
        """The caller's own transaction (Connection form): committed unless rolled back."""
        if self.async_engine is not None:
            aconn = self.async_engine.connect()
            self.run(aconn.start())
            if options:
                self.run(aconn.execution_options(**options))
            atx = aconn.begin()
            self.run(atx.start())
            tx = Tx(self, aconn, lambda: self.run(atx.commit()), lambda: self.run(atx.rollback()))
            try:
                yield tx
                tx.end(commit=True)
            finally:
                tx.end(commit=False)
                self.run(aconn.close())
            return
        with self.engine.connect() as conn:
            if options:
                conn.execution_options(**options)
            stx = conn.begin()
            tx = Tx(self, conn, stx.commit, stx.rollback)
            try:
                yield tx
                tx.end(commit=True)
            finally:
                tx.end(commit=False)

    def dispose(self) -> None:
        if self.async_engine is not None:
            self.run(self.async_engine.dispose())
            self._loop.close()
        else:
            self.engine.dispose()


def _remember_pid(dbapi_conn: Any, record: Any) -> None:
    """Each connection's backend pid, so a fault can kill exactly the connection in use."""
    cursor = dbapi_conn.cursor()
    cursor.execute("SELECT pg_backend_pid()")
    record.info["pid"] = cursor.fetchone()[0]
    cursor.close()
    dbapi_conn.rollback()


@dataclass
class Tx:
    """A caller's open transaction on a :class:`Face`; calls here take the Connection form."""

    face: Face
    conn: Any
    _commit: Callable[[], None]
    _rollback: Callable[[], None]
    done: bool = False

    def call(self, job_id: int, lease: int, kind: Kind, **kw: Any) -> Outcome:
        return self.face.call(job_id, lease, kind, bind=self.conn, **kw)

    def calls(self, attempts: list[Attempt]) -> list[Outcome]:
        return self.face.calls(attempts, bind=self.conn)

    def execute(self, sql: str) -> None:
        if isinstance(self.conn, AsyncConnection):
            self.face.run(self.conn.execute(sa.text(sql)))
        else:
            self.conn.execute(sa.text(sql))

    def scalar(self, sql: str) -> Any:
        if isinstance(self.conn, AsyncConnection):
            return self.face.run(self.conn.scalar(sa.text(sql)))
        return self.conn.scalar(sa.text(sql))

    def end(self, commit: bool) -> None:
        if not self.done:
            self.done = True
            (self._commit if commit else self._rollback)()

    def rollback(self) -> None:
        self.end(commit=False)


# -- the seeded database and the walk -------------------------------------------------------

JSON_ARGS = (
    '{"text": "naïve \u2013 日本語 ☃", "big": 12345678901234567890, "huge": 1e400,'
    ' "pi": 3.14159265358979323846264338327950288419716939937510,'
    ' "nested": [[1, [2, [3, [[]]]]], {"a": [{"b": null}]}], "☃": {"☃☃": "\\u2603"}}'
)
JSON_METADATA = '{"☃ key": ["ünïcödé", -98765432109876543210], "tiny": 1e-400, "x": [[[]]]}'
JSON_ERRORS = ['{"error": "échec ☃", "n": 123456789012345678901, "d": 0.10000000000000000001}']
JSON_PROGRESS = '{"pct": 1.000000000000000000001, "☃": [1e400, -1e400]}'
ERROR_INPUT = {"message": "délai dépassé ☃", "big": 12345678901234567890, "☃": [[1, [2]], []]}
PROGRESS_INPUT = {"☃ page": [1, [2, [3]]], "n": 98765432109876543210, "f": 0.1, "s": "日本"}
HOSTILE: dict[str, Any] = {
    "args": JSON_ARGS,
    "metadata": JSON_METADATA,
    "errors": JSON_ERRORS,
    "progress": JSON_PROGRESS,
    "tags": ["☃", "tag with space"],
}
DELAYS = (30.5, 45.25, 12.5, 7.75)
"""Every delay the walk asks for: a written ``run_at`` is one of these after a ``now()``."""
BACKOFF_CAP = 86_400.0
"""Backoff jobs run at attempt 20, where ``awa.backoff_duration`` is exactly the 24 h cap."""


def seed(conn: sa.Connection) -> dict[str, int]:
    """Running attempts for every row of the decision table; the walk's names for them."""
    advance_all(conn)
    jobs: dict[str, int] = {}
    # Canonical routing: rows 1-4, a backoff, a batch, and an overflow the database refuses.
    jobs["c_stale"] = insert_job(conn, run_lease=3)
    jobs["c_plain"] = insert_job(conn, **HOSTILE)
    jobs["c_claim"] = insert_job(conn, unique_key=b"c-claim", unique_states="11111000")
    jobs["c_backoff"] = insert_job(conn, attempt=20, max_attempts=30)
    jobs["c_b1"] = insert_job(conn, queue="q1")
    jobs["c_b2"] = insert_job(conn, kind="other", unique_key=b"c-b2", unique_states="11001000")
    insert_holder(conn, b"c-held", "11000000")
    jobs["c_conflict"] = insert_job(conn, unique_key=b"c-held", unique_states="11000000")
    jobs["c_overflow"] = insert_job(conn, attempt=1024, max_attempts=1000)
    # Queue-storage routing: rows 5-10, a batch, and bad input.
    jobs["q_stale"] = insert_job(conn, run_lease=3)
    jobs["q_callback"] = insert_job(conn, callbacks=["callback_id", "callback_on_fail"])
    jobs["q_plain"] = insert_job(conn, **HOSTILE)
    jobs["q_claim"] = insert_job(conn, unique_key=b"q-claim", unique_states="11111000")
    for name, cancelled in (("q_dup", False), ("q_dup_cc", True)):
        key = name.encode()
        insert_holder(conn, key)
        mask = duplicate_mask(Snooze(1), claims_cancelled=cancelled)
        jobs[name] = insert_job(conn, unique_key=key, unique_states=mask, metadata='{"m": 1}')
    jobs["q_b1"] = insert_job(conn, attempt=20, max_attempts=30, tags=["t"])
    jobs["q_b2"] = insert_job(conn, queue="q2", unique_key=b"q-b2", unique_states="11001000")
    jobs["q_b3"] = insert_job(conn, unique_key=b"q-b3", unique_states="11001000")
    jobs["q_meta"] = insert_job(conn, metadata="[1, 2]")
    jobs["q_overflow"] = insert_job(conn, attempt=1024, max_attempts=1000)
    return jobs


@dataclass
class Walk:
    """Everything a walk returned, sent and left behind, with clock values made comparable."""

    results: list[Any] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    records: list[tuple[Any, ...]] = field(default_factory=list)
    nows: list[datetime] = field(default_factory=list)
    tables: dict[str, Any] = field(default_factory=dict)


def _result(outcome_or_error: Any, now: datetime) -> Any:
    """An outcome with run_at as an offset from its transaction's now(), or an error's identity."""
    value = outcome_or_error
    if isinstance(value, Rescheduled | Migrated):
        return (type(value).__name__, value.job_id, value.attempt, value.run_at - now)
    if isinstance(value, AwaSAError):
        return (
            type(value).__name__,
            getattr(value, "sqlstate", None),
            getattr(value, "constraint", None),
        )
    return repr(value)


@contextmanager
def _recording(face: Face, walk: Walk) -> Iterator[None]:
    """The first word of every statement sent (and BEGIN/COMMIT/ROLLBACK), and the log records."""

    class Records(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # The flow's `extra=` fields: attributes the LogRecord type cannot declare.
            fields = ("awa_job_id", "awa_kind", "awa_routing", "awa_outcome")
            walk.records.append(tuple(getattr(record, name) for name in fields))

    logger, handler = logging.getLogger("awa_sa"), Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with recording(face.engine) as sent:
            yield
        walk.sent += sent
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _in_transaction(face: Face, walk: Walk, steps: Callable[[Tx], list[Any]]) -> None:
    """*steps* in one caller transaction; committed, or rolled back after the first error."""
    with face.transaction() as tx:
        now = tx.scalar("SELECT now()")
        walk.nows.append(now)
        try:
            results = steps(tx)
        except AwaSAError as exc:
            tx.rollback()
            results = [exc]
        walk.results += [_result(r, now) for r in results]


def walk(face: Face, cluster: Cluster, jobs: dict[str, int]) -> Walk:
    """The same calls in the same order on any driver; read back through psycopg 3."""
    out = Walk()
    j = jobs
    with _recording(face, out):
        _in_transaction(
            face,
            out,
            lambda tx: [
                tx.call(j["c_stale"], 1, Snooze(30.5)),  # row 1
                # Row 2, with the JSON drivers treat differently in every JSON column.
                tx.call(j["c_plain"], 1, Snooze(30.5), error=ERROR_INPUT, progress=PROGRESS_INPUT),
                tx.call(j["c_claim"], 1, RetryAfter(45.25), error={"e": 1}),  # row 3
                tx.call(j["c_backoff"], 1, RetryBackoff(), progress=None),
                *tx.calls(
                    [
                        Attempt(j["c_b1"], 1, Snooze(12.5), progress=[1]),
                        Attempt(j["c_b2"], 1, RetryAfter(7.75), error="e"),
                        Attempt(j["c_b1"], 1, Snooze(12.5)),  # a repeat: Stale
                        Attempt(10**12, 1, RetryBackoff()),  # no such job: Stale
                    ]
                ),
            ],
        )
        # Row 4, then an overflow: errors, each in its own transaction, nothing kept.
        _in_transaction(face, out, lambda tx: [tx.call(j["c_conflict"], 1, Snooze(30.5))])
        _in_transaction(face, out, lambda tx: [tx.call(j["c_overflow"], 1, RetryBackoff())])
        cluster.set_phase("mixed_transition", "awa_qs")
        _in_transaction(
            face,
            out,
            lambda tx: [
                tx.call(j["q_stale"], 1, RetryAfter(45.25)),  # row 5
                tx.call(j["q_callback"], 1, Snooze(12.5)),  # row 6
                # Row 7, the hostile JSON again, now composed into the queue-storage payload.
                tx.call(j["q_plain"], 1, Snooze(30.5), error=ERROR_INPUT, progress=PROGRESS_INPUT),
                tx.call(j["q_claim"], 1, RetryAfter(45.25)),  # row 8
                tx.call(j["q_dup"], 1, Snooze(30.5), error={"dup": True}),  # row 9
                tx.call(j["q_dup_cc"], 1, Snooze(7.75)),  # row 10
                *tx.calls(
                    [
                        Attempt(j["q_b1"], 1, RetryBackoff(), error=[1, 2]),
                        Attempt(j["q_stale"], 2, Snooze(1)),  # wrong lease: Stale
                        Attempt(j["q_b2"], 1, RetryAfter(7.75), progress={"p": 1}),
                        Attempt(j["q_b3"], 1, RetryAfter(45.25)),  # two claims in one statement
                    ]
                ),
            ],
        )
        _in_transaction(face, out, lambda tx: [tx.call(j["q_meta"], 1, Snooze(12.5))])
        _in_transaction(face, out, lambda tx: [tx.call(j["q_overflow"], 1, RetryBackoff())])
    with cluster.engine.connect() as conn:
        out.tables = tables(conn, out.nows)
    return out


# -- comparing rows written at different moments ---------------------------------------------

PHASE_TABLES = {"awa.storage_transition_state", "awa.runtime_storage_backends"}
"""Written by the test's own storage transition, at its own moment on each database."""
WALL_CLOCK = {("done_entries", "finalized_at"), ("queue_terminal_count_deltas", "recorded_at")}
"""``clock_timestamp()`` columns: later than the transaction's now(), by no fixed amount."""
TIME_KEYS = {"run_at", "finalized_at", "touched_at", "recorded_at", "entered_at", "updated_at"}


def _when(table: str, key: str, value: str, nows: list[datetime]) -> str:
    """A timestamp the walk wrote, as ``now[i]`` or ``now[i] + delay``; others unchanged."""
    if table in PHASE_TABLES:
        return "(the phase change's clock)"
    at = datetime.fromisoformat(value)
    for index, now in enumerate(nows):
        offset = (at - now).total_seconds()
        if offset == 0 or offset in DELAYS or offset == BACKOFF_CAP:
            return f"now[{index}] + {offset}s"
    if (table.split(".")[1], key) in WALL_CLOCK:
        index = max(i for i, now in enumerate(nows) if now <= at)
        return f"(the wall clock in transaction {index})"
    return value


def _normal_row(table: str, text: str, nows: list[datetime]) -> str:
    # Decimal keeps 1e400 and long decimals exactly, and int keeps 20-digit integers.
    row = json.loads(text, parse_float=Decimal)
    for key, value in row.items():
        if key in TIME_KEYS and isinstance(value, str):
            row[key] = _when(table, key, value, nows)
    if table.endswith(".done_entries") and row.get("payload"):
        for error in row["payload"].get("errors", []):
            if isinstance(error, dict) and error.get("terminal") is True:
                error["at"] = "(the worker clock)"
    return json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)


def tables(conn: sa.Connection, nows: list[datetime]) -> dict[str, Any]:
    """Every row of every table the operation may touch, and every sequence, normalised.

    The dirty marks are read from whichever tables the cluster has: 0.6.9's ``*_marks``, or the
    keyed tables of awa-cli 0.6.6 (docs/contract.md#awa-cli-066), where CI walks too.
    """
    names = [*CANONICAL_TABLES, *KEYED_MARKS]
    names += [f"{s}.{t}" for s in ("awa", "awa_qs") for t in QS_TABLES]
    out: dict[str, Any] = {}
    for name in names:
        if conn.execute(sa.select(sa.func.to_regclass(name))).scalar() is None:
            continue
        texts = conn.execute(sa.text(f"SELECT to_jsonb(t)::text FROM {name} t")).scalars()
        out[name] = sorted(_normal_row(name, text, nows) for text in texts)
    out["sequences"] = conn.execute(
        sa.text(
            "SELECT schemaname, sequencename, last_value FROM pg_sequences"
            " WHERE schemaname IN ('awa', 'awa_qs') ORDER BY 1, 2"
        )
    ).all()
    return out


KEYED_MARKS = ("awa.admin_dirty_queues", "awa.admin_dirty_kinds")
"""Written by awa-cli 0.6.6's triggers; left in place, unread, by later releases' patch."""


# -- fixtures: one seeded database per cluster kind, psycopg 3's walk on it once ------------


@dataclass
class Seeded:
    """A seeded database per cluster kind (a template for clones) and psycopg 3's walk on it."""

    pg: EmbeddedPostgres
    request: pytest.FixtureRequest
    databases: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)
    references: dict[str, Walk] = field(default_factory=dict)
    dropped: ExitStack = field(default_factory=ExitStack)

    def database(self, kind: str) -> tuple[str, dict[str, int]]:
        if kind not in self.databases:
            template = self.request.getfixturevalue(f"{kind}_template")
            seeded = seeded_database(self.pg, template, f"drivers_{kind}")
            self.databases[kind] = self.dropped.enter_context(seeded)
        return self.databases[kind]


@contextmanager
def seeded_database(
    pg: EmbeddedPostgres, template: str, name: str
) -> Iterator[tuple[str, dict[str, int]]]:
    """Database *name*, cloned from *template* and seeded for the walk; dropped after."""
    janitor = _janitor(pg, name, template=template)
    janitor.init()
    try:
        engine = sa.create_engine(_url(pg, name), poolclass=sa.NullPool)
        with engine.begin() as conn:
            jobs = seed(conn)
        engine.dispose()
        yield name, jobs
    finally:
        janitor.drop()


def _url(pg: EmbeddedPostgres, dbname: str) -> str:
    return pg.database_url(dbname)


@pytest.fixture(scope="session")
def seeded(pg: EmbeddedPostgres, request: pytest.FixtureRequest) -> Iterator[Seeded]:
    store = Seeded(pg, request)
    with store.dropped:
        yield store


@contextmanager
def _cloned(
    pg: EmbeddedPostgres, clone_database: Callable[[str], str], kind: str, source: str
) -> Iterator[Cluster]:
    url = clone_database(source)
    observer = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        yield Cluster(kind, pg, url, observer)
    finally:
        observer.dispose()


def _walked(
    driver: str, kind: str, seeded: Seeded, clone_database: Callable[[str], str]
) -> tuple[Walk, str]:
    """The walk of *driver* on a fresh clone of *kind*'s seeded database, and the clone's url."""
    source, jobs = seeded.database(kind)
    with _cloned(seeded.pg, clone_database, kind, source) as cluster:
        face = Face(driver, cluster.url)
        try:
            return walk(face, cluster, jobs), cluster.url
        finally:
            face.dispose()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("driver", DRIVERS)
def test_walk_matches_psycopg(
    driver: str, kind: str, seeded: Seeded, clone_database: Callable[[str], str]
) -> None:
    """Same outcomes, errors, statements, log records and rows as psycopg 3 on the same seed."""
    if kind not in seeded.references:
        seeded.references[kind] = _walked("psycopg", kind, seeded, clone_database)[0]
    expected = seeded.references[kind]
    got, url = _walked(driver, kind, seeded, clone_database)

    assert got.results == expected.results
    assert [_name(r) for r in got.results] == [
        *("Stale", "Rescheduled", "Rescheduled", "Rescheduled"),  # rows 1-3, backoff
        *("Rescheduled", "Rescheduled", "Stale", "Stale"),  # the batch
        *("UniqueConflict", "DatabaseError"),  # row 4, overflow
        *("Stale", "Rescheduled", "Migrated", "Migrated"),  # rows 5-8
        *("CancelledDuplicate", "CancelledDuplicate"),  # rows 9-10
        *("Migrated", "Stale", "Migrated", "Migrated"),  # the batch
        *("ValidationError", "DatabaseError"),  # non-object metadata, overflow
    ]
    assert got.results[8] == ("UniqueConflict", None, "idx_awa_jobs_unique")
    assert got.results[9][:2] == ("DatabaseError", "22003")
    assert got.sent == expected.sent
    assert len(got.records) == len(got.results)  # one DEBUG record per call
    assert got.records == expected.records
    for name, rows in expected.tables.items():
        assert got.tables[name] == rows, name
    jobs = seeded.database(kind)[1]
    _check_json(url, jobs["c_plain"], _CANONICAL_JSON)
    _check_json(url, got.results[12][1], _QUEUE_STORAGE_JSON)


def _name(result: Any) -> str:
    return str(result[0]) if isinstance(result, tuple) else str(result).split("(", 1)[0]


_EXPECTED_JSON = """
SELECT CAST(:args AS jsonb)::text AS args, CAST(:metadata AS jsonb)::text AS metadata,
       to_jsonb(ARRAY[CAST(:e1 AS jsonb), CAST(:e2 AS jsonb)])::text AS errors,
       CAST(:progress AS jsonb)::text AS progress, to_jsonb(CAST(:tags AS text[]))::text AS tags
"""
_CANONICAL_JSON = """
SELECT args::text, metadata::text, to_jsonb(errors)::text AS errors, progress::text,
       to_jsonb(tags)::text AS tags FROM awa.scheduled_jobs WHERE id = :i
"""
_QUEUE_STORAGE_JSON = """
SELECT args::text, (payload->'metadata')::text AS metadata, (payload->'errors')::text AS errors,
       (payload->'progress')::text AS progress, (payload->'tags')::text AS tags
FROM awa_qs.deferred_jobs WHERE job_id = :i
"""


def _check_json(url: str, job_id: int, query: str) -> None:
    """The hostile JSON arrived unchanged: the successor's text is PostgreSQL's for the input."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        expected = conn.execute(
            sa.text(_EXPECTED_JSON),
            {
                "args": JSON_ARGS,
                "metadata": JSON_METADATA,
                "e1": JSON_ERRORS[0],
                "e2": json.dumps(ERROR_INPUT),
                "progress": json.dumps(PROGRESS_INPUT),
                "tags": HOSTILE["tags"],
            },
        ).one()
        got = conn.execute(sa.text(query), {"i": job_id}).one()
    engine.dispose()
    assert got._asdict() == expected._asdict()


# -- the transaction forms, the AUTOCOMMIT refusal and the statement budget -----------------

OWN_WRITE = "INSERT INTO awa.admin_dirty_kind_marks (kind) VALUES ('caller-write')"


@contextmanager
def _face(driver: str, url: str) -> Iterator[Face]:
    face = Face(driver, url)
    try:
        yield face
    finally:
        face.dispose()


def _own_writes(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                sa.text(
                    "SELECT count(*) FROM awa.admin_dirty_kind_marks WHERE kind = 'caller-write'"
                )
            )
        )


def _snapshot(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return snapshot(conn)


def _sent(face: Face) -> AbstractContextManager[list[str]]:
    return recording(face.engine)


@pytest.mark.parametrize("driver", DRIVERS)
def test_forms_autocommit_and_budget(driver: str, cluster: Cluster) -> None:
    engine = cluster.engine
    with engine.begin() as conn:
        jobs = [insert_job(conn) for _ in range(8)]
        insert_holder(conn, b"held", "11000000")
        conflict = insert_job(conn, unique_key=b"held", unique_states="11000000")
        bad_meta = insert_job(conn, metadata="[1]")
        overflow = insert_job(conn, attempt=1024, max_attempts=1000)
    with _face(driver, cluster.url) as face:
        # The Engine form: one statement in autocommit, batch or not. BEGIN and ROLLBACK are
        # SQLAlchemy's events around it; it committed by itself. pg8000 sends a statement in
        # several exchanges, which a transaction pooler could split: its statement runs in BEGIN.
        alone = ["BEGIN", "WITH", "COMMIT" if driver == "pg8000" else "ROLLBACK"]
        with _sent(face) as sent:
            assert isinstance(face.call(jobs[0], 1, Snooze(5)), Rescheduled)
        assert sent == alone
        assert canonical_state(engine, jobs[0]) is None
        with _sent(face) as sent:
            outcomes = face.calls([Attempt(j, 1, RetryAfter(1)) for j in jobs[1:3]])
        assert sent == alone
        assert [type(o) for o in outcomes] == [Rescheduled, Rescheduled]

        # The Connection form: the caller's rollback takes the reschedule with it ...
        with face.transaction() as tx:
            tx.execute(OWN_WRITE)
            assert isinstance(tx.call(jobs[3], 1, Snooze(5)), Rescheduled)
            assert (
                canonical_state(engine, jobs[3]) == "running"
            )  # nothing committed behind its back
            tx.rollback()
        assert (canonical_state(engine, jobs[3]), _own_writes(engine)) == ("running", 0)
        # ... and its commit keeps both.
        with face.transaction() as tx:
            tx.execute(OWN_WRITE)
            assert isinstance(tx.call(jobs[3], 1, Snooze(5)), Rescheduled)
        assert (canonical_state(engine, jobs[3]), _own_writes(engine)) == (None, 1)

        # A canonical conflict aborts the caller's transaction, as in Awa.
        with face.transaction() as tx:
            tx.execute(OWN_WRITE)
            with pytest.raises(UniqueConflict) as conflicted:
                tx.call(conflict, 1, Snooze(5))
            assert conflicted.value.constraint == "idx_awa_jobs_unique"
            with pytest.raises(sa.exc.DBAPIError):
                tx.scalar("SELECT 1")
            tx.rollback()
        assert (canonical_state(engine, conflict), _own_writes(engine)) == ("running", 1)

        # In queue storage, an error after the take is undone by the savepoint alone.
        cluster.set_phase("mixed_transition", "awa_qs")
        before = _snapshot(engine)
        with face.transaction() as tx:
            tx.execute(OWN_WRITE)
            with pytest.raises(ValidationError, match="metadata"):
                tx.call(bad_meta, 1, Snooze(5))
            with pytest.raises(DatabaseError) as overflowed:
                tx.call(overflow, 1, RetryBackoff())
            assert overflowed.value.sqlstate == "22003"
            tx.execute(OWN_WRITE)  # still usable
        after = _snapshot(engine)
        assert _own_writes(engine) == 3
        after["awa.admin_dirty_kind_marks"] = before["awa.admin_dirty_kind_marks"]
        assert after == before
        with face.transaction() as tx:
            assert isinstance(tx.call(jobs[4], 1, Snooze(5)), Migrated)
        assert isinstance(face.call(jobs[5], 1, Snooze(5)), Migrated)

        # AUTOCOMMIT is refused in both forms, before anything is written.
        before = _snapshot(engine)
        autocommit = face.bind(isolation_level="AUTOCOMMIT")
        with pytest.raises(ValidationError, match="AUTOCOMMIT"):
            face.call(jobs[6], 1, Snooze(1), bind=autocommit)
        with (
            face.transaction(isolation_level="AUTOCOMMIT") as tx,
            pytest.raises(ValidationError, match="AUTOCOMMIT"),
        ):
            tx.call(jobs[6], 1, Snooze(1))
        assert _snapshot(engine) == before


@pytest.mark.parametrize("driver", ["psycopg", *DRIVERS])
def test_a_raw_connection_is_refused_and_left_alone(driver: str, cluster: Cluster) -> None:
    """The pool's proxy of a driver connection and the driver's own are not binds: refused by
    type, before anything is sent, on every driver (tests/unit/test_validation.py has no server
    to make one)."""
    engine = cluster.engine
    with engine.begin() as conn:
        job = insert_job(conn)
    before = _snapshot(engine)
    with _face(driver, cluster.url) as face:
        if face.async_engine is not None:
            proxy = face.run(face.async_engine.raw_connection())
        else:
            proxy = face.engine.raw_connection()
        try:
            with recording(face.engine) as sent:
                for raw in (proxy, proxy.driver_connection):
                    with pytest.raises(
                        ValidationError, match=f"bind must .*, got {type(raw).__name__}"
                    ):
                        face.call(job, 1, Snooze(1), bind=raw)
            assert sent == []
        finally:
            if face.async_engine is not None:
                # Returned to an async pool, its reset must run in SQLAlchemy's greenlet.
                face.run(greenlet_spawn(proxy.close))
            else:
                proxy.close()
    assert _snapshot(engine) == before
    assert canonical_state(engine, job) == "running"


# -- faults: lock timeout, cancel, serialization failure, a killed connection ---------------


@dataclass
class _Killer:
    """Terminates the backend of the connection in use before or after its *at*-th statement."""

    observer: sa.Engine
    at: int
    when: str
    killed: bool = False

    def act(self, sent: Sent) -> None:
        """The recorder's hook: kills at the statement and moment asked for."""
        if (sent.index, sent.when) == (self.at, self.when):
            self.kill(sent.conn)

    def kill(self, conn: sa.Connection) -> None:
        pid = conn.info["pid"]
        gone = sa.text("SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = :p)")
        with self.observer.connect() as killer:
            killer.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})

            def exited() -> bool:
                done = bool(killer.execute(gone, {"p": pid}).scalar())
                killer.rollback()  # activity statistics are a per-transaction snapshot
                return done

            wait_for(exited, what="backend exit")
        self.killed = True


@contextmanager
def _killing(face: Face, observer: sa.Engine, at: int, when: str) -> Iterator[_Killer]:
    killer = _Killer(observer, at, when)
    with recording(face.engine, events=(), act=killer.act):
        yield killer
    assert killer.killed


@pytest.mark.parametrize("driver", ["psycopg", *DRIVERS])
def test_faults_map_to_the_same_errors(driver: str, cluster: Cluster) -> None:
    engine = cluster.engine
    with engine.begin() as conn:
        job = insert_job(conn)
    with _face(driver, cluster.url) as face:
        face.call(10**12, 1, Snooze(1))  # the pool holds one connection: the one to kill
        before = _snapshot(engine)
        with held(engine) as transition:
            transition.execute(
                "SELECT 1 FROM awa.storage_transition_state WHERE singleton FOR UPDATE"
            )
            # Lock timeout (55P03): the caller's transaction is aborted, nothing is written.
            with face.transaction() as tx:
                tx.execute("SET LOCAL lock_timeout = '100ms'")
                with pytest.raises(DatabaseError) as timed_out:
                    tx.call(job, 1, Snooze(1))
                tx.rollback()
            assert timed_out.value.sqlstate == "55P03"
            # Cancel (57014) while the call waits for the same lock.
            waiting = in_thread(lambda: face.call(job, 1, Snooze(1)))
            (waiter,) = wait_until_blocked(engine, transition.pid, pending=[waiting])
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT pg_cancel_backend(:p)"), {"p": waiter.pid})
            cancelled = waiting.exception(timeout=20)
        assert isinstance(cancelled, DatabaseError)
        assert cancelled.sqlstate == "57014"
        assert _snapshot(engine) == before

        # Serialization failure (40001): the attempt changed after the caller's snapshot.
        with face.transaction(isolation_level="REPEATABLE READ") as tx:
            tx.scalar("SELECT count(*) FROM awa.jobs_hot")
            with engine.begin() as other:
                other.execute(
                    sa.text("UPDATE awa.jobs_hot SET heartbeat_at = now() WHERE id = :i"),
                    {"i": job},
                )
            before = _snapshot(engine)
            with pytest.raises(DatabaseError) as conflicted:
                tx.call(job, 1, Snooze(1))
            tx.rollback()
        assert conflicted.value.sqlstate == "40001"
        assert _snapshot(engine) == before

        # A connection killed before the one statement: nothing written.
        with _killing(face, engine, 0, "before"), pytest.raises(DatabaseError) as lost:
            face.call(job, 1, Snooze(1))
        assert lost.value.sqlstate == CONNECTION_LOST, lost.value
        assert _snapshot(engine) == before
        # In a caller's transaction, killed after it: the caller's COMMIT finds it gone (pg8000
        # sometimes lets the socket's own OSError out of that COMMIT, which is not ours).
        with (
            _killing(face, engine, 0, "after"),
            pytest.raises((sa.exc.DBAPIError, OSError)),
            face.transaction() as tx,
        ):
            assert isinstance(tx.call(job, 1, Snooze(1)), Rescheduled)
        assert _snapshot(engine) == before
        # The Engine form, killed after it: it committed by itself and says what it did. On
        # pg8000 it runs inside BEGIN, so the kill loses the COMMIT and the write with it.
        if driver == "pg8000":
            # The kill above may have pooled a dead connection (pg8000's OSError out of the
            # caller's COMMIT is no disconnect to SQLAlchemy): start from a fresh one.
            face.engine.dispose()
            with _killing(face, engine, 0, "after"), pytest.raises(DatabaseError) as lost:
                face.call(job, 1, Snooze(1))
            assert lost.value.sqlstate == CONNECTION_LOST, lost.value
            assert _snapshot(engine) == before
            assert isinstance(face.call(job, 1, Snooze(1)), Rescheduled)
        else:
            with _killing(face, engine, 0, "after"):
                assert isinstance(face.call(job, 1, Snooze(1)), Rescheduled)
        assert canonical_state(engine, job) is None
        # That connection went back to the pool dead, as after any COMMIT; its next use finds
        # out and drops it. Then the pool has recovered.
        probe: list[DatabaseError] = []
        try:
            face.call(10**12, 1, Snooze(1))
        except DatabaseError as exc:
            probe.append(exc)
        assert all(exc.sqlstate == CONNECTION_LOST for exc in probe), probe
        with engine.begin() as conn:
            again = insert_job(conn)
        assert isinstance(face.call(again, 1, Snooze(1)), Rescheduled)


def _last_resort(engine: sa.Engine, *keys: bytes) -> list[int]:
    """The longest path: both savepoints lose the claim (deferred rows, cancelled row), then the
    last-resort insert. A job for each key, each with its holder, in one transaction."""
    with engine.begin() as conn:
        jobs = []
        for key in keys:
            insert_holder(conn, key)
            jobs.append(insert_job(conn, run_lease=4, unique_key=key, unique_states="11000010"))
        return jobs


# On the real cluster only: the boundaries are awa-sa's statements, the same on both kinds, and
# the fixture's routing functions are the real ones byte for byte (test_catalog_parity.py).
@pytest.fixture(scope="module")
def killed_cluster(
    request: pytest.FixtureRequest, pg: EmbeddedPostgres, awa_databases: Databases
) -> Iterator[Cluster]:
    """One real cluster in the mixed transition for every driver's kills: each driver's jobs
    are its own, and a killed call may change nothing, so a clone and the two ``awa storage``
    runs each would buy no isolation."""
    template = request.getfixturevalue(f"{request.param}_template")
    with cloned(pg, awa_databases, template) as url:
        engine = sa.create_engine(url)
        try:
            cluster = Cluster(request.param, pg, url, engine)
            cluster.set_phase("mixed_transition", "awa_qs")
            with engine.begin() as conn:
                advance_all(conn)
            yield cluster
        finally:
            engine.dispose()


@pytest.mark.parametrize("killed_cluster", ["real"], indirect=True)
@pytest.mark.parametrize("driver", DRIVERS)
def test_killed_at_every_statement_boundary(driver: str, killed_cluster: Cluster) -> None:
    """The connection dies before or after each statement of the longest path (Engine form):
    always ``DatabaseError(CONNECTION_LOST)``, nothing kept, and the pool recovers.
    """
    cluster = killed_cluster
    engine = cluster.engine
    own = driver.encode()  # the jobs' keys, apart from the other drivers' on the same cluster
    with _face(driver, cluster.url) as face:
        # Counted as the killer counts them: every statement, a ROLLBACK TO SAVEPOINT too, and
        # none of SQLAlchemy's transaction events (dropping those by name dropped the former,
        # and with them the last two statements' boundaries).
        with recording(face.engine, events=()) as statements:
            (job,) = _last_resort(engine, own + b" dry run")
            assert isinstance(face.call(job, 4, Snooze(1)), CancelledDuplicate)
        boundaries = [(at, when) for at in range(len(statements)) for when in ("before", "after")]
        assert len(boundaries) > 30
        # Every boundary's job made at once: as no killed call may change the database, what
        # one left is what the next one starts from, and a fingerprint each suffices.
        keys = (b"%s %d-%s" % (own, at, when.encode()) for at, when in boundaries)
        jobs = _last_resort(engine, *keys)
        failures = []
        before = fingerprint(engine)
        for (at, when), job in zip(boundaries, jobs, strict=True):
            try:
                with _killing(face, engine, at, when):
                    outcome = face.call(job, 4, Snooze(1))
                failures.append(f"{when} #{at}: no error, {outcome}")
            except DatabaseError as exc:
                if exc.sqlstate != CONNECTION_LOST:
                    failures.append(f"{when} #{at}: {exc!r}")
            after = fingerprint(engine)
            if after != before:
                failures.append(f"{when} #{at}: database changed")
            before = after
        assert not failures, "\n".join(failures)
        (job,) = _last_resort(engine, own + b" after")
        assert isinstance(face.call(job, 4, Snooze(1)), CancelledDuplicate)
