"""Fault injection (issue #6): the server fails the operation midway; nothing may survive.

Each fault must end in a clear :class:`awa_sa.AwaSAError` (never a raw SQLAlchemy or psycopg
exception) and leave every table exactly as it was before the call (``racing.snapshot`` /
``racing.fingerprint``: every row of every relation the operation touches, plus the relation
names of both queue-storage schemas; sequences excepted, since ``nextval`` is not
transactional).

Faults:

* the backend is killed (``pg_terminate_backend`` from another session) before and after every
  statement the operation sends -- driven by the suite's statement recorder (``recording``'s
  *act*) -- on each path (canonical, migrated, cancelled duplicate with the last-resort insert),
  through an ``Engine``, a caller's ``Connection`` and an ``AsyncEngine``;
* ``statement_timeout`` while another session holds the attempt's row or the successor's
  unique claim (the latter strikes inside the deferred-rows savepoint, after the take);
  ``lock_timeout`` on the lane's advisory lock (between the savepoints) and while a transition
  holds the singleton;
  ``pg_cancel_backend`` while the call waits for the singleton;
* serialization failures under REPEATABLE READ and SERIALIZABLE (docs/contract.md#transactions): the
  singleton or the attempt changed since the caller's snapshot;
* a queue ring cursor with no partition behind it, and a missing ring row.

Cloning a database costs a second or more, so each test walks one database through several
faults.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import advance_sequence, insert_holder, insert_job
from racing import (
    EmulatedTransitions,
    RealTransitions,
    assert_unchanged,
    fingerprint,
    held,
    in_thread,
    take_snapshot,
    wait_for,
    wait_until_blocked,
)
from recording import Sent, recording
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import (
    AwaSAError,
    CancelledDuplicate,
    DatabaseError,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    Snooze,
    UniqueConflict,
    reschedule_canonical_attempt,
)
from awa_sa_schema import set_phase

QS_IDS = 900_000
"""Fresh queue-storage ids start here, so none can equal a canonical holder's id.

See the id-coincidence edge in docs/contract.md#decision-table.
"""

_keys = itertools.count()


def _assert_clear(exc: BaseException) -> None:
    """An awa-sa error with a message; the driver's error only as its cause."""
    assert isinstance(exc, AwaSAError), f"raw {type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert not isinstance(exc, sa.exc.SQLAlchemyError)
    assert str(exc)


def _plain(conn: sa.Connection) -> tuple[int, int]:
    return insert_job(conn, run_lease=4, metadata='{"t": 1}', tags=["x"]), 4


def _last_resort(conn: sa.Connection) -> tuple[int, int]:
    """Running outside the mask, a holder owns the key, and the mask claims cancelled too:
    the longest path (the deferred-rows savepoint fails, the cancelled-row savepoint fails, the
    last-resort insert).
    """
    if conn.execute(sa.text("SELECT last_value FROM awa_qs.job_id_seq")).scalar_one() < QS_IDS:
        advance_sequence(conn, "awa_qs.job_id_seq", QS_IDS)
    key = b"fault-%d" % next(_keys)
    insert_holder(conn, key)
    return insert_job(conn, run_lease=4, unique_key=key, unique_states="11000010"), 4


# --------------------------------------------------------------------------------------------
# Killing the backend at every statement boundary


@dataclass
class Killer:
    """Terminates the victim's backend before or after its *at*-th statement (0-based)."""

    killer: sa.Engine
    at: int
    when: str
    killed: str | None = None

    def act(self, sent: Sent) -> None:
        """The recorder's hook: kills at the statement and moment asked for."""
        if (sent.index, sent.when) == (self.at, self.when):
            self._kill(sent.conn, sent.sql)

    def _kill(self, victim: sa.Connection, statement: str) -> None:
        # The psycopg connection under the pool proxy, sync or async alike.
        pid = victim.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
        gone = sa.text("SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = :p)")
        with self.killer.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()

            def exited() -> bool:
                done = bool(conn.execute(gone, {"p": pid}).scalar())
                conn.rollback()  # activity statistics are a per-transaction snapshot
                return done

            # Faster than pg_terminate_backend's own timeout, which polls every 100 ms.
            wait_for(exited, what="backend exit")
        self.killed = f"{self.when} #{self.at}: {statement.split(maxsplit=1)[0]}"


