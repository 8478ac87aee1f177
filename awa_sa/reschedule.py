"""The reschedule decision flow over a sync ``Connection`` (docs/contract.md, docs/architecture.md).

The flow asks :mod:`awa_sa.statements` for a statement, executes it, and decides what the result
means. This is the only place that knows an ``Engine`` (own transaction, committed) from a
``Connection`` (the caller's transaction, never committed); the async face runs :func:`run_all`
through ``AsyncConnection.run_sync`` rather than repeating it.

A single call is a batch of one, and a batch's outcomes and rows are those of its attempts
re-scheduled one after another in the same transaction. The statements bind scalars for one
row and arrays for more (:mod:`awa_sa.statements`); the flow is the same.

Statements per path, for a batch of any size:

* canonical: 1 -- the one statement (docs/contract.md#one-statement): the routing lock, routing
  from the locked row, a guard on the routing functions' bodies, and the move. The Engine form
  sends it alone in autocommit: one round trip.
* queue storage: the one statement (it moves nothing), then the routing read under the lock it
  took (the Engine form: in a new transaction, the lock and the read, one statement more), then
  under a savepoint the take/allocation of every row; the canonical move of the attempts it did
  not take (callback wiring, guard misses), if any; and under the deferred-rows savepoint the
  claims (if any row claims) and the deferred rows. A lost claim rolls that savepoint back and
  redoes it without that row (+3), which then takes the single-attempt cancelled-duplicate path:
  ring read, 5 lane statements, clock, the cancelled-row savepoint with its claim and the
  cancelled row (+ delta), or the last resort.
* routing functions not the known ones: the one statement, then the lock and the routing read
  as before it existed.

Two rows of one batch that share a unique key make the order of claim releases and acquisitions
matter (one by one, a row that still holds the key while running blocks an earlier item that
claims it; set-wise, every release would come first), which set-wise statements cannot
reproduce. The move or take then touches nothing and says so, and the batch goes one attempt at
a time: one move, or one take (and its writes), per attempt.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy.exc import UnboundExecutionError

from awa_sa import statements
from awa_sa.compiled import execute
from awa_sa.drivers import check_dialect
from awa_sa.errors import (
    CONNECTION_LOST,
    DatabaseError,
    UniqueConflict,
    ValidationError,
    translated,
)
from awa_sa.kinds import (
    Attempt,
    CancelledDuplicate,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    check_delay,
)
from awa_sa.queue_storage import translate_map
from awa_sa.results import (
    ClaimedWrite,
    Held,
    Moved,
    Taken,
    TakenJob,
    Unexplained,
    Written,
)
from awa_sa.tables import JOB_STATES

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("awa_sa")

_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""``\\u0000`` as an escape in JSON text, not a literal backslash followed by ``u0000``."""
_DAY = 86_400.0
# psycopg must be able to hand run_at back as a Python datetime; a day of slack covers any
# difference between our clock and the database's.
_RUN_AT_MIN = datetime(1, 1, 1, tzinfo=UTC).timestamp() + _DAY
_RUN_AT_MAX = datetime(9999, 12, 31, tzinfo=UTC).timestamp() - _DAY


@dataclass(frozen=True, slots=True)
class Call:
    """One validated request: everything the statements need, and nothing touched yet.

    ``params`` holds this attempt's element of each array in ``statements.ITEM_PARAMS``.
    """

    job_id: int
    kind: Kind
    params: Mapping[str, Any]


@dataclass(slots=True)
class _Trace:
    """What the debug records say; outcomes are named only when a record is written."""

    routing: str = "?"
    outcomes: list[Outcome] = field(default_factory=list)
    error: str | None = None


