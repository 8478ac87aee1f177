"""Real races (issue #3): two connections, a held lock, a thread, and the server's word for it.

Every race is forced, never hoped for: one side takes its lock inside an open transaction, the
other runs in a thread, and the test waits until ``pg_stat_activity`` shows the second blocked
by the first before letting the first finish (see ``racing.py``). Each scenario runs on a real
``awa migrate`` cluster, its transitions through Awa's own ``awa.storage_*`` functions (the
``cluster`` fixture in tests/conftest.py says why not on the Alembic fixture too).

Cloning a database costs about a second (the real template has ~2700 relations), so each test
walks one database through several scenarios -- canonical routing first, then queue storage --
rather than paying a clone per scenario.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import advance_sequence, insert_job
from racing import (
    RealTransitions,
    Transitions,
    after_it_waits,
    assert_unchanged,
    held,
    in_thread,
    routing,
    snapshot,
    take_snapshot,
    wait_until_blocked,
)

from awa_sa import (
    CancelledDuplicate,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    reschedule_canonical_attempt,
)

QS_ID_BASE = 700_000
"""Fresh queue-storage ids start here, far from canonical ids (no coincidental claim matches)."""

_keys = itertools.count()


def _key() -> bytes:
    return b"race-key-%d" % next(_keys)


def _seed(engine: sa.Engine, **kw: Any) -> tuple[int, int]:
    """One running attempt (attempt 3, lease 7); queue-storage ids moved out of its way."""
    with engine.begin() as conn:
        for schema in ("awa", "awa_qs"):
            row = conn.execute(sa.text(f"SELECT last_value FROM {schema}.job_id_seq")).one()
            if row.last_value < QS_ID_BASE:
                advance_sequence(conn, f"{schema}.job_id_seq", QS_ID_BASE)
        job_id = insert_job(conn, attempt=3, run_lease=7, **kw)
    return job_id, 7


def _where(
    conn: sa.Connection, job_id: int, schemas: tuple[str, ...] = ("awa", "awa_qs")
) -> dict[str, int]:
    """How many rows with *job_id* each table holds (tables without one are left out)."""
    found: dict[str, int] = {}
    tables = ["awa.jobs_hot", "awa.scheduled_jobs"]
    tables += [f"{s}.{t}" for s in schemas for t in ("deferred_jobs", "done_entries")]
    for table in tables:
        col = "id" if table in ("awa.jobs_hot", "awa.scheduled_jobs") else "job_id"
        n = int(
            conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE {col} = :i"), {"i": job_id}
            ).scalar_one()
        )
        if n:
            found[table] = n
    return found


def _next_id(conn: sa.Connection, schema: str) -> int:
    """The value ``nextval`` would hand out next from ``<schema>.job_id_seq``."""
    row = conn.execute(sa.text(f"SELECT last_value, is_called FROM {schema}.job_id_seq")).one()
    return int(row.last_value) + (1 if row.is_called else 0)


def _marks(conn: sa.Connection) -> tuple[int, int]:
    row = conn.execute(
        sa.text(
            "SELECT (SELECT count(*) FROM awa.admin_dirty_queue_marks), "
            "(SELECT count(*) FROM awa.admin_dirty_kind_marks)"
        )
    ).one()
    return int(row[0]), int(row[1])


def _claims(conn: sa.Connection, key: bytes) -> list[int]:
    return list(
        conn.execute(
            sa.text("SELECT job_id FROM awa.job_unique_claims WHERE unique_key = :k"), {"k": key}
        ).scalars()
    )


def _state(conn: sa.Connection, schema: str | None, job_id: int) -> tuple[str, int]:
    table, col = (
        ("awa.scheduled_jobs", "id") if schema is None else (f"{schema}.deferred_jobs", "job_id")
    )
    row = conn.execute(
        sa.text(f"SELECT state::text, attempt FROM {table} WHERE {col} = :i"), {"i": job_id}
    ).one()
    return str(row[0]), int(row[1])


def _assert_successor(conn: sa.Connection, schema: str | None, job_id: int, won: Outcome) -> int:
    """The attempt's successor exists exactly once, where the routing says, and nowhere else.

    Returns the successor's id: the same job re-scheduled, or its new id in queue storage.
    """
    if schema is None:
        assert isinstance(won, Rescheduled)
        assert won.job_id == job_id
        assert _where(conn, job_id) == {"awa.scheduled_jobs": 1}
    else:
        assert isinstance(won, Migrated)
        assert _where(conn, job_id) == {}
        assert _where(conn, won.job_id) == {f"{schema}.deferred_jobs": 1}
    return won.job_id


def _enter(cluster: Cluster, schema: str | None) -> None:
    if schema is not None:
        cluster.set_phase("mixed_transition", schema)


# --------------------------------------------------------------------------------------------
# Two completions of one attempt


def _loser_waits_then_stale(engine: sa.Engine, schema: str | None) -> None:
    """The loser blocks on the winner's row lock; when the winner commits it finds nothing."""
    key = _key()
    job_id, lease = _seed(engine, unique_key=key, unique_states="11111000")
    with engine.connect() as conn:
        marks = _marks(conn)
        next_id = _next_id(conn, schema) if schema else None

    with held(engine) as winner_tx:
        won = reschedule_canonical_attempt(winner_tx.conn, job_id, lease, Snooze(30))
        loser = in_thread(
            lambda: reschedule_canonical_attempt(engine, job_id, lease, RetryAfter(5))
        )
        waiters = wait_until_blocked(engine, winner_tx.pid, pending=[loser])
        assert waiters[0].row_of == "awa.jobs_hot"  # waiting on the attempt's row, not routing
        winner_tx.commit()
    assert loser.result(timeout=20) == Stale()

    with engine.connect() as conn:
        successor = _assert_successor(conn, schema, job_id, won)
        assert _state(conn, schema, successor) == ("scheduled", 2)  # the winner's Snooze
        assert _claims(conn, key) == [successor]  # claimed once, by the successor
        # Dirty marks of exactly one canonical write: the stale loser appends none.
        q, k = _marks(conn)
        per_write = 2 if schema is None else 1  # delete + insert, or delete only
        assert (q - marks[0], k - marks[1]) == (per_write, per_write)
        if schema is not None:
            # One id consumed, by the winner; the loser never reached nextval.
            assert next_id is not None
            assert successor == next_id
            assert _next_id(conn, schema) == next_id + 1