@contextmanager
def killing(killer: sa.Engine, victim: sa.Engine, at: int, when: str) -> Iterator[Killer]:
    """While the block runs, kill *victim*'s backend before or after its *at*-th statement."""
    armed = Killer(killer, at, when)
    with recording(victim, events=(), act=armed.act):
        yield armed


def _call_form(form: str, engine: sa.Engine, job_id: int, lease: int) -> Outcome | str:
    """Call through *form*. A caller's COMMIT failing after a successful call is reported as
    ``"caller commit failed"``: that statement is the caller's, not the operation's.
    """
    if form == "engine":
        return reschedule_canonical_attempt(engine, job_id, lease, Snooze(30), error={"e": 1})
    with engine.connect() as conn:
        tx = conn.begin()
        out = reschedule_canonical_attempt(conn, job_id, lease, Snooze(30), error={"e": 1})
        try:
            tx.commit()
        except sa.exc.DBAPIError:
            return "caller commit failed"
        return out


def _kill_everywhere(
    engine: sa.Engine,
    victim: sa.Engine,
    seed: Callable[[sa.Connection], tuple[int, int]],
    expect: type[Outcome],
) -> list[str]:
    """Kill before and after each statement of one path, in both forms; return what failed.

    One exception, and it is checked too: the Engine form's one statement runs in autocommit,
    so a kill after it that moved the job comes after the commit. The call then reports the
    outcome it committed, and the job is gone from ``jobs_hot``.
    """
    failures = []
    for form in ("engine", "connection"):
        with engine.begin() as conn:
            job_id, lease = seed(conn)
        # The dry run tells which statements this form sends.
        with recording(victim, events=()) as statements:
            assert isinstance(_call_form(form, victim, job_id, lease), expect)

        # Every kill point's job made at once: as a killed call may change nothing, what one
        # left is what the next one starts from, and a fingerprint each suffices.
        points = list(itertools.product(range(len(statements)), ("before", "after")))
        with engine.begin() as conn:
            jobs = [seed(conn) for _ in points]
        before = fingerprint(engine)
        for (at, when), (job_id, lease) in zip(points, jobs, strict=True):
            label = f"{expect.__name__} {when} #{at} ({statements[at]}) {form}"
            committed_alone = form == "engine" and len(statements) == 1 and when == "after"
            with killing(engine, victim, at, when) as killer:
                try:
                    result = _call_form(form, victim, job_id, lease)
                    if committed_alone and isinstance(result, expect):
                        if _running(engine, job_id):
                            failures.append(f"{label}: reported {result}, but the job still runs")
                        # Killed after its last statement, like any connection killed after a
                        # COMMIT: dead in the pool until its next use (or pool_pre_ping) finds out.
                        victim.dispose()
                        before = fingerprint(engine)  # the move is the next one's start
                        continue
                    if result != "caller commit failed":
                        failures.append(f"{label}: no error, {result}")
                except Exception as exc:
                    if not isinstance(exc, AwaSAError):
                        raw = f"{type(exc).__module__}.{type(exc).__name__}"
                        failures.append(f"{label}: raw {raw}")
            assert killer.killed, f"kill point {label} never reached"
            after = fingerprint(engine)
            if after != before:
                failures.append(f"{label}: database changed")
            before = after

    # The pool recovers from every kill: the next call simply works.
    with engine.begin() as conn:
        job_id, lease = seed(conn)
    assert isinstance(reschedule_canonical_attempt(victim, job_id, lease, Snooze(1)), expect)
    return failures


def _running(engine: sa.Engine, job_id: int) -> bool:
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT 1 FROM awa.jobs_hot WHERE id = :i"), {"i": job_id})
        return found.first() is not None