def prepare(
    job_id: object, run_lease: object, kind: object, error: object, progress: object
) -> Call:
    """Validate every input before anything reaches the database (docs/contract.md#validation)."""
    job_id = _bigint("job_id", job_id)
    run_lease = _bigint("run_lease", run_lease)
    delay: float | None = None
    tag: statements.KindTag
    if isinstance(kind, Snooze | RetryAfter):
        check_delay(kind.delay_secs)
        delay = float(kind.delay_secs)
        now = time.time()
        if not _RUN_AT_MIN - now <= delay <= _RUN_AT_MAX - now:
            raise ValidationError(
                f"delay_secs={kind.delay_secs!r} puts run_at outside years 1..9999"
            )
        tag = "snooze" if isinstance(kind, Snooze) else "retry_after"
    elif isinstance(kind, RetryBackoff):
        tag = "retry_backoff"
    else:
        raise ValidationError(f"kind must be Snooze, RetryAfter or RetryBackoff, got {kind!r}")
    params = {
        "guard_id": job_id,
        "guard_lease": run_lease,
        "b_tag": tag,
        "b_delay": delay,
        "b_error": _json_text("error", error),
        "b_progress": _json_text("progress", progress),
    }
    return Call(job_id=job_id, kind=kind, params=params)


def prepare_all(attempts: object) -> list[Call]:
    """Validate a whole batch before any statement; a refusal names the item's index."""
    if isinstance(attempts, str | bytes | Mapping) or not isinstance(attempts, Iterable):
        raise ValidationError(
            f"attempts must be an iterable of Attempt, got {type(attempts).__name__}"
        )
    calls = []
    for index, item in enumerate(attempts):
        if not isinstance(item, Attempt):
            raise ValidationError(
                f"attempts[{index}] must be an Attempt, got {type(item).__name__}"
            )
        try:
            calls.append(prepare(item.job_id, item.run_lease, item.kind, item.error, item.progress))
        except ValidationError as exc:
            raise ValidationError(f"attempts[{index}]: {exc}") from exc
    return calls


def check_bind(bind: object) -> None:
    if isinstance(bind, Engine | Connection):
        check_dialect(bind.dialect, is_async=False)
    elif isinstance(bind, _session_types()):
        check_dialect(session_dialect(bind), is_async=False)
    else:
        name = type(bind).__name__
        hint = " (use awa_sa.asyncio for it)" if name.startswith("Async") else ""
        raise ValidationError(
            f"bind must be a sqlalchemy Engine, Connection or Session, got {name}{hint}"
        )


def session_dialect(session: Session) -> Dialect:
    """The dialect of the engine a (sync, or an async one's sync) Session runs on."""
    try:
        return session.get_bind().dialect
    except UnboundExecutionError as exc:
        raise ValidationError(f"the Session has no engine to run on: {exc}") from exc


def _session_types() -> tuple[type[Session], ...]:
    """``sqlalchemy.orm.Session``, if imported: a bind can be a Session only once it is.

    Importing the ORM costs 0.1 s, which a Core service should not pay for awa-sa.
    """
    orm = sys.modules.get("sqlalchemy.orm")
    return () if orm is None else (orm.Session,)


def reschedule_canonical_attempt(
    bind: Engine | Connection | Session,
    job_id: int,
    run_lease: int,
    kind: Kind,
    *,
    error: Any = None,
    progress: Any = None,
) -> Outcome:
    """Re-schedule the running canonical attempt ``(job_id, run_lease)`` as *kind* asks.

    ``bind`` is an ``Engine`` (own transaction, committed on success), or a ``Connection`` or
    ORM ``Session`` (joins the caller's transaction, which is never committed here: commit it).
    ``error`` is one JSON value to append to the error list; ``progress`` replaces the stored
    progress (None clears it).

    Raises :class:`~awa_sa.errors.ValidationError`, :class:`~awa_sa.errors.UniqueConflict` or
    :class:`~awa_sa.errors.DatabaseError`; see :mod:`awa_sa.errors` for what each leaves behind.
    """
    check_bind(bind)
    return within(bind, [prepare(job_id, run_lease, kind, error, progress)])[0]