def _loser_proceeds_after_rollback(engine: sa.Engine, schema: str | None) -> None:
    """If the first completion rolls back, the waiting one applies (docs/contract.md#stale, 1)."""
    key = _key()
    job_id, lease = _seed(engine, unique_key=key, unique_states="11111000")

    with held(engine) as first:
        reschedule_canonical_attempt(first.conn, job_id, lease, Snooze(30))
        second = in_thread(
            lambda: reschedule_canonical_attempt(engine, job_id, lease, RetryAfter(5))
        )
        wait_until_blocked(engine, first.pid, pending=[second])
        first.rollback()
    won = second.result(timeout=20)

    with engine.connect() as conn:
        successor = _assert_successor(conn, schema, job_id, won)
        assert _state(conn, schema, successor) == ("retryable", 3)
        assert _claims(conn, key) == [successor]


def _free_races(engine: sa.Engine, schema: str | None, n: int = 8) -> None:
    """Both completions released together by a barrier, on many attempts: never two winners."""
    keys = [_key() for _ in range(n)]
    jobs = [_seed(engine, unique_key=k, unique_states="11111000")[0] for k in keys]
    kinds = [Snooze(1), RetryAfter(2), RetryBackoff()]
    with engine.connect() as conn:
        next_id = _next_id(conn, schema) if schema else 0

    def race(job_id: int, pair: tuple[Any, Any]) -> list[Outcome]:
        barrier = threading.Barrier(2, timeout=20)

        def complete(kind: Any) -> Outcome:
            barrier.wait()
            return reschedule_canonical_attempt(engine, job_id, 7, kind)

        futures = [in_thread(functools.partial(complete, k)) for k in pair]
        return [f.result(timeout=20) for f in futures]

    results = {j: race(j, (kinds[i % 3], kinds[(i + 1) % 3])) for i, j in enumerate(jobs)}

    with engine.connect() as conn:
        for (job_id, outs), key in zip(results.items(), keys, strict=True):
            winners = [o for o in outs if not isinstance(o, Stale)]
            assert len(winners) == 1, (job_id, outs)
            _assert_successor(conn, schema, job_id, winners[0])
            assert _claims(conn, key) == [winners[0].job_id]
        if schema is not None:
            assert _next_id(conn, schema) == next_id + n  # one id per winner, none per loser