# On the real cluster only, as test_drivers.py's kills: the boundaries are awa-sa's statements,
# and the fixture's routing functions are the real ones byte for byte (test_catalog_parity.py).
@pytest.mark.parametrize("cluster", ["real"], indirect=True)
def test_backend_killed_at_every_statement_boundary(cluster: Cluster) -> None:
    """Canonical path, then (routing flipped to ``awa_qs``) migrated and last-resort paths."""
    engine = cluster.engine
    victim = sa.create_engine(cluster.url)  # one pool throughout: it must survive the kills
    try:
        failures = _kill_everywhere(engine, victim, _plain, Rescheduled)
        cluster.set_phase("mixed_transition", "awa_qs")
        with engine.begin() as conn:
            advance_sequence(conn, "awa_qs.job_id_seq", QS_IDS)
        failures += _kill_everywhere(engine, victim, _plain, Migrated)
        failures += _kill_everywhere(engine, victim, _last_resort, CancelledDuplicate)
    finally:
        victim.dispose()
    assert not failures, f"{len(failures)} kill points failed:\n" + "\n".join(failures)


async def test_backend_killed_under_the_async_face(db_url: str, engine: sa.Engine) -> None:
    """The async face on the longest path, killed before and after each statement."""
    with engine.begin() as conn:
        set_phase(conn, "mixed_transition", "awa_qs")
    aengine = create_async_engine(db_url)
    victim = aengine.sync_engine  # where the hooks go: the async engine's events are its own
    failures: list[str] = []
    try:
        with engine.begin() as conn:
            job_id, lease = _last_resort(conn)
        with recording(victim, events=()) as statements:
            out = await awa_async.reschedule_canonical_attempt(aengine, job_id, lease, Snooze(3))
        assert isinstance(out, CancelledDuplicate)
        points = list(itertools.product(range(len(statements)), ("before", "after")))
        with engine.begin() as conn:  # every kill point's job at once, as above
            jobs = [_last_resort(conn) for _ in points]
        before = fingerprint(engine)
        for (at, when), (job_id, lease) in zip(points, jobs, strict=True):
            with killing(engine, victim, at, when) as killer:
                try:
                    out = await awa_async.reschedule_canonical_attempt(
                        aengine, job_id, lease, Snooze(3)
                    )
                    failures.append(f"{when} #{at}: no error, {out}")
                except Exception as exc:
                    if not isinstance(exc, AwaSAError):
                        raw = f"{type(exc).__module__}.{type(exc).__name__}"
                        failures.append(f"{when} #{at}: raw {raw}")
            assert killer.killed, (when, at)
            after = fingerprint(engine)
            if after != before:
                failures.append(f"{when} #{at}: database changed")
            before = after
    finally:
        await aengine.dispose()
    assert len(statements) > 10
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------------
# Timeouts and cancellation


def _timeout_engine(url: str, **settings: int) -> sa.Engine:
    options = " ".join(f"-c {k}={v}" for k, v in settings.items())
    return sa.create_engine(url, connect_args={"options": options})


def _expect_database_error(
    engine: sa.Engine, call: Callable[[], Any], sqlstate: str | None
) -> DatabaseError:
    before = take_snapshot(engine)
    with pytest.raises(DatabaseError) as info:
        call()
    _assert_clear(info.value)
    assert info.value.sqlstate == sqlstate, info.value
    assert_unchanged(before, take_snapshot(engine))
    return info.value


def _timeout_on_a_held_row(engine: sa.Engine, timed: sa.Engine) -> None:
    """Another session holds the attempt's row: the statement is cancelled (57014)."""
    with engine.begin() as conn:
        job_id, lease = _plain(conn)
    with held(engine) as holder:
        holder.execute("SELECT 1 FROM awa.jobs_hot WHERE id = :i FOR UPDATE", {"i": job_id})
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(timed, job_id, lease, Snooze(1)),
            "57014",
        )