def reschedule_canonical_attempts(
    bind: Engine | Connection | Session, attempts: Iterable[Attempt]
) -> list[Outcome]:
    """Re-schedule many running canonical attempts in one transaction; one outcome per item.

    The outcomes, in input order, and the rows written are those of calling
    :func:`reschedule_canonical_attempt` for each item in turn inside one transaction: a
    repeated item is Stale the second time, and an item with a wrong lease is Stale even when a
    later item for the same job succeeds. Every item is validated before any statement runs
    (a refusal names the item's index). ``bind`` behaves as for the single call; an empty batch
    returns ``[]`` without touching the database.

    The cost does not grow in statements with the batch: 1 on the canonical path, about 10 in
    queue storage, plus the single-attempt path for each cancelled duplicate. The exception is
    a batch in which two rows share a unique key: the order then matters, so it goes one
    attempt at a time (same outcomes, one move or take per attempt). Large batches rely on
    ``awa.jobs_hot`` having statistics, as autovacuum keeps them: on a table bulk-loaded and
    never analysed, PostgreSQL can join items to rows in quadratic time.

    A batch locks the ``awa.jobs_hot`` rows it takes in ascending id order, all in one
    statement, so it cannot deadlock with another batch, or any locker of several rows that
    also goes by ascending id.

    What differs from one by one: the dirty marks (``awa.admin_dirty_*_marks``) are appended per
    statement, one per distinct queue and kind, so a batch appends fewer identical marks (the
    same set of queues and kinds, all with the same ``touched_at``, which is what maintenance
    recomputes from). When an item fails, the batch fails as a whole and nothing is kept, as
    one by one; which error is raised, if several items would fail, is not specified.
    """
    check_bind(bind)
    calls = prepare_all(attempts)
    return within(bind, calls) if calls else []


def within(bind: Engine | Connection | Session, calls: list[Call]) -> list[Outcome]:
    """The Engine form (own connection and transaction, committed) or the Connection form.

    A Session is the Connection form on the connection of its current transaction (begun if
    none is), savepoint included. Also the AsyncEngine form, run whole in one greenlet by
    :mod:`awa_sa.asyncio`. The Engine form first sends the one statement in autocommit (one
    round trip, committed by itself); only when it moved nothing and says the call must go on
    does it open a transaction.
    """
    if not isinstance(bind, Engine | Connection):
        with translated():  # a Session's autobegin checks a connection out
            bind = bind.connection()
    if isinstance(bind, Engine):
        # Engine.begin() without its generator-based context manager; checkout, BEGIN and
        # COMMIT translated too.
        with translated(), bind.connect() as conn:
            if _alone_in_autocommit(bind):
                done = _traced(conn, calls, lambda trace: _autocommit_flow(conn, calls, trace))
                if done is not None:
                    return done
                conn.rollback()  # ends SQLAlchemy's autobegun transaction; nothing to send
                with conn.begin():  # the one statement said to go on: today's path
                    return run_all(conn, calls, at_once=False)
            with conn.begin():
                return run_all(conn, calls)
    return run_all(bind, calls)  # which translates all it does


_SEVERAL_EXCHANGES = frozenset({"pg8000"})
"""Drivers that send one statement with parameters as several exchanges (pg8000: Parse and
Sync, then Bind, Execute and Sync). Outside a transaction a transaction-pooling PgBouncer may
hand each exchange to a different server connection: seen binding our parameters to another
client's unnamed statement (08P01). Inside BEGIN the server connection stays ours."""


def _alone_in_autocommit(engine: Engine) -> bool:
    """May the one statement run alone in autocommit, as it would inside this engine's BEGIN?

    A lone statement is its own READ COMMITTED transaction; an engine set to another
    isolation level (or to AUTOCOMMIT, which the transaction path refuses) keeps today's path,
    and so does a driver whose statement is not one exchange (:data:`_SEVERAL_EXCHANGES`).
    """
    if engine.dialect.driver in _SEVERAL_EXCHANGES:
        return False
    level = engine.get_execution_options().get("isolation_level")
    level = level or getattr(engine.dialect, "_on_connect_isolation_level", None)
    return level is None or str(level).upper().replace("_", " ") == "READ COMMITTED"


