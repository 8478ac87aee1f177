"""The one-statement canonical reschedule (docs/contract.md#one-statement), on a real cluster.

* Races in both directions while the statement waits for a transition holding the singleton:
  an abort (it must move canonically) and enter-mixed (it must not). In the same rig, two
  controls that call the STABLE function read the pre-wait snapshot, so the rig can tell a
  stale routing read from a fresh one: Awa 0.6's one-statement lock-and-read, and the very
  statement we send with its inline routing replaced by a call to the function.
* The rows it writes are the two-statement path's (the lock, then the routing move), for
  every kind and job shape, in the canonical and prepared phases, single calls and a batch.
* The guard: after ``CREATE OR REPLACE`` of either routing function the statement moves nothing
  and the call takes the two-statement path, which asks the installed function.
* A unique conflict in autocommit, and REPEATABLE READ's serialization failure.

Killing the backend before and after the statement is in test_faults.py and test_drivers.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import insert_holder, insert_job
from racing import (
    RealTransitions,
    Transitions,
    after_it_waits,
    take_snapshot,
)
from recording import recording, step
from sqlalchemy.dialects.postgresql import psycopg
from test_batch import NO_NOW, Run, _normal_outcome, tables

from awa_sa import (
    Attempt,
    AwaSAError,
    Complete,
    Completed,
    DatabaseError,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    UniqueConflict,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
    settle_canonical_attempt,
    statements,
)
from awa_sa.core.compiled import compile_statement
from awa_sa.settle import binds as forms
from awa_sa.settle import flow as awa_flow
from awa_sa.settle.inputs import prepare_all
from awa_sa.settle.statements.attempts import MoveItem, item_binds

SCHEMA = "awa_qs"

# -- races, both directions ------------------------------------------------------------------

_FUNCTION_READ = sa.text(
    "SELECT awa.active_queue_storage_schema() FROM awa.storage_transition_state "
    "WHERE singleton FOR SHARE"
)


def _function_routed_statement() -> str:
    """Control: the statement we send, its inline routing replaced by the function call."""
    sql = compile_statement(statements.move_if_canonical(batch=False), psycopg.dialect(), None).sql
    inline = re.compile(r"SELECT nullif\(btrim\(CASE WHEN .*? END\), ''\) AS engine", re.S)
    control, replaced = inline.subn("SELECT awa.active_storage_engine() AS engine", sql, count=1)
    assert replaced == 1
    return control


def _seed(engine: sa.Engine, count: int = 1) -> list[int]:
    with engine.begin() as conn:
        return [insert_job(conn, run_lease=2, attempt=3) for _ in range(count)]


def _where(engine: sa.Engine, job_id: int) -> list[str]:
    found = []
    with engine.connect() as conn:
        for table in ("awa.jobs_hot", "awa.scheduled_jobs"):
            hit = conn.execute(sa.text(f"SELECT 1 FROM {table} WHERE id = :i"), {"i": job_id})
            if hit.first() is not None:
                found.append(table)
    return found


def _deferred(engine: sa.Engine, job_id: int) -> int:
    with engine.connect() as conn:
        sql = f"SELECT count(*) FROM {SCHEMA}.deferred_jobs WHERE job_id = :i"
        return int(conn.execute(sa.text(sql), {"i": job_id}).scalar_one())


def _callers(engine: sa.Engine) -> dict[str, Callable[[list[int]], list[Any]]]:
    def engine_single(jobs: list[int]) -> list[Any]:
        return [reschedule_canonical_attempt(engine, jobs[0], 2, Snooze(30))]

    def engine_batch(jobs: list[int]) -> list[Any]:
        return reschedule_canonical_attempts(engine, [Attempt(j, 2, Snooze(30)) for j in jobs])

    def connection_single(jobs: list[int]) -> list[Any]:
        with engine.begin() as conn:
            return [reschedule_canonical_attempt(conn, jobs[0], 2, Snooze(30))]

    return {"engine": engine_single, "batch": engine_batch, "connection": connection_single}


def _enter(cluster: Cluster, moves: Transitions, phase: str) -> None:
    """From canonical (or after an abort) into *phase*: prepared or mixed_transition."""
    with cluster.engine.begin() as conn:
        moves.prepare(conn, SCHEMA)
    if phase == "mixed_transition":
        with cluster.engine.begin() as conn:
            moves.enter_mixed(conn)


@pytest.mark.parametrize("caller", ["engine", "batch", "connection"])
def test_abort_while_it_waits_routes_canonical(cluster: Cluster, caller: str) -> None:
    engine = cluster.engine
    moves = RealTransitions(engine)
    call = _callers(engine)[caller]
    # Control 1: Awa 0.6's lock-and-read returns the schema the abort has just deactivated.
    _enter(cluster, moves, "mixed_transition")
    stale = after_it_waits(engine, moves.abort, lambda: _scalar(engine, _FUNCTION_READ))
    assert stale == SCHEMA
    # Control 2: our statement with the function call instead of the inline copy: it sees
    # queue storage (stale), and moves nothing although routing is canonical by then.
    _enter(cluster, moves, "mixed_transition")
    (job,) = _seed(engine)
    control = _function_routed_statement()
    head = after_it_waits(
        engine,
        moves.abort,
        lambda: _first_row(engine, control, job),
    )
    assert (head.queue_storage, head.id) == (True, None)
    assert _where(engine, job) == ["awa.jobs_hot"]
    # The one statement: the locked row is the aborted one; the job moves canonically.
    _enter(cluster, moves, "mixed_transition")
    jobs = _seed(engine, 3 if caller == "batch" else 1)
    outcomes = after_it_waits(engine, moves.abort, lambda: call(jobs))
    assert [type(o) for o in outcomes] == [Rescheduled] * len(jobs)
    for job_id, outcome in zip(jobs, outcomes, strict=True):
        assert outcome.job_id == job_id
        assert _where(engine, job_id) == ["awa.scheduled_jobs"]
    with engine.connect() as conn:
        left = conn.execute(sa.text(f"SELECT count(*) FROM {SCHEMA}.deferred_jobs")).scalar()
    assert left == 0  # nothing stranded in the schema the abort deactivated


@pytest.mark.parametrize("caller", ["engine", "batch", "connection"])
def test_enter_mixed_while_it_waits_does_not_move_canonically(
    cluster: Cluster, caller: str
) -> None:
    engine = cluster.engine
    moves = RealTransitions(engine)
    call = _callers(engine)[caller]
    _enter(cluster, moves, "prepared")
    # Control 1: the function-call read waited for the flip and still says canonical.
    stale = after_it_waits(engine, moves.enter_mixed, lambda: _scalar(engine, _FUNCTION_READ))
    assert stale is None
    # Control 2: the function-routed statement writes canonically after the flip committed.
    with engine.begin() as conn:
        moves.abort(conn)
        moves.prepare(conn, SCHEMA)
    (job,) = _seed(engine)
    control = _function_routed_statement()
    head = after_it_waits(engine, moves.enter_mixed, lambda: _first_row(engine, control, job))
    assert (head.queue_storage, head.id) == (False, job)
    assert _where(engine, job) == ["awa.scheduled_jobs"]
    # The one statement: it locks the flipped row, moves nothing, and the call migrates.
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM awa.scheduled_jobs"))  # abort needs both planes empty
        moves.abort(conn)
        moves.prepare(conn, SCHEMA)
    jobs = _seed(engine, 3 if caller == "batch" else 1)
    outcomes = after_it_waits(engine, moves.enter_mixed, lambda: call(jobs))
    assert [type(o) for o in outcomes] == [Migrated] * len(jobs)
    for job_id, outcome in zip(jobs, outcomes, strict=True):
        assert _where(engine, job_id) == []
        assert _deferred(engine, outcome.job_id) == 1


def _scalar(engine: sa.Engine, stmt: sa.TextClause) -> Any:
    with engine.begin() as conn:
        return conn.execute(stmt).scalar_one()


def _first_row(engine: sa.Engine, sql: str, job: int) -> Any:
    params = item_binds([MoveItem(job, 2, "snooze", 30.0, None, None)])
    with engine.begin() as conn:
        return conn.exec_driver_sql(sql, dict(params)).all()[0]


# -- rows identical to the two-statement path's ---------------------------------------------

KINDS: list[Kind] = [Snooze(30), RetryAfter(45.5), RetryBackoff()]
SHAPES: dict[str, dict[str, Any]] = {
    "plain": {},
    "errors appended to NULL": {"errors": None},
    "errors appended, progress replaced": {
        "errors": ('{"error": "old", "attempt": 1}',),
        "progress": '{"page": 1}',
    },
    "claims the next state": {"unique_key": b"next", "unique_states": "11111000"},
    "claim released": {"unique_key": b"released", "unique_states": "00100000"},
    "callback wiring": {"callbacks": ["callback_id", "callback_on_fail"]},
    "finalized_at carried": {"finalized_at": "2020-01-01T00:00:00Z"},
    "metadata and tags": {"metadata": '{"tenant": "acme"}', "tags": ("t1", "t2")},
    "stale lease": {"run_lease": 9},
}


def _shapes(conn: sa.Connection) -> list[Attempt]:
    items = []
    for kind_index, kind in enumerate(KINDS):
        for name, given in SHAPES.items():
            shape = dict(given)
            if "unique_key" in shape:
                shape["unique_key"] += b"-%d" % kind_index
            job = insert_job(conn, attempt=17, **shape)  # backoff: exactly the 24 h cap
            error = {"error": name, "attempt": 17} if "errors" in name else None
            items.append(Attempt(job, 1, kind, error=error, progress={"p": name}))
    return items


def _apply(engine: sa.Engine, items: list[Attempt], *, at_once: bool, batch: bool) -> Run:
    """Apply *items* in one transaction of the Connection form, by either path."""
    calls = prepare_all(items)
    # The Connection form, or the two-statement path it goes on with (the lock, then routing).
    flow = forms.in_transaction if at_once else awa_flow.go_on
    try:
        with engine.begin() as conn:
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            outcomes = flow(conn, calls) if batch else [flow(conn, [c])[0] for c in calls]
        normal: list[Any] | None = [_normal_outcome(cast(Outcome, o), now) for o in outcomes]
        error = None
    except AwaSAError as exc:
        normal, error, now = None, type(exc), NO_NOW
    with engine.connect() as conn:
        return Run(normal, error, tables(conn, now))


@pytest.mark.parametrize("phase", ["canonical", "prepared"])
def test_rows_are_the_two_statement_paths_for_every_kind_and_shape(
    cluster: Cluster, clone_database: Callable[[str], str], phase: str
) -> None:
    cluster.set_phase(phase, SCHEMA)
    with cluster.engine.begin() as conn:
        items = _shapes(conn)
    cluster.engine.dispose()  # a database can be cloned only without open connections
    clones = [sa.create_engine(clone_database(cluster.dbname), poolclass=sa.NullPool)]
    clones += [sa.create_engine(clone_database(cluster.dbname), poolclass=sa.NullPool)]
    clones += [sa.create_engine(clone_database(cluster.dbname), poolclass=sa.NullPool)]
    for batch, (ours, theirs) in ((False, (cluster.engine, clones[0])), (True, clones[1:])):
        # Driver SQL only: the library's own (the test's are Core).
        with recording(ours, step, events=(), driver_sql_only=True) as sent:
            one = _apply(ours, items, at_once=True, batch=batch)
        if ours is cluster.engine:
            assert sent == ["one statement"] * len(items)  # the one statement only
        two = _apply(theirs, items, at_once=False, batch=batch)
        assert one.error is two.error is None
        assert one.outcomes == two.outcomes
        assert one.tables == two.tables
        assert one.outcomes is not None
        kinds = [o if isinstance(o, str) else o[0] for o in one.outcomes]
        assert kinds.count("Stale") == len(KINDS)
        assert kinds.count("Rescheduled") == len(items) - len(KINDS)
    for clone in clones:
        clone.dispose()


# -- the guard ------------------------------------------------------------------------------

_ENGINE_BODY = "awa.active_storage_engine()"
_SCHEMA_BODY = "awa.active_queue_storage_schema()"


def _replace(conn: sa.Connection, function: str, body: str) -> None:
    language = "sql" if function == _ENGINE_BODY else "plpgsql"
    conn.exec_driver_sql(
        f"CREATE OR REPLACE FUNCTION {function} RETURNS text LANGUAGE {language} STABLE "
        f"SET search_path = pg_catalog, awa AS $fn${body}$fn$"
    )


def _installed(conn: sa.Connection, function: str) -> str:
    sql = "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(:f)"
    return str(conn.execute(sa.text(sql), {"f": function}).scalar_one())


@pytest.mark.parametrize("function", [_ENGINE_BODY, _SCHEMA_BODY])
def test_an_ending_asks_a_replaced_routing_function(cluster: Cluster, function: str) -> None:
    """An ending calls the routing function only where the copied bodies do not say canonical.
    A replaced body is asked: one that routes to queue storage has a bare pair's ending look
    for an open claim there first, then end it (there is none)."""
    engine = cluster.engine
    jobs = _seed(engine, 2)
    with engine.begin() as conn:
        original = _installed(conn, function)
    try:
        with recording(engine, step, events=()) as seen:
            assert settle_canonical_attempt(engine, jobs[0], 2, Complete()) == Completed(jobs[0])
        assert seen == ["end"]
        with engine.begin() as conn:
            if function == _ENGINE_BODY:
                _replace(conn, function, "SELECT 'queue_storage'::text")
            else:
                _replace(conn, function, f"BEGIN RETURN '{SCHEMA}'; END")
        with recording(engine, step, events=()) as seen:
            assert settle_canonical_attempt(engine, jobs[1], 2, Complete()) == Completed(jobs[1])
        assert seen == ["end", "open claims", "end"]
    finally:
        with engine.begin() as conn:
            _replace(conn, function, original)


@pytest.fixture
def labelled(cluster: Cluster) -> Iterator[list[str]]:
    with recording(cluster.engine, step, events=()) as seen:
        yield seen


@pytest.mark.parametrize("function", [_ENGINE_BODY, _SCHEMA_BODY])
def test_a_replaced_routing_function_is_asked_instead(
    cluster: Cluster, labelled: list[str], function: str
) -> None:
    engine = cluster.engine
    jobs = _seed(engine, 4)
    with engine.begin() as conn:
        original = _installed(conn, function)
        # The same body with a comment: the same routing, but not the bytes the copy is from.
        _replace(conn, function, original + "-- replaced\n")
    labelled.clear()
    out = reschedule_canonical_attempt(engine, jobs[0], 2, Snooze(30))
    assert isinstance(out, Rescheduled)
    assert labelled == ["one statement", "lock", "routing+move"]
    with engine.begin() as conn:
        labelled.clear()
        assert isinstance(reschedule_canonical_attempt(conn, jobs[1], 2, Snooze(30)), Rescheduled)
        assert labelled == ["one statement", "lock", "routing+move"]
        # A body that routes elsewhere: the call follows the installed function, as before.
        if function == _ENGINE_BODY:
            _replace(conn, function, "SELECT 'queue_storage'::text")
        else:
            _replace(conn, function, f"BEGIN RETURN '{SCHEMA}'; END")
    migrated = reschedule_canonical_attempts(engine, [Attempt(j, 2, Snooze(30)) for j in jobs[2:]])
    assert [type(o) for o in migrated] == [Migrated, Migrated]
    expected = SCHEMA if function == _SCHEMA_BODY else "awa"  # details {}: the last fallback
    with engine.connect() as conn:
        for outcome in migrated:
            assert isinstance(outcome, Migrated)
            sql = f"SELECT count(*) FROM {expected}.deferred_jobs WHERE job_id = :i"
            assert conn.execute(sa.text(sql), {"i": outcome.job_id}).scalar_one() == 1
    # The original bytes again: the one statement is trusted again.
    with engine.begin() as conn:
        _replace(conn, function, original)
    labelled.clear()
    assert reschedule_canonical_attempt(engine, 10**12, 2, Snooze(30)) == Stale()
    assert labelled == ["one statement"]


# -- failures --------------------------------------------------------------------------------


def test_a_unique_conflict_in_autocommit_changes_nothing(cluster: Cluster) -> None:
    engine = cluster.engine
    with engine.begin() as conn:
        insert_holder(conn, b"held", "11000000")
        job = insert_job(conn, unique_key=b"held", unique_states="11000000")
    before = take_snapshot(engine)
    with pytest.raises(UniqueConflict):
        reschedule_canonical_attempt(engine, job, 1, Snooze(5))
    with pytest.raises(UniqueConflict):
        reschedule_canonical_attempts(engine, [Attempt(job, 1, Snooze(5))] * 2)
    assert take_snapshot(engine) == before
    assert _where(engine, job) == ["awa.jobs_hot"]
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    with engine.connect() as conn:  # the pooled connection was put back out of autocommit
        assert conn.connection.dbapi_connection.autocommit is False  # type: ignore[union-attr]


def test_repeatable_read_after_a_transition_is_a_serialization_failure(cluster: Cluster) -> None:
    engine = cluster.engine
    moves = RealTransitions(engine)
    (job,) = _seed(engine)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            conn.execute(sa.text("SELECT count(*) FROM awa.jobs_hot")).scalar()  # the snapshot
            with engine.begin() as other:
                moves.prepare(other, SCHEMA)  # the singleton changes after the snapshot
            before = take_snapshot(engine)
            with pytest.raises(DatabaseError) as failed:
                reschedule_canonical_attempt(conn, job, 2, Snooze(5))
            assert failed.value.sqlstate == "40001"
    assert take_snapshot(engine) == before
    assert _where(engine, job) == ["awa.jobs_hot"]


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_an_engine_set_to_another_isolation_level_keeps_its_transaction(
    cluster: Cluster, level: str
) -> None:
    """A lone statement in autocommit would run READ COMMITTED: such an engine gets BEGIN,
    the one statement at its own level, and COMMIT."""
    made = sa.create_engine(cluster.url, isolation_level=level)
    base = sa.create_engine(cluster.url)
    for engine, hooked in ((made, made), (base.execution_options(isolation_level=level), base)):
        (job,) = _seed(cluster.engine)
        with recording(hooked) as seen:
            assert isinstance(reschedule_canonical_attempt(engine, job, 2, Snooze(5)), Rescheduled)
        assert seen == ["BEGIN", "WITH", "COMMIT"]
    made.dispose()
    base.dispose()