def _timeout_on_the_claim_after_the_take(engine: sa.Engine, timed: sa.Engine) -> None:
    """The successor's claim waits on another session's uncommitted claim of the same key; the
    timeout strikes inside the deferred-rows savepoint, after the canonical row was taken and an
    id allocated.
    """
    key = b"fault-%d" % next(_keys)
    with engine.begin() as conn:
        # The mask claims retryable but not running: no claim while it runs.
        job_id = insert_job(conn, run_lease=2, unique_key=key, unique_states="11011000")
    with held(engine) as other:
        other.execute(
            "INSERT INTO awa.job_unique_claims (unique_key, job_id) VALUES (:k, -1)", {"k": key}
        )
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(timed, job_id, 2, RetryAfter(3)),
            "57014",
        )
    with engine.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state::text FROM awa.jobs_hot WHERE id = :i"), {"i": job_id}
        ).scalar_one()
    assert state == "running"


def _lock_timeout_on_the_lane(engine: sa.Engine, timed: sa.Engine) -> None:
    """The cancelled-duplicate path waits for the lane's advisory lock, held elsewhere; the
    timeout strikes after the deferred-rows savepoint was rolled back, between the two savepoints.
    """
    with engine.begin() as conn:
        job_id, lease = _last_resort(conn)
        queue, priority = conn.execute(
            sa.text("SELECT queue, priority FROM awa.jobs_hot WHERE id = :i"), {"i": job_id}
        ).one()
    with held(engine) as lane:
        lane.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))",
            {"k": f"awa_qs:{queue}:{priority}:0"},
        )
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(timed, job_id, lease, Snooze(1)),
            "55P03",
        )


def _lock_timeout_on_the_singleton(cluster: Cluster, timed: sa.Engine) -> None:
    """A transition (here an abort, real or emulated) holds the singleton: 55P03, no change.

    Through a caller's Connection the failed routing lock leaves the caller's transaction
    aborted (it is the first statement, outside any savepoint): the caller must roll back.
    """
    engine = cluster.engine
    moves = RealTransitions(engine)
    with engine.begin() as conn:
        job_id, lease = _plain(conn)
    with held(engine) as transition:
        moves.abort(transition.conn)
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(timed, job_id, lease, Snooze(1)),
            "55P03",
        )
        with engine.connect() as conn:
            tx = conn.begin()
            conn.execute(sa.text("SET LOCAL lock_timeout = 150"))
            _expect_database_error(
                engine,
                lambda: reschedule_canonical_attempt(conn, job_id, lease, Snooze(1)),
                "55P03",
            )
            with pytest.raises(sa.exc.InternalError):  # current transaction is aborted
                conn.execute(sa.text("SELECT 1"))
            tx.rollback()
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
        transition.rollback()


def _cancelled_while_waiting(cluster: Cluster) -> None:
    """pg_cancel_backend while the call waits for the singleton: 57014, no change."""
    engine = cluster.engine
    moves = RealTransitions(engine)
    with engine.begin() as conn:
        job_id, lease = _plain(conn)
    before = take_snapshot(engine)
    with held(engine) as transition:
        moves.abort(transition.conn)
        fut = in_thread(lambda: reschedule_canonical_attempt(engine, job_id, lease, Snooze(1)))
        (waiter,) = wait_until_blocked(engine, transition.pid, pending=[fut])
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_cancel_backend(:p)"), {"p": waiter.pid})
        error = fut.exception(timeout=20)
        transition.rollback()
    assert isinstance(error, DatabaseError), error
    _assert_clear(error)
    assert error.sqlstate == "57014"
    assert_unchanged(
        {k: v for k, v in before.items() if "runtime" not in k},
        {k: v for k, v in take_snapshot(engine).items() if "runtime" not in k},
    )


def test_timeouts_and_cancellation(cluster: Cluster) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    statement = _timeout_engine(cluster.url, statement_timeout=300)
    lock = _timeout_engine(cluster.url, lock_timeout=200)
    try:
        _timeout_on_a_held_row(cluster.engine, statement)
        _timeout_on_the_claim_after_the_take(cluster.engine, statement)
        _lock_timeout_on_the_lane(cluster.engine, lock)
        _lock_timeout_on_the_singleton(cluster, lock)
        _cancelled_while_waiting(cluster)
    finally:
        statement.dispose()
        lock.dispose()