def run_all(conn: Connection, calls: Sequence[Call], *, at_once: bool = True) -> list[Outcome]:
    """The flow for validated calls, inside whatever transaction *conn* has.

    ``at_once=False`` skips the one statement, for a call it has already told to go on.
    """

    def flow(trace: _Trace) -> list[Outcome]:
        if _autocommit(conn):
            # Each statement would commit alone: the routing lock would be gone before the
            # write, and the savepoints would protect nothing. Every supported driver's
            # connection (or SQLAlchemy's async adapter of it) reports the mode this way.
            raise ValidationError("bind is in AUTOCOMMIT mode; the reschedule needs a transaction")
        if at_once:
            return _flow(conn, calls, trace)
        return _locked_then_routed(conn, calls, trace)

    return _traced(conn, calls, flow)


_T = TypeVar("_T", list[Outcome], list[Outcome] | None)


def _traced(conn: Connection, calls: Sequence[Call], flow: Callable[[_Trace], _T]) -> _T:
    """Run *flow* translated, with its debug records, invalidating a connection found dead."""
    trace = _Trace()
    try:
        with translated():  # the statements, savepoints, and a connection that died midway
            outcomes = flow(trace)
        trace.outcomes = outcomes or []
        return outcomes
    except Exception as exc:
        trace.error = f"error {type(exc).__name__}"
        lost = isinstance(exc, DatabaseError) and exc.sqlstate == CONNECTION_LOST
        if lost and not conn.invalidated:
            # Where SQLAlchemy did not notice, its next ROLLBACK (the caller's, or the Engine
            # form's own) would fail on the dead connection with a raw driver error.
            with suppress(Exception):
                conn.invalidate()
        raise
    finally:
        if log.isEnabledFor(logging.DEBUG):
            for index, call in enumerate(calls):
                if trace.error is not None:
                    _log(call, trace.routing, trace.error)
                elif index < len(trace.outcomes):
                    _log(call, trace.routing, type(trace.outcomes[index]).__name__)


def _autocommit(conn: Connection) -> bool:
    return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))


def _log(call: Call, routing: str, outcome: str) -> None:
    kind = type(call.kind).__name__
    log.debug(
        "reschedule job_id=%d kind=%s routing=%s outcome=%s",
        call.job_id,
        kind,
        routing,
        outcome,
        extra={
            "awa_job_id": call.job_id,
            "awa_kind": kind,
            "awa_routing": routing,
            "awa_outcome": outcome,
        },
    )


def _as_binds(records: Sequence[Mapping[str, Any]]) -> tuple[bool, Mapping[str, Any]]:
    """The statement shape for *records* (batch or not) and its binds.

    One record binds its scalars; more bind one array per name, one element per record.
    """
    if len(records) == 1:
        return False, records[0]
    return True, {name: [record[name] for record in records] for name in records[0]}


def _attempts_as_binds(calls: Sequence[Call]) -> tuple[bool, Mapping[str, Any]]:
    return _as_binds([call.params for call in calls])


@dataclass(frozen=True, slots=True)
class _AtOnce:
    """What the one statement did: moved the attempts (``outcomes``), or why it did not."""

    outcomes: list[Outcome] | None
    queue_storage: bool = False


def _at_once(conn: Connection, calls: Sequence[Call], trace: _Trace, *, alone: bool) -> _AtOnce:
    """The one statement (docs/contract.md#one-statement): lock, route, guard and move.

    *alone*: the statement commits by itself, so a shared-key batch must go on in a
    transaction; inside one, the singleton is locked or absent and routing is canonical, so
    the batch goes one attempt at a time right here.
    """
    trace.routing = "canonical"  # the only route on which it writes, and so can fail
    batch, items = _attempts_as_binds(calls)
    moved = Moved.read(execute(conn, statements.move_if_canonical(batch=batch), items))
    if moved.queue_storage or not moved.guarded or (moved.shared_key and alone):
        trace.routing = "?"
        return _AtOnce(None, queue_storage=moved.queue_storage)
    return _AtOnce(_rescheduled(conn, calls, moved))


