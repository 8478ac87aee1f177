"""Tools for forcing races instead of hoping for them.

A race test here never sleeps and hopes. One session takes a lock and keeps its transaction
open (:class:`HeldTransaction`); the contender runs in a thread (:func:`in_thread`); the test then
polls ``pg_stat_activity`` until the server itself says the contender is blocked by the holder
(:func:`wait_until_blocked`), and only then lets the holder commit or roll back. The order of
events is therefore fixed by PostgreSQL's lock manager, and so is the outcome.

Storage transitions come in two flavours with one interface (:class:`Transitions`):

* :class:`EmulatedTransitions` for the Alembic fixture, which omits Awa's ``storage_*``
  functions. Each method does what the real function does to the rows that matter
  (docs/architecture.md#racing-transitions): ``SELECT ... FOR UPDATE`` on the singleton first,
  then the same refusal checks (abort: queue storage must be empty; finalize: no canonical
  backlog), then the row changes of docs/architecture.md#phases, relative to the current epoch.
* :class:`RealTransitions` calls ``awa.storage_prepare/enter_mixed_transition/abort/finalize``
  on a database built by ``awa migrate``. ``enter_mixed_transition`` needs a live
  ``awa.runtime_instances`` row with the queue-storage target role
  (docs/architecture.md#real-cluster), and abort refuses while such a runtime is live, so the
  class manages that row.

Every method runs in the caller's open transaction and does not commit: the caller holds the
singleton lock for as long as it likes.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa

T = TypeVar("T")

DEFAULT_TIMEOUT = 120.0
"""Upper bound for any wait in a race test: a hang fails loudly instead of stalling the suite.