def _duplicate_successors(engine: sa.Engine, schema: str) -> None:
    """Two attempts whose successors want one key: the second waits on the first's uncommitted
    claim, then records a cancelled duplicate. The key ends up claimed exactly once.
    """
    key = _key()
    # Running is outside the mask: neither attempt holds the key while it runs.
    a, _ = _seed(engine, unique_key=key, unique_states="11000000")
    b, _ = _seed(engine, unique_key=key, unique_states="11000000")

    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, a, 7, Snooze(1))
        assert isinstance(won, Migrated)
        second = in_thread(lambda: reschedule_canonical_attempt(engine, b, 7, Snooze(1)))
        waiters = wait_until_blocked(engine, first.pid, pending=[second])
        assert "job_unique_claims" in waiters[0].query
        first.commit()
    dup = second.result(timeout=20)

    assert isinstance(dup, CancelledDuplicate)
    with engine.connect() as conn:
        assert _claims(conn, key) == [won.job_id]
        assert _where(conn, dup.job_id) == {f"{schema}.done_entries": 1}
        row = conn.execute(
            sa.text(
                f"SELECT state::text, unique_states FROM {schema}.done_entries WHERE job_id = :i"
            ),
            {"i": dup.job_id},
        ).one()
        assert tuple(row) == ("cancelled", "11000000")
        assert _where(conn, a) == {}
        assert _where(conn, b) == {}


def test_two_completions_of_one_attempt(cluster: Cluster) -> None:
    """Exactly one completion wins, the other is Stale, and no row is duplicated anywhere;
    first with canonical routing, then with routing flipped to the named schema ``awa_qs``.
    """
    for schema in (None, "awa_qs"):
        _enter(cluster, schema)
        _loser_waits_then_stale(cluster.engine, schema)
        _loser_proceeds_after_rollback(cluster.engine, schema)
        _free_races(cluster.engine, schema)
    _duplicate_successors(cluster.engine, "awa_qs")


# --------------------------------------------------------------------------------------------
# A rescue bumps run_lease mid-flight

RESCUE = (
    "UPDATE awa.jobs_hot SET run_lease = run_lease + 1, attempt = attempt + 1, "
    "heartbeat_at = now(), attempted_at = now() WHERE id = :i AND state = 'running'"
)


def _rescue_first(engine: sa.Engine, schema: str | None) -> None:
    """The rescue row-locks the attempt and bumps its lease; the waiting reschedule is Stale."""
    key = _key()
    job_id, lease = _seed(engine, unique_key=key, unique_states="11111000")
    before = take_snapshot(engine)

    with held(engine) as rescue:
        assert rescue.execute(RESCUE, {"i": job_id}).rowcount == 1
        late = in_thread(lambda: reschedule_canonical_attempt(engine, job_id, lease, Snooze(9)))
        waiters = wait_until_blocked(engine, rescue.pid, pending=[late])
        assert waiters[0].row_of == "awa.jobs_hot"
        rescue.commit()
    assert late.result(timeout=20) == Stale()

    # Nothing but the rescue's own change to the jobs_hot row (no marks, no claims, no rows).
    after = take_snapshot(engine)
    assert_unchanged(
        {k: v for k, v in before.items() if k != "awa.jobs_hot"},
        {k: v for k, v in after.items() if k != "awa.jobs_hot"},
    )
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT state::text, run_lease, attempt FROM awa.jobs_hot WHERE id = :i"),
            {"i": job_id},
        ).one()
        assert tuple(row) == ("running", lease + 1, 4)
        assert _claims(conn, key) == [job_id]
        assert _where(conn, job_id) == {"awa.jobs_hot": 1}