def _autocommit_flow(
    conn: Connection, calls: Sequence[Call], trace: _Trace
) -> list[Outcome] | None:
    """The Engine form's first try: the one statement in autocommit, or None to go on.

    The caller's engine is left as it is: the driver connection is switched to autocommit for
    this statement and back (no round trip on any supported driver), rather than through
    SQLAlchemy's isolation level, which pg8000 resets with two statements at checkin. A
    connection that cannot be switched back is invalidated, never pooled in autocommit.
    """
    dbapi = conn.connection.dbapi_connection
    if dbapi is None or _autocommit(conn):
        return None
    dbapi.autocommit = True
    try:
        return _at_once(conn, calls, trace, alone=True).outcomes
    finally:
        try:
            dbapi.autocommit = False
        except Exception:
            conn.invalidate()


def _flow(conn: Connection, calls: Sequence[Call], trace: _Trace) -> list[Outcome]:
    """Inside a transaction: the one statement, then today's path when it says to go on."""
    first = _at_once(conn, calls, trace, alone=False)
    if first.outcomes is not None:
        return first.outcomes
    if first.queue_storage:
        # The singleton is locked by the one statement already: read routing afresh.
        return _routed(conn, calls, trace)
    return _locked_then_routed(conn, calls, trace)


def _locked_then_routed(conn: Connection, calls: Sequence[Call], trace: _Trace) -> list[Outcome]:
    """Today's path: lock the singleton, then read routing with the installed function."""
    if execute(conn, statements.routing_lock()).first() is None:
        trace.routing = "canonical (no transition singleton)"
        return _canonical(conn, calls)
    return _routed(conn, calls, trace)


def _routed(conn: Connection, calls: Sequence[Call], trace: _Trace) -> list[Outcome]:
    """With the singleton locked: routing read by ``awa.active_queue_storage_schema()``."""
    trace.routing = "canonical"  # the next statement writes, and so can fail, only then
    batch, items = _attempts_as_binds(calls)
    moved = Moved.read(execute(conn, statements.canonical_move(routed=True, batch=batch), items))
    schema = moved.routing_schema
    if schema is None:
        return _rescheduled(conn, calls, moved)
    trace.routing = schema
    translate_map(schema)  # before any write: a bad name changes nothing
    # The savepoint makes "an error after the take loses nothing" hold for a caller's
    # connection too: the take is undone and the caller's transaction stays usable.
    with conn.begin_nested():
        return _queue_storage(conn, calls, schema)


def _canonical(conn: Connection, calls: Sequence[Call]) -> list[Outcome]:
    batch, items = _attempts_as_binds(calls)
    moved = Moved.read(execute(conn, statements.canonical_move(routed=False, batch=batch), items))
    return _rescheduled(conn, calls, moved)


def _rescheduled(conn: Connection, calls: Sequence[Call], moved: Moved) -> list[Outcome]:
    """Outcomes of a canonical move, or of one move per attempt when it touched nothing."""
    if moved.shared_key:
        return [_canonical(conn, [call])[0] for call in calls]
    first: dict[tuple[int, int], int] = {}
    for index, call in enumerate(calls):
        first.setdefault((call.params["guard_id"], call.params["guard_lease"]), index)
    outcomes: list[Outcome] = [Stale()] * len(calls)
    for job in moved.jobs:  # (id, run_lease) names the first item that asked for it
        outcomes[first[(job.job_id, job.run_lease)]] = Rescheduled(
            job.job_id, job.run_at, job.attempt
        )
    return outcomes