# --------------------------------------------------------------------------------------------
# Serialization failures (REPEATABLE READ / SERIALIZABLE, composable form)


def _serialization_failure_on_the_singleton(engine: sa.Engine, isolation: str) -> None:
    """A transition commits after the caller's snapshot: the share lock raises 40001, and a
    retry in a new transaction (what the caller must do) sees the flip and migrates.
    """
    with engine.begin() as conn:
        set_phase(conn, "prepared", "awa_qs")
        job_id, lease = _plain(conn)
    with engine.connect().execution_options(isolation_level=isolation) as conn:
        tx = conn.begin()
        conn.execute(sa.text("SELECT count(*) FROM awa.jobs_hot"))  # the snapshot is taken
        with engine.begin() as other:
            EmulatedTransitions().enter_mixed(other)
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(conn, job_id, lease, RetryAfter(1)),
            "40001",
        )
        tx.rollback()
    assert isinstance(reschedule_canonical_attempt(engine, job_id, lease, RetryAfter(1)), Migrated)


def _serialization_failure_on_the_attempt(engine: sa.Engine) -> None:
    """A heartbeat updates the attempt after the caller's snapshot: deleting it raises 40001."""
    with engine.begin() as conn:
        job_id, lease = _plain(conn)
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        tx = conn.begin()
        conn.execute(sa.text("SELECT count(*) FROM awa.jobs_hot"))
        with engine.begin() as other:
            other.execute(
                sa.text("UPDATE awa.jobs_hot SET heartbeat_at = now() WHERE id = :i"),
                {"i": job_id},
            )
        _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(conn, job_id, lease, Snooze(1)),
            "40001",
        )
        tx.rollback()


def test_serialization_failures(engine: sa.Engine) -> None:
    # Without interference REPEATABLE READ simply works.
    with engine.begin() as conn:
        job_id, lease = _plain(conn)
    rr = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    with rr as conn, conn.begin():
        assert isinstance(reschedule_canonical_attempt(conn, job_id, lease, Snooze(1)), Rescheduled)

    _serialization_failure_on_the_attempt(engine)  # canonical routing
    _serialization_failure_on_the_singleton(engine, "REPEATABLE READ")
    _serialization_failure_on_the_singleton(engine, "SERIALIZABLE")
    _serialization_failure_on_the_attempt(engine)  # queue-storage routing (the take)


# --------------------------------------------------------------------------------------------
# Queue-storage state that makes the cancelled row impossible to write


def test_broken_ring_after_the_take(engine: sa.Engine) -> None:
    """The duplicate path cannot write its cancelled row; the taken canonical row comes back.
    A unique conflict on the canonical path, by contrast, is a UniqueConflict, not a fault.
    """
    with engine.begin() as conn:
        insert_holder(conn, b"control")
        job_id = insert_job(conn, run_lease=1, unique_key=b"control", unique_states="11000000")
    before = take_snapshot(engine)
    with pytest.raises(UniqueConflict) as info:
        reschedule_canonical_attempt(engine, job_id, 1, Snooze(1))
    assert info.value.constraint == "idx_awa_jobs_unique"
    assert_unchanged(before, take_snapshot(engine))

    with engine.begin() as conn:
        set_phase(conn, "mixed_transition", "awa_qs")
    damages = [
        ("UPDATE awa_qs.queue_ring_state SET current_slot = 99", "23514"),
        ("DELETE FROM awa_qs.queue_ring_state", None),
    ]
    for damage, sqlstate in damages:
        with engine.begin() as conn:
            job_id, lease = _last_resort(conn)
            conn.execute(sa.text(damage))
        error = _expect_database_error(
            engine,
            lambda: reschedule_canonical_attempt(engine, job_id, lease, Snooze(1)),  # noqa: B023
            sqlstate,
        )
        if sqlstate is None:
            assert "queue_ring_state" in str(error)