def _reschedule_first(engine: sa.Engine, schema: str | None) -> None:
    """The converse order: the rescue waits on the reschedule and then finds no running row."""
    job_id, lease = _seed(engine)

    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, job_id, lease, RetryAfter(60))
        rescue = in_thread(lambda: _rowcount(engine, RESCUE, {"i": job_id}))
        wait_until_blocked(engine, first.pid, pending=[rescue])
        first.commit()
    assert rescue.result(timeout=20) == 0
    with engine.connect() as conn:
        successor = _assert_successor(conn, schema, job_id, won)
        assert _state(conn, schema, successor) == ("retryable", 3)


def _rowcount(engine: sa.Engine, stmt: str, params: dict[str, Any]) -> int:
    with engine.begin() as conn:
        return int(conn.execute(sa.text(stmt), params).rowcount)


def test_rescue_bumping_run_lease_mid_flight(cluster: Cluster) -> None:
    for schema in (None, "awa_qs"):
        _enter(cluster, schema)
        _rescue_first(cluster.engine, schema)
        _reschedule_first(cluster.engine, schema)


# --------------------------------------------------------------------------------------------
# Storage transitions holding the singleton, in both orders


def _qs_rows(conn: sa.Connection, schema: str) -> dict[str, int]:
    tables = ("deferred_jobs", "done_entries", "queue_terminal_count_deltas", "queue_lanes")
    return {
        t: int(conn.execute(sa.text(f"SELECT count(*) FROM {schema}.{t}")).scalar_one())
        for t in tables
    }


def _drain_canonical(conn: sa.Connection) -> None:
    conn.execute(sa.text("DELETE FROM awa.scheduled_jobs"))


def _commit(engine: sa.Engine, step: Callable[[sa.Connection], None]) -> None:
    with engine.begin() as conn:
        step(conn)


def _times_out(engine: sa.Engine, transition: Callable[[sa.Connection], None]) -> None:
    """The transition cannot get the singleton while a reschedule holds it: 55P03."""
    with held(engine, lock_timeout_ms=150) as tx:
        with pytest.raises(sa.exc.OperationalError) as info:
            transition(tx.conn)
        assert getattr(info.value.orig, "sqlstate", None) == "55P03"


def _phase(engine: sa.Engine) -> tuple[str | None, str | None]:
    with engine.connect() as conn:
        state, _, schema = routing(conn)
    return state, schema


def _abort_first(engine: sa.Engine, moves: Transitions, schema: str) -> None:
    """The key assertion: after the abort commits, the waiter routes canonical, same id.

    With Awa 0.6's one-statement read the waiter would use its pre-wait snapshot and migrate
    the job into the schema abort just deactivated (see :func:`_control_one_statement_read`).
    """
    key = _key()
    job_id, lease = _seed(engine, unique_key=key, unique_states="11111000")
    with engine.connect() as conn:
        next_id = _next_id(conn, schema)
        qs_before = _qs_rows(conn, schema)

    out = after_it_waits(
        engine,
        moves.abort,
        lambda: reschedule_canonical_attempt(engine, job_id, lease, RetryBackoff()),
    )

    assert isinstance(out, Rescheduled)
    assert (out.job_id, out.attempt) == (job_id, 3)
    assert _phase(engine) == ("canonical", None)
    with engine.connect() as conn:
        assert _where(conn, job_id) == {"awa.scheduled_jobs": 1}
        assert _state(conn, None, job_id) == ("retryable", 3)
        assert _qs_rows(conn, schema) == qs_before  # nothing stranded in queue storage
        assert _next_id(conn, schema) == next_id
        assert _claims(conn, key) == [job_id]
        assert not conn.execute(
            sa.text("SELECT count(*) FROM awa.runtime_storage_backends")
        ).scalar()