def _queue_storage(conn: Connection, calls: Sequence[Call], schema: str) -> list[Outcome]:
    batch, items = _attempts_as_binds(calls)
    taken = Taken.read(execute(conn, statements.take_and_allocate(batch=batch), items, schema))
    if taken.shared_key:
        return [_queue_storage(conn, [call], schema)[0] for call in calls]
    for index, metadata_type in taken.not_objects:
        raise ValidationError(
            "queue storage payload metadata must be a JSON object (job "
            f"{calls[index].job_id} has {metadata_type}); the job was left unchanged"
        )
    outcomes: list[Outcome] = [Stale()] * len(calls)
    left = sorted(set(range(len(calls))) - {job.index for job in taken.jobs})
    if left:
        # Callback wiring (the guard still matches) or a guard miss: the canonical move decides.
        moved = _canonical(conn, [calls[index] for index in left])
        for index, outcome in zip(left, moved, strict=True):
            outcomes[index] = outcome
    migrated, lost = _defer(conn, taken.jobs, schema)
    for job in migrated:
        outcomes[job.index] = Migrated(job.job_id, job.run_at, job.attempt)
    for job in sorted(lost, key=lambda job: job.index):
        # A newer job owns the key: record the successor as a cancelled duplicate.
        outcomes[job.index] = _cancel_duplicate(conn, job, schema)
    return outcomes


def _defer(
    conn: Connection, taken: list[TakenJob], schema: str
) -> tuple[list[TakenJob], list[TakenJob]]:
    """Write the successors as deferred rows. Returns (written, lost to a newer claim holder).

    Jobs whose claims other jobs hold are dropped and the rest written again; a unique
    violation that no claim explains cannot be pinned on a job, so each is then tried alone,
    in order, and one that still fails is lost.
    """
    pending, lost = taken, list[TakenJob]()
    while pending:
        match _claim_and_insert(conn, pending, schema):
            case Written():
                return pending, lost
            case Held(jobs=held):
                lost += held
                pending = [job for job in pending if job not in held]
            case Unexplained() if len(pending) > 1:
                written, alone_lost = _defer_each(conn, pending, schema)
                return written, lost + alone_lost
            case Unexplained():
                return [], lost + pending
    return [], lost


def _defer_each(
    conn: Connection, jobs: list[TakenJob], schema: str
) -> tuple[list[TakenJob], list[TakenJob]]:
    """Each job alone under its own savepoint, in order. Returns (written, lost)."""
    written, lost = list[TakenJob](), list[TakenJob]()
    for job in jobs:
        ended = _claim_and_insert(conn, [job], schema)
        (written if isinstance(ended, Written) else lost).append(job)
    return written, lost


def _claim_and_insert(conn: Connection, jobs: list[TakenJob], schema: str) -> ClaimedWrite:
    """Claim the jobs' keys, then insert them as deferred rows, under one savepoint."""
    claiming = [job for job in jobs if _claims(job, job.state)]
    batch, successors = _as_binds([job.successor for job in jobs])
    deferred = statements.insert_deferred(batch=batch)

    def write() -> None:
        execute(conn, deferred, successors, schema)

    return _claimed_then_written(conn, claiming, write)


def _claimed_then_written(
    conn: Connection, claiming: Sequence[TakenJob], write: Callable[[], object]
) -> ClaimedWrite:
    """Claim *claiming*'s keys, then *write*, under a savepoint that keeps either undoable.

    A lost claim leaves PostgreSQL's lock on the holder's claim row, which only rolling the
    savepoint back releases. The deferred rows and the cancelled row each get a savepoint of
    their own this way.
    """
    try:
        # Translated inside the try, so that a unique violation is caught as one.
        with translated(), conn.begin_nested() as savepoint:
            held = _unacquired(conn, claiming)
            if held:
                savepoint.rollback()
                return Held(held)
            write()
    except UniqueConflict:
        return Unexplained()
    return Written()


