"""Both transaction forms, sync and async: Engine (own transaction), Connection (the caller's).

The Connection form must commit or roll back atomically with the caller's own writes, and never
commit by itself; the async face must behave the same through ``run_sync``. Also here: the
statement budget, the compiled text sent as is, and the one DEBUG record per call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import canonical_state, insert_holder, insert_job, scalar, snapshot_of
from recording import recording
from sqlalchemy.ext.asyncio import AsyncEngine

import awa_sa.asyncio as awa_async
import awa_sa_schema
from awa_sa import (
    Attempt,
    CancelledDuplicate,
    DatabaseError,
    Kind,
    Migrated,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    UniqueConflict,
    ValidationError,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
)
from awa_sa.core import compiled

PHASES = [("canonical", Rescheduled), ("mixed_transition", Migrated)]

OWN_WRITE = sa.text("INSERT INTO awa.admin_dirty_kind_marks (kind) VALUES ('caller-write')")
OWN_WRITES = "SELECT count(*) FROM awa.admin_dirty_kind_marks WHERE kind = 'caller-write'"


def _set_phase(engine: sa.Engine, phase: str) -> None:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, phase, "awa_qs")


def _new_job(engine: sa.Engine, **kw: Any) -> int:
    with engine.begin() as conn:
        return insert_job(conn, **kw)


def _own_writes(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(scalar(conn, OWN_WRITES))


@pytest.mark.parametrize(("phase", "expected"), PHASES)
def test_engine_form_commits_its_own_transaction(
    engine: sa.Engine, phase: str, expected: type
) -> None:
    _set_phase(engine, phase)
    job = _new_job(engine)
    assert isinstance(reschedule_canonical_attempt(engine, job, 1, Snooze(5)), expected)
    assert canonical_state(engine, job) is None  # visible to a fresh connection: committed


@pytest.mark.parametrize(("phase", "expected"), PHASES)
def test_connection_form_joins_the_callers_transaction(
    engine: sa.Engine, phase: str, expected: type
) -> None:
    _set_phase(engine, phase)
    kept, dropped = _new_job(engine), _new_job(engine)

    with engine.connect() as conn:
        conn.execute(OWN_WRITE)  # autobegun: the caller owns this transaction
        assert isinstance(reschedule_canonical_attempt(conn, dropped, 1, Snooze(5)), expected)
        assert conn.in_transaction()
        assert canonical_state(engine, dropped) == "running"  # nothing committed behind our back
        conn.rollback()
    assert canonical_state(engine, dropped) == "running"
    assert _own_writes(engine) == 0

    with engine.begin() as conn:
        conn.execute(OWN_WRITE)
        assert isinstance(reschedule_canonical_attempt(conn, kept, 1, Snooze(5)), expected)
        assert canonical_state(engine, kept) == "running"
    assert canonical_state(engine, kept) is None
    assert _own_writes(engine) == 1


def test_connection_form_error_in_queue_storage_leaves_the_caller_usable(
    engine: sa.Engine,
) -> None:
    """The queue-storage branch runs in a savepoint: an error after the take undoes only it."""
    _set_phase(engine, "mixed_transition")
    bad_meta = _new_job(engine, metadata="[1]")
    overflow = _new_job(engine, attempt=44)
    before = snapshot_of(engine)
    with engine.begin() as conn:
        conn.execute(OWN_WRITE)
        with pytest.raises(ValidationError):
            reschedule_canonical_attempt(conn, bad_meta, 1, Snooze(5))
        with pytest.raises(DatabaseError):
            reschedule_canonical_attempt(conn, overflow, 1, RetryBackoff())
        conn.execute(OWN_WRITE)  # still usable
    after = snapshot_of(engine)
    assert _own_writes(engine) == 2
    after["awa.admin_dirty_kind_marks"] = before["awa.admin_dirty_kind_marks"]
    assert after == before


def test_connection_form_canonical_conflict_aborts_the_callers_transaction(
    engine: sa.Engine,
) -> None:
    """Awa's canonical behaviour: the failed statement aborts the transaction; roll it back."""
    job = _new_job(engine, unique_key=b"k", unique_states="11000000")
    with engine.begin() as conn:
        insert_holder(conn, b"k", "11000000")
    with engine.connect() as conn:
        conn.execute(OWN_WRITE)
        with pytest.raises(UniqueConflict):
            reschedule_canonical_attempt(conn, job, 1, Snooze(5))
        with pytest.raises(sa.exc.InternalError):  # in_failed_sql_transaction
            conn.execute(sa.text("SELECT 1"))
        conn.rollback()
    assert canonical_state(engine, job) == "running"
    assert _own_writes(engine) == 0