def _callback_job_first_then_abort(engine: sa.Engine, moves: Transitions) -> None:
    """Reschedule first: abort waits. A callback-wired job stays canonical under mixed routing,
    so queue storage is still empty when the abort gets the lock, and the abort passes.
    """
    job_id, lease = _seed(engine, callbacks=("callback_id", "callback_timeout_at"))
    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, job_id, lease, Snooze(5))
        _times_out(engine, moves.abort)
        aborted = in_thread(lambda: _commit(engine, moves.abort))
        wait_until_blocked(engine, first.pid, pending=[aborted])
        first.commit()
    aborted.result(timeout=20)
    assert isinstance(won, Rescheduled)
    assert (won.job_id, won.attempt) == (job_id, 2)
    assert _phase(engine) == ("canonical", None)
    with engine.connect() as conn:
        assert _where(conn, job_id) == {"awa.scheduled_jobs": 1}


def _control_one_statement_read(engine: sa.Engine, moves: Transitions, schema: str) -> None:
    """Control: the rig does catch the hazard. Awa 0.6's one-statement locking read, blocked by
    the same abort, returns the schema that abort has just deactivated
    (docs/contract.md#routing-read).
    """
    read = sa.text(
        "SELECT awa.active_queue_storage_schema() FROM awa.storage_transition_state "
        "WHERE singleton FOR SHARE"
    )

    def one_statement() -> str | None:
        with engine.begin() as conn:
            schema: str | None = conn.execute(read).scalar_one()
        return schema

    assert after_it_waits(engine, moves.abort, one_statement) == schema
    assert _phase(engine) == ("canonical", None)


def _enter_mixed_first(engine: sa.Engine, moves: Transitions, schema: str) -> None:
    """Routing flips while the reschedule waits: it reads the committed flip and migrates."""
    key = _key()
    job_id, lease = _seed(engine, unique_key=key, unique_states="11111000")
    with engine.connect() as conn:
        next_id = _next_id(conn, schema)
    out = after_it_waits(
        engine,
        moves.enter_mixed,
        lambda: reschedule_canonical_attempt(engine, job_id, lease, Snooze(30)),
    )
    assert isinstance(out, Migrated)
    assert (out.job_id, out.attempt) == (next_id, 2)
    assert _phase(engine) == ("mixed_transition", schema)
    with engine.connect() as conn:
        _assert_successor(conn, schema, job_id, out)
        assert _claims(conn, key) == [out.job_id]


def _reschedule_first_then_enter_mixed(engine: sa.Engine, moves: Transitions, schema: str) -> None:
    """Reschedule first: enter-mixed times out, then waits, then flips after the commit."""
    job_id, lease = _seed(engine)
    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, job_id, lease, RetryAfter(5))
        _times_out(engine, moves.enter_mixed)
        flipped = in_thread(lambda: _commit(engine, moves.enter_mixed))
        wait_until_blocked(engine, first.pid, pending=[flipped])
        first.commit()
    flipped.result(timeout=20)
    assert isinstance(won, Rescheduled)
    assert (won.job_id, won.attempt) == (job_id, 3)
    assert _phase(engine) == ("mixed_transition", schema)
    with engine.connect() as conn:
        # Written canonically before the flip: it drains from the canonical plane.
        assert _where(conn, job_id) == {"awa.scheduled_jobs": 1}
        assert _qs_rows(conn, schema)["deferred_jobs"] == 0