A wait ends as soon as its condition holds, so the bound costs nothing when the test passes; it
is generous because CI runs the suite on pytest-xdist workers beside other jobs, and a blocked
contender was seen to take over 20 s to reach its lock on 2 cores loaded twenty deep."""

QS_TABLES = (
    "deferred_jobs",
    "done_entries",
    "queue_terminal_count_deltas",
    "queue_lanes",
    "queue_enqueue_heads",
    "queue_claim_heads",
    "queue_ring_state",
    "ready_entries",
)
"""Every queue-storage relation the reschedule reads or writes (docs/contract.md#queue-storage)."""

CANONICAL_TABLES = (
    "jobs_hot",
    "scheduled_jobs",
    "job_unique_claims",
    "storage_transition_state",
    "runtime_storage_backends",
    "admin_dirty_queue_marks",
    "admin_dirty_kind_marks",
)


# --------------------------------------------------------------------------------------------
# Threads and blocking


def in_thread(fn: Callable[[], T], name: str = "racer") -> Future[T]:
    """Run *fn* in a daemon thread; the future carries its result or its exception."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def backend_pid(conn: sa.Connection) -> int:
    return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


@dataclass(frozen=True)
class Waiter:
    """A blocked session. ``row_of``: the table whose row it waits for (it holds that row's
    tuple lock while it waits), since ``query`` is cut at 1024 bytes by the server."""

    pid: int
    query: str
    wait_event: str | None
    row_of: str | None = None


def blocked_by(observer: sa.Engine, holder_pid: int) -> list[Waiter]:
    """Sessions of this database that the server reports as blocked by *holder_pid*."""
    with observer.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT a.pid, a.query, a.wait_event, (SELECT l.relation::regclass::text "
                "FROM pg_locks AS l WHERE l.pid = a.pid AND l.locktype = 'tuple' LIMIT 1) "
                "AS row_of FROM pg_stat_activity AS a "
                "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() "
                "AND :holder = ANY (pg_blocking_pids(a.pid)) ORDER BY a.backend_start"
            ),
            {"holder": holder_pid},
        ).all()
    return [Waiter(int(r.pid), str(r.query), r.wait_event, r.row_of) for r in rows]


def wait_until_blocked(
    observer: sa.Engine,
    holder_pid: int,
    *,
    count: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    pending: Iterable[Future[Any]] = (),
) -> list[Waiter]:
    """Poll until at least *count* sessions are blocked by *holder_pid*; return them.

    If one of the *pending* futures finishes first, the contender did not block at all: its
    result (or exception) is reported instead of waiting out the timeout.
    """
    pending = list(pending)
    deadline = time.monotonic() + timeout
    waiters: list[Waiter] = []
    while True:
        if len(blocked_by(observer, holder_pid)) >= count:
            # pg_stat_activity's row is a copy taken when the query first read it, while
            # pg_blocking_pids reads the lock table live, so that row may still show the
            # statement before the blocked one (BEGIN, say). Read again: the sessions were
            # blocked before this new snapshot and the holder has not let go, so now each
            # row shows the statement that waits.
            waiters = blocked_by(observer, holder_pid)
            if len(waiters) >= count:
                return waiters
        for fut in pending:
            if fut.done():
                raise AssertionError(
                    f"contender finished without blocking on pid {holder_pid}: "
                    f"{fut.exception() or fut.result()!r}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out: {len(waiters)}/{count} sessions blocked by pid {holder_pid}"
            )
        time.sleep(0.005)


def wait_for(
    predicate: Callable[[], bool], *, timeout: float = DEFAULT_TIMEOUT, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class HeldTransaction:
    """A connection with an open transaction, kept open until :meth:`commit`/:meth:`rollback`.

    ``lock_timeout`` (milliseconds) is set for the transaction when given, so a statement that
    would wait fails with 55P03 instead.
    """

    def __init__(self, engine: sa.Engine, *, lock_timeout_ms: int | None = None) -> None:
        self.conn = engine.connect()
        self.tx = self.conn.begin()
        self.pid = backend_pid(self.conn)
        if lock_timeout_ms is not None:
            self.conn.execute(sa.text(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}"))

    def execute(self, stmt: str, params: Mapping[str, Any] | None = None) -> sa.CursorResult[Any]:
        return self.conn.execute(sa.text(stmt), dict(params or {}))

    def commit(self) -> None:
        self.tx.commit()
        self.conn.close()

    def rollback(self) -> None:
        if self.tx.is_active:
            self.tx.rollback()
        self.conn.close()

    def __enter__(self) -> HeldTransaction:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.conn.closed:
            self.rollback()


@contextmanager
def held(engine: sa.Engine, *, lock_timeout_ms: int | None = None) -> Iterator[HeldTransaction]:
    with HeldTransaction(engine, lock_timeout_ms=lock_timeout_ms) as h:
        yield h


# --------------------------------------------------------------------------------------------
# Storage transitions, emulated (fixture) and real (awa migrate cluster)


def after_it_waits(
    engine: sa.Engine, transition: Callable[[sa.Connection], None], call: Callable[[], T]
) -> T:
    """Hold *transition* uncommitted, start *call*, see it wait for the singleton, commit.

    The waiter is known by the singleton's tuple lock it holds (``row_of``), not by its query
    text, which the server cuts at 1024 bytes. Returns what *call* returned.
    """
    with held(engine) as tx:
        transition(tx.conn)
        pending = in_thread(call)
        waiters = wait_until_blocked(engine, tx.pid, pending=[pending])
        assert waiters[0].row_of == "awa.storage_transition_state"
        tx.commit()
    return pending.result(timeout=DEFAULT_TIMEOUT)


class TransitionRefused(RuntimeError):
    """An emulated transition refused for the reason the real function would."""


class Transitions(Protocol):
    kind: str

    def prepare(self, conn: sa.Connection, schema: str) -> None: ...
    def enter_mixed(self, conn: sa.Connection) -> None: ...
    def abort(self, conn: sa.Connection) -> None: ...
    def finalize(self, conn: sa.Connection) -> None: ...


_LOCK_SINGLETON = sa.text(
    "SELECT state, transition_epoch, details, prepared_engine "
    "FROM awa.storage_transition_state WHERE singleton FOR UPDATE"
)


def _locked_singleton(conn: sa.Connection) -> sa.Row[Any]:
    row = conn.execute(_LOCK_SINGLETON).one_or_none()
    if row is None:
        raise TransitionRefused("storage transition state row is missing")
    return row


def _details_schema(details: Mapping[str, Any] | None, default: str = "awa") -> str:
    value = (details or {}).get("schema")
    return value if isinstance(value, str) and value.strip() else default


def queue_storage_rows(conn: sa.Connection, schema: str) -> int:
    """Rows in the queue-storage tables the fixture has (the emulated abort's emptiness check)."""
    total = 0
    for table in ("ready_entries", "deferred_jobs", "done_entries"):
        total += int(
            conn.execute(
                sa.text(f'SELECT count(*) FROM "{schema}".{table}')  # schema from our own code
            ).scalar_one()
        )
    return total


def canonical_backlog(conn: sa.Connection) -> int:
    """What ``awa.canonical_live_backlog()`` counts: live jobs_hot rows plus all scheduled."""
    return int(
        conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM awa.jobs_hot "
                "        WHERE state NOT IN ('completed', 'failed', 'cancelled'))"
                "     + (SELECT count(*) FROM awa.scheduled_jobs)"
            )
        ).scalar_one()
    )