@pytest.mark.parametrize(("phase", "expected"), PHASES)
async def test_async_engine_form(
    engine: sa.Engine, async_engine: AsyncEngine, phase: str, expected: type
) -> None:
    _set_phase(engine, phase)
    job = _new_job(engine, unique_key=b"k", unique_states="11111000")
    outcome = await awa_async.reschedule_canonical_attempt(
        async_engine, job, 1, RetryAfter(2.5), error={"e": 1}, progress=[1]
    )
    assert isinstance(outcome, expected)
    assert canonical_state(engine, job) is None
    assert await awa_async.reschedule_canonical_attempt(async_engine, job, 1, Snooze(1)) == Stale()


@pytest.mark.parametrize(("phase", "expected"), PHASES)
async def test_async_connection_form(
    engine: sa.Engine, async_engine: AsyncEngine, phase: str, expected: type
) -> None:
    _set_phase(engine, phase)
    kept, dropped = _new_job(engine), _new_job(engine)
    async with async_engine.connect() as conn:
        await conn.execute(OWN_WRITE)
        outcome = await awa_async.reschedule_canonical_attempt(conn, dropped, 1, Snooze(5))
        assert isinstance(outcome, expected)
        assert canonical_state(engine, dropped) == "running"
        await conn.rollback()
    assert canonical_state(engine, dropped) == "running"
    async with async_engine.begin() as conn:
        await conn.execute(OWN_WRITE)
        outcome = await awa_async.reschedule_canonical_attempt(conn, kept, 1, Snooze(5))
        assert isinstance(outcome, expected)
    assert canonical_state(engine, kept) is None
    assert _own_writes(engine) == 1


# -- statement budget, compiled text, logging ----------------------------------------------


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    """Every statement sent on *engine*, as its first word, plus BEGIN/COMMIT/ROLLBACK events."""
    with recording(engine) as seen:
        yield seen


# The Engine form's BEGIN and ROLLBACK are SQLAlchemy's events around its autobegun
# transaction: the one statement ran in autocommit and committed by itself, so nothing was left
# to commit, and neither reaches the server (bench/ counts the round trips at a proxy).
ALONE = ["BEGIN", "WITH", "ROLLBACK"]


def test_canonical_path_is_one_statement(engine: sa.Engine, statements: list[Any]) -> None:
    jobs = [_new_job(engine) for _ in range(4)]
    with engine.begin() as conn:
        statements.clear()
        assert isinstance(reschedule_canonical_attempt(conn, jobs[0], 1, Snooze(1)), Rescheduled)
        assert statements == ["WITH"]
    statements.clear()
    assert isinstance(reschedule_canonical_attempt(engine, jobs[1], 1, RetryBackoff()), Rescheduled)
    assert statements == ALONE
    assert canonical_state(engine, jobs[1]) is None  # committed
    statements.clear()
    assert reschedule_canonical_attempt(engine, 999, 1, RetryBackoff()) == Stale()
    assert statements == ALONE
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
    statements.clear()
    assert isinstance(reschedule_canonical_attempt(engine, jobs[2], 1, Snooze(1)), Rescheduled)
    assert statements == ALONE  # no singleton: canonical, in the same one statement


def test_queue_storage_path_goes_on_from_the_one_statement(
    engine: sa.Engine, statements: list[Any]
) -> None:
    """Routing says queue storage: the Connection form reads it afresh under the lock the one
    statement took (one statement more than before it existed: none); the Engine form opens a
    transaction and takes the whole path from the lock (one more)."""
    _set_phase(engine, "mixed_transition")
    jobs = [_new_job(engine) for _ in range(2)]
    with engine.begin() as conn:
        statements.clear()
        assert isinstance(reschedule_canonical_attempt(conn, jobs[0], 1, Snooze(1)), Migrated)
        assert statements[:3] == ["WITH", "WITH", "SAVEPOINT"]
    statements.clear()
    assert isinstance(reschedule_canonical_attempt(engine, jobs[1], 1, Snooze(1)), Migrated)
    assert statements[:6] == [*ALONE, "BEGIN", "SELECT", "WITH"]
    assert statements[-1] == "COMMIT"


@pytest.mark.parametrize("singleton", [True, False])
@pytest.mark.parametrize("size", [2, 10, 200])
def test_canonical_batch_is_the_same_one_statement(
    engine: sa.Engine, statements: list[Any], size: int, singleton: bool
) -> None:
    """Whatever the batch size, kinds, repeats and misses: one statement."""
    with engine.begin() as conn:
        ids = [insert_job(conn, kind=f"k{i % 3}", queue=f"q{i % 2}") for i in range(size)]
        if not singleton:
            conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
    kinds: list[Kind] = [Snooze(1), RetryAfter(2.5), RetryBackoff()]
    batch = [Attempt(job, 1, kinds[i % 3], error={"i": i}) for i, job in enumerate(ids)]
    batch += [Attempt(ids[0], 1, Snooze(1)), Attempt(999_999, 1, Snooze(1))]
    statements.clear()
    outcomes = reschedule_canonical_attempts(engine, batch)
    assert statements == ALONE
    assert [type(o) for o in outcomes] == [Rescheduled] * size + [Stale, Stale]