def _reschedule_first_then_abort_refuses(
    engine: sa.Engine, moves: Transitions, schema: str
) -> None:
    """Reschedule first: abort times out, then waits, then refuses, because the migrated
    successor now sits in queue storage. The job is not stranded; routing stays flipped.
    """
    job_id, lease = _seed(engine)
    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, job_id, lease, Snooze(5))
        assert isinstance(won, Migrated)
        _times_out(engine, moves.abort)
        before = snapshot(first.conn)  # what the reschedule is about to commit
        refused = in_thread(lambda: _commit(engine, moves.abort))
        wait_until_blocked(engine, first.pid, pending=[refused])
        first.commit()
    error = refused.exception(timeout=20)
    assert error is not None, "abort passed with a migrated job in queue storage"
    assert isinstance(error, sa.exc.DBAPIError), error
    assert _phase(engine) == ("mixed_transition", schema)
    with engine.connect() as conn:
        assert _where(conn, won.job_id) == {f"{schema}.deferred_jobs": 1}
        assert_unchanged(before, snapshot(conn))


def _reschedule_first_then_finalize(engine: sa.Engine, moves: Transitions, schema: str) -> None:
    """Finalize needs zero canonical backlog. The last running attempt migrates while holding
    the singleton; finalize times out meanwhile, and passes once the migration committed.
    """
    job_id, lease = _seed(engine)
    with held(engine) as first:
        won = reschedule_canonical_attempt(first.conn, job_id, lease, RetryBackoff())
        assert isinstance(won, Migrated)
        _times_out(engine, moves.finalize)
        first.commit()
    with engine.connect() as conn:
        assert _where(conn, won.job_id) == {f"{schema}.deferred_jobs": 1}
    _finalize_first_late_completion(engine, moves, schema, job_id, lease)


def _finalize_first_late_completion(
    engine: sa.Engine, moves: Transitions, schema: str, job_id: int, lease: int
) -> None:
    """Finalize holds the singleton; a late completion of the migrated attempt waits for it,
    then matches nothing and changes nothing.
    """
    before = take_snapshot(engine)
    out = after_it_waits(
        engine,
        moves.finalize,
        lambda: reschedule_canonical_attempt(engine, job_id, lease, RetryAfter(1)),
    )
    assert out == Stale()
    assert _phase(engine) == ("active", schema)
    moved = {"awa.storage_transition_state"}  # finalize's own write
    after = take_snapshot(engine)
    assert_unchanged(
        {k: v for k, v in before.items() if k not in moved},
        {k: v for k, v in after.items() if k not in moved},
    )


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
def test_transitions_racing_a_reschedule(cluster: Cluster, schema: str) -> None:
    """Enter-mixed, abort and finalize each hold the singleton while a reschedule waits, and
    each waits while a reschedule holds it. One cluster walks through a whole transition:

    1. mixed; abort holds, a reschedule waits and then routes canonical (the key assertion);
    2. mixed again; a callback job's reschedule holds, abort times out, waits, then passes;
    3. mixed again; abort holds, Awa's one-statement read waits and reads stale (control);
    4. prepared; a reschedule holds, enter-mixed times out, waits, then flips; abort again;
    5. prepared; enter-mixed holds, a reschedule waits and then migrates;
    6. a reschedule holds, abort times out, waits, then refuses: queue storage is not empty;
    7. drain; the last attempt's reschedule holds and finalize times out; then finalize holds
       while a late completion of that attempt waits, and is Stale.
    """
    engine = cluster.engine
    moves = RealTransitions(engine)

    def prepare() -> None:
        _commit(engine, lambda c: moves.prepare(c, schema))

    cluster.set_phase("mixed_transition", schema)
    _abort_first(engine, moves, schema)
    prepare()
    _commit(engine, moves.enter_mixed)
    _callback_job_first_then_abort(engine, moves)
    prepare()
    _commit(engine, moves.enter_mixed)
    _control_one_statement_read(engine, moves, schema)
    prepare()
    _reschedule_first_then_enter_mixed(engine, moves, schema)
    _commit(engine, moves.abort)  # queue storage is still empty: only canonical writes so far
    prepare()
    _enter_mixed_first(engine, moves, schema)
    _reschedule_first_then_abort_refuses(engine, moves, schema)
    # Finalize refuses while canonical rows remain (its backlog gate); the canonical plane's
    # drain is emulated by deleting the rows re-scheduled canonically above.
    _commit(engine, _drain_canonical)
    _reschedule_first_then_finalize(engine, moves, schema)