class EmulatedTransitions:
    """What the real ``awa.storage_*`` functions do, on the fixture.

    See docs/architecture.md#racing-transitions.
    """

    kind = "fixture"

    def prepare(self, conn: sa.Connection, schema: str) -> None:
        row = _locked_singleton(conn)
        if row.state not in ("canonical", "prepared"):
            raise TransitionRefused(f"cannot prepare from {row.state}")
        conn.execute(
            sa.text(
                "UPDATE awa.storage_transition_state SET prepared_engine = 'queue_storage', "
                "state = 'prepared', details = CAST(:details AS jsonb), "
                "transition_epoch = transition_epoch + 1, entered_at = now(), "
                "updated_at = now(), finalized_at = NULL WHERE singleton"
            ),
            {"details": json.dumps({"schema": schema})},
        )

    def enter_mixed(self, conn: sa.Connection) -> None:
        row = _locked_singleton(conn)
        if row.state != "prepared" or row.prepared_engine != "queue_storage":
            raise TransitionRefused(f"cannot enter mixed transition from {row.state}")
        schema = _details_schema(row.details)
        conn.execute(
            sa.text(
                "INSERT INTO awa.runtime_storage_backends (backend, schema_name, updated_at) "
                "VALUES ('queue_storage', :s, now()) ON CONFLICT (backend) DO UPDATE "
                "SET schema_name = EXCLUDED.schema_name, updated_at = EXCLUDED.updated_at"
            ),
            {"s": schema},
        )
        conn.execute(
            sa.text(
                "UPDATE awa.storage_transition_state SET state = 'mixed_transition', "
                "transition_epoch = transition_epoch + 1, entered_at = now(), "
                "updated_at = now(), finalized_at = NULL WHERE singleton"
            )
        )

    def abort(self, conn: sa.Connection) -> None:
        row = _locked_singleton(conn)
        if row.state not in ("prepared", "mixed_transition"):
            raise TransitionRefused(f"cannot abort from {row.state}")
        if row.state == "mixed_transition":
            schema = _details_schema(row.details, default="awa_exp")
            left = queue_storage_rows(conn, schema)
            if left:
                raise TransitionRefused(f"queue storage {schema} still holds {left} rows")
        conn.execute(
            sa.text("DELETE FROM awa.runtime_storage_backends WHERE backend = 'queue_storage'")
        )
        conn.execute(
            sa.text(
                "UPDATE awa.storage_transition_state SET prepared_engine = NULL, "
                "state = 'canonical', details = '{}', transition_epoch = transition_epoch + 1, "
                "entered_at = now(), updated_at = now(), finalized_at = NULL WHERE singleton"
            )
        )

    def finalize(self, conn: sa.Connection) -> None:
        row = _locked_singleton(conn)
        if row.state != "mixed_transition" or row.prepared_engine != "queue_storage":
            raise TransitionRefused(f"cannot finalize from {row.state}")
        backlog = canonical_backlog(conn)
        if backlog:
            raise TransitionRefused(f"canonical live backlog is {backlog}")
        conn.execute(
            sa.text(
                "UPDATE awa.storage_transition_state SET current_engine = prepared_engine, "
                "prepared_engine = NULL, state = 'active', "
                "transition_epoch = transition_epoch + 1, entered_at = now(), "
                "updated_at = now(), finalized_at = now() WHERE singleton"
            )
        )