def test_statement_text_is_compiled_once_and_reused(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled once per statement, dialect and schema; afterwards the cached text itself is sent.

    Every path (migrated with a claim, cancelled duplicate with the last resort, canonical
    fall-through, batches) runs once per schema to warm up; then compiling is made to fail and
    the same paths run again, sending the very string objects held in the cache.
    """

    def every_path(round_: int, schema: str) -> None:
        with engine.begin() as conn:
            awa_sa_schema.set_phase(conn, "mixed_transition", schema)
        key = f"{round_}-{schema}".encode()
        job = _new_job(engine, unique_key=key, unique_states="11111000")
        dup = _new_job(engine, unique_key=key + b"d", unique_states="11000010")
        wired = _new_job(engine, callbacks=["callback_on_fail"])
        batch = [_new_job(engine) for _ in range(3)]
        with engine.begin() as conn:
            insert_holder(conn, key + b"d", "11000010")
        assert isinstance(reschedule_canonical_attempt(engine, job, 1, Snooze(1)), Migrated)
        assert isinstance(
            reschedule_canonical_attempt(engine, dup, 1, Snooze(1)), CancelledDuplicate
        )
        assert isinstance(reschedule_canonical_attempt(engine, wired, 1, Snooze(1)), Rescheduled)
        outcomes = reschedule_canonical_attempts(engine, [Attempt(j, 1, Snooze(1)) for j in batch])
        assert {type(o) for o in outcomes} == {Migrated}
        with engine.begin() as conn:
            awa_sa_schema.set_phase(conn, "canonical", schema)
        assert isinstance(
            reschedule_canonical_attempt(engine, _new_job(engine), 1, Snooze(1)), Rescheduled
        )
        pair = [Attempt(_new_job(engine), 1, Snooze(1)) for _ in range(2)]
        assert {type(o) for o in reschedule_canonical_attempts(engine, pair)} == {Rescheduled}

    for schema in ("awa_qs", "awa"):
        every_path(0, schema)

    def unchanged(sql: str) -> str:
        """The text itself, not a label: its identity is what is checked."""
        return sql

    def refuse(*args: Any) -> None:
        raise AssertionError(f"compiled again: {args[0]}")

    monkeypatch.setattr(compiled, "compile_statement", refuse)
    with recording(engine, unchanged, events=(), driver_sql_only=True) as sent:
        for schema in ("awa_qs", "awa"):
            every_path(1, schema)
    cached = {id(text.sql) for texts in compiled._cache.values() for text in texts.values()}
    assert len(sent) > 40
    assert all(id(sql) in cached for sql in sent)  # the very objects compiled in round 0


def test_one_debug_record_per_call(engine: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    ok = _new_job(engine)
    conflict = _new_job(engine, unique_key=b"k", unique_states="11000000")
    with engine.begin() as conn:
        insert_holder(conn, b"k", "11000000")
    with caplog.at_level(logging.DEBUG, logger="awa_sa"):
        reschedule_canonical_attempt(engine, ok, 1, Snooze(1))
        reschedule_canonical_attempt(engine, 999, 1, RetryAfter(1))
        with pytest.raises(UniqueConflict):
            reschedule_canonical_attempt(engine, conflict, 1, Snooze(1))
    records = [r for r in caplog.records if r.name == "awa_sa"]
    # The flow's `extra=` fields: attributes the LogRecord type cannot declare.
    fields = ("levelno", "awa_job_id", "awa_kind", "awa_routing", "awa_outcome")
    assert [tuple(getattr(r, name) for name in fields) for r in records] == [
        (logging.DEBUG, ok, "Snooze", "canonical", "Rescheduled"),
        (logging.DEBUG, 999, "RetryAfter", "canonical", "Stale"),
        (logging.DEBUG, conflict, "Snooze", "canonical", "error UniqueConflict"),
    ]
    assert f"job_id={ok}" in records[0].getMessage()


def test_driver_and_sqlalchemy_errors_come_out_as_database_errors(engine: sa.Engine) -> None:
    job = _new_job(engine)
    with engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError):
            conn.execute(sa.text("SELECT 1/0"))  # the caller's transaction is now aborted
        with pytest.raises(DatabaseError) as info:
            reschedule_canonical_attempt(conn, job, 1, Snooze(1))
        assert info.value.sqlstate == "25P02"  # in_failed_sql_transaction
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError)
        conn.rollback()
    conn = engine.connect()
    conn.close()
    with pytest.raises(DatabaseError) as closed:
        reschedule_canonical_attempt(conn, job, 1, Snooze(1))
    assert closed.value.sqlstate is None
    assert isinstance(closed.value.__cause__, sa.exc.ResourceClosedError)
    assert canonical_state(engine, job) == "running"