def _cancel_duplicate(conn: Connection, take: TakenJob, schema: str) -> Outcome:
    ring = execute(conn, statements.ring_cursor(), {}, schema).first()
    if ring is None:
        raise DatabaseError(f"{schema}.queue_ring_state has no singleton row")
    lane = {"b_queue": take.queue, "b_priority": take.priority}
    key = {"b_lane_key": f"{schema}:{take.queue}:{take.priority}:0"}
    execute(conn, statements.lane_lock(), key)
    execute(conn, statements.ensure_lane_row(), lane, schema)
    execute(conn, statements.ensure_lane_head(table="enqueue"), lane, schema)
    execute(conn, statements.ensure_lane_head(table="claim"), lane, schema)
    execute(conn, statements.ensure_lane_sequences(), lane, schema)
    finalized_at = execute(conn, statements.clock()).scalar_one()
    lifecycle = {
        "error": statements.LIFECYCLE_DUPLICATE,
        "attempt": take.attempt,
        "at": rfc3339_now(),
        "terminal": True,
    }
    row = {
        **take.successor,
        "b_ready_slot": ring.current_slot,
        "b_ready_generation": ring.generation,
        "b_finalized_at": finalized_at,
        "b_lifecycle_error": json.dumps(lifecycle),
    }
    if not _claim_and_insert_cancelled(conn, take, row, schema):
        # Last resort: the newer holder keeps the key; the record keeps everything else.
        stripped = {**row, "b_unique_key": None, "b_unique_states": None}
        execute(conn, statements.insert_cancelled(), stripped, schema)
    return CancelledDuplicate(take.job_id)


def _claim_and_insert_cancelled(
    conn: Connection, take: TakenJob, row: Mapping[str, Any], schema: str
) -> bool:
    """Claim the key (if the cancelled state claims it), then insert the cancelled row.

    Under its own savepoint: False, with nothing written, when another job holds the key.
    """
    claiming = [take] if _claims(take, "cancelled") else []
    cancelled = statements.insert_cancelled()
    ended = _claimed_then_written(conn, claiming, lambda: execute(conn, cancelled, row, schema))
    return isinstance(ended, Written)


def _claims(job: TakenJob, state: str) -> bool:
    """Does *job*'s successor, in *state*, claim its key? (docs/contract.md#claims)."""
    if job.unique_key is None or job.unique_states is None:
        return False
    bit = JOB_STATES.index(state)
    return len(job.unique_states) > bit and job.unique_states[bit] == "1"


def _unacquired(conn: Connection, jobs: Sequence[TakenJob]) -> list[TakenJob]:
    """Claim ``(unique_key, job_id)`` for each job; the jobs whose key another job holds."""
    if not jobs:
        return []
    claims = [{"b_unique_key": job.unique_key, "b_job_id": job.job_id} for job in jobs]
    batch, params = _as_binds(claims)
    acquired = set(execute(conn, statements.claim_unique_keys(batch=batch), params).scalars())
    return [job for job in jobs if job.job_id not in acquired]


def rfc3339_now() -> str:
    """The worker clock as chrono's ``to_rfc3339``: UTC, ``+00:00``, 0/3/6/9 fraction digits."""
    secs, nanos = divmod(time.time_ns(), 1_000_000_000)
    stamp = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if nanos == 0:
        fraction = ""
    elif nanos % 1_000_000 == 0:
        fraction = f".{nanos // 1_000_000:03d}"
    elif nanos % 1_000 == 0:
        fraction = f".{nanos // 1_000:06d}"
    else:
        fraction = f".{nanos:09d}"
    return f"{stamp}{fraction}+00:00"


def _bigint(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an int, got {type(value).__name__}")
    if not _BIGINT_MIN <= value <= _BIGINT_MAX:
        raise ValidationError(f"{name}={value} is outside the bigint range")
    return value


def _json_text(name: str, value: object) -> str | None:
    """*value* as JSON text for a jsonb cast; jsonb's own refusals are caught here, early."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # lone surrogates
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"{name} is not JSON-serialisable: {exc}") from exc
    if _NUL_ESCAPE.search(text):
        raise ValidationError(f"{name} contains U+0000, which jsonb cannot store")
    return text