class RealTransitions:
    """Awa's own ``awa.storage_*`` SQL functions, on a database built by ``awa migrate``.

    :meth:`enter_mixed` registers a live queue-storage target runtime first (the function
    refuses without one); :meth:`abort` marks it gone first (abort refuses while a
    queue-storage runtime is live). Both bookkeeping writes are committed on their own
    connection, like a real runtime's heartbeat, before the transition locks anything.
    """

    kind = "real"

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.instance_id = uuid.uuid4()

    def _runtime(self, live: bool) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO awa.runtime_instances (instance_id, hostname, pid, version, "
                    " started_at, last_seen_at, snapshot_interval_ms, healthy, "
                    " postgres_connected, poll_loop_alive, heartbeat_alive, shutting_down, "
                    " leader, maintenance_alive, storage_capability, transition_role) "
                    "VALUES (:id, 'awa-sa-tests', 1, '0.6.9', now(), "
                    " CASE WHEN :live THEN now() ELSE now() - interval '1 hour' END, 5000, "
                    " true, true, true, true, false, false, true, 'queue_storage', "
                    " 'queue_storage_target') "
                    "ON CONFLICT (instance_id) DO UPDATE SET last_seen_at = "
                    " EXCLUDED.last_seen_at"
                ),
                {"id": self.instance_id, "live": live},
            )

    def prepare(self, conn: sa.Connection, schema: str) -> None:
        conn.execute(
            sa.text("SELECT * FROM awa.storage_prepare('queue_storage', CAST(:d AS jsonb))"),
            {"d": json.dumps({"schema": schema})},
        ).all()

    def enter_mixed(self, conn: sa.Connection) -> None:
        self._runtime(live=True)
        conn.execute(sa.text("SELECT * FROM awa.storage_enter_mixed_transition()")).all()

    def abort(self, conn: sa.Connection) -> None:
        self._runtime(live=False)
        conn.execute(sa.text("SELECT * FROM awa.storage_abort()")).all()

    def finalize(self, conn: sa.Connection) -> None:
        conn.execute(sa.text("SELECT * FROM awa.storage_finalize()")).all()


def routing(conn: sa.Connection) -> tuple[str | None, int | None, str | None]:
    """``(state, transition_epoch, active_queue_storage_schema())`` as committed now."""
    row = conn.execute(
        sa.text(
            "SELECT s.state, s.transition_epoch, awa.active_queue_storage_schema() AS schema "
            "FROM (SELECT 1) AS one LEFT JOIN awa.storage_transition_state s ON s.singleton"
        )
    ).one()
    return row.state, row.transition_epoch, row.schema


# --------------------------------------------------------------------------------------------
# Snapshots: "the database exactly as before"


def snapshot(conn: sa.Connection, qs_schemas: Iterable[str] = ("awa", "awa_qs")) -> dict[str, Any]:
    """Every row of every relation the operation can touch, as sorted text, plus relation names.

    Sequences are left out on purpose: ``nextval`` is not transactional, so a rolled-back call
    may leave a gap (docs/contract.md#take). Relation names of the queue-storage schemas are
    included, so a lane sequence created and then left behind would show.
    """
    out: dict[str, Any] = {}
    for table in CANONICAL_TABLES:
        out[f"awa.{table}"] = _rows(conn, "awa", table)
    for schema in qs_schemas:
        for table in QS_TABLES:
            out[f"{schema}.{table}"] = _rows(conn, schema, table)
        out[f"{schema}.<relations>"] = list(
            conn.execute(
                sa.text(
                    "SELECT c.relname FROM pg_class c JOIN pg_namespace n "
                    "ON n.oid = c.relnamespace WHERE n.nspname = :s ORDER BY 1"
                ),
                {"s": schema},
            ).scalars()
        )
    return out


def _rows(conn: sa.Connection, schema: str, table: str) -> list[str]:
    return list(
        conn.execute(sa.text(f'SELECT t::text FROM "{schema}"."{table}" AS t ORDER BY 1')).scalars()
    )


def take_snapshot(
    engine: sa.Engine, qs_schemas: Iterable[str] = ("awa", "awa_qs")
) -> dict[str, Any]:
    with engine.connect() as conn:
        return snapshot(conn, qs_schemas)


def fingerprint(engine: sa.Engine, qs_schemas: Iterable[str] = ("awa", "awa_qs")) -> dict[str, str]:
    """:func:`snapshot` condensed to one md5 per relation, in a single round trip.

    For loops that compare "before" and "after" hundreds of times; on a mismatch, take a full
    :func:`snapshot` to see what differs.
    """
    parts = [(f"awa.{t}", "awa", t) for t in CANONICAL_TABLES]
    parts += [(f"{s}.{t}", s, t) for s in qs_schemas for t in QS_TABLES]
    cols = [
        f"(SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
        f'FROM "{schema}"."{table}" AS t) AS "{name}"'
        for name, schema, table in parts
    ]
    cols += [
        f"(SELECT md5(coalesce(string_agg(c.relname, '|' ORDER BY c.relname), '')) "
        f"FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        f"WHERE n.nspname = '{schema}') AS \"{schema}.<relations>\""
        for schema in qs_schemas
    ]
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT " + ", ".join(cols))).mappings().one()
    return dict(row)


def assert_unchanged(before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed, f"database changed: {sorted(changed)}: {changed}"
