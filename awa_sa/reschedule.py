"""The reschedule decision flow over a sync ``Connection`` (spec: reschedule.md, queue_storage.md).

The flow asks :mod:`awa_sa.statements` for a statement, executes it, and decides what the result
means. This is the only place that knows an ``Engine`` (own transaction, committed) from a
``Connection`` (the caller's transaction, never committed); the async face runs :func:`run` through
``AsyncConnection.run_sync`` rather than repeating it.

Statements per path, inside the transaction:

* canonical: 2 -- the routing lock, then one statement that reads routing afresh and, when it is
  NULL, moves the row. A missing singleton skips the routing read in the same 2.
* queue storage: the same 2, then under a savepoint the merged take/allocation and, when the row
  was taken, the savepoint-a claim and insert; on a unique conflict the ring read, the 5 lane
  statements, the clock, and the savepoint-b claim and cancelled row (+ delta), or last resort.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, Executable, Result

from awa_sa import statements
from awa_sa.errors import DatabaseError, UniqueConflict, ValidationError, translated
from awa_sa.kinds import (
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
from awa_sa.tables import JOB_STATES

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
    """One validated request: everything the statements need, and nothing touched yet."""

    job_id: int
    kind: Kind
    tag: statements.KindTag
    params: Mapping[str, Any]


@dataclass(slots=True)
class _Trace:
    routing: str = "?"
    outcome: str = "error"


def prepare(
    job_id: object, run_lease: object, kind: object, error: object, progress: object
) -> Call:
    """Validate every input before anything reaches the database (spec §1)."""
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
        "b_delay": delay,
        "b_error": _json_text("error", error),
        "b_progress": _json_text("progress", progress),
    }
    return Call(job_id=job_id, kind=kind, tag=tag, params=params)


def reschedule_canonical_attempt(
    bind: Engine | Connection,
    job_id: int,
    run_lease: int,
    kind: Kind,
    *,
    error: Any = None,
    progress: Any = None,
) -> Outcome:
    """Re-schedule the running canonical attempt ``(job_id, run_lease)`` as *kind* asks.

    ``bind`` is an ``Engine`` (own transaction, committed on success) or a ``Connection`` (joins
    the caller's transaction, which is never committed here). ``error`` is one JSON value to
    append to the error list; ``progress`` replaces the stored progress (None clears it).

    Raises :class:`~awa_sa.errors.ValidationError`, :class:`~awa_sa.errors.UniqueConflict` or
    :class:`~awa_sa.errors.DatabaseError`; see :mod:`awa_sa.errors` for what each leaves behind.
    """
    if not isinstance(bind, Engine | Connection):
        raise ValidationError(
            f"bind must be a sqlalchemy Engine or Connection, got {type(bind).__name__}"
            " (use awa_sa.asyncio for AsyncEngine/AsyncConnection)"
        )
    call = prepare(job_id, run_lease, kind, error, progress)
    with translated():  # BEGIN and COMMIT too
        if isinstance(bind, Engine):
            with bind.begin() as conn:
                return run(conn, call)
        return run(bind, call)


def run(conn: Connection, call: Call) -> Outcome:
    """The flow for one validated call, inside whatever transaction *conn* has."""
    with translated():
        autocommit = getattr(conn.connection.dbapi_connection, "autocommit", False)
    if autocommit:
        # Each statement would commit alone: the routing lock would be gone before the write,
        # and the savepoints would protect nothing.
        raise ValidationError("bind is in AUTOCOMMIT mode; the reschedule needs a transaction")
    trace = _Trace()
    try:
        with translated():  # savepoint statements too
            outcome = _flow(conn, call, trace)
        trace.outcome = type(outcome).__name__
        return outcome
    except Exception as exc:
        trace.outcome = f"error {type(exc).__name__}"
        raise
    finally:
        log.debug(
            "reschedule job_id=%d kind=%s routing=%s outcome=%s",
            call.job_id,
            type(call.kind).__name__,
            trace.routing,
            trace.outcome,
            extra={
                "awa_job_id": call.job_id,
                "awa_kind": type(call.kind).__name__,
                "awa_routing": trace.routing,
                "awa_outcome": trace.outcome,
            },
        )


def _flow(conn: Connection, call: Call, trace: _Trace) -> Outcome:
    if _execute(conn, statements.routing_lock()).first() is None:
        trace.routing = "canonical (no transition singleton)"
        return _canonical(conn, call)
    trace.routing = "canonical"  # the next statement writes, and so can fail, only then
    row = _execute(conn, statements.canonical_move(call.tag, True), call.params).one()
    if row.s is None:
        return Rescheduled(row.id, row.run_at, row.attempt) if row.id is not None else Stale()
    schema: str = row.s
    trace.routing = schema
    tmap = translate_map(schema)  # before any write: a bad name changes nothing
    # The savepoint makes "an error after the take loses nothing" hold for a caller's
    # connection too: the take is undone and the caller's transaction stays usable.
    with conn.begin_nested():
        return _queue_storage(conn, call, schema, tmap)


def _canonical(conn: Connection, call: Call) -> Outcome:
    row = _execute(conn, statements.canonical_move(call.tag, False), call.params).first()
    return Stale() if row is None else Rescheduled(row.id, row.run_at, row.attempt)


def _queue_storage(
    conn: Connection, call: Call, schema: str, tmap: dict[str | None, str | None]
) -> Outcome:
    take = _execute(conn, statements.take_and_allocate(call.tag), call.params, tmap).first()
    if take is None:
        # Callback wiring (the guard still matches) or a guard miss: the canonical move decides.
        return _canonical(conn, call)
    if take.job_id is None:
        raise ValidationError(
            f"queue storage payload metadata must be a JSON object (job {call.job_id} has "
            f"{take.metadata_type}); the job was left unchanged"
        )
    successor = {f"b_{name}": getattr(take, name) for name in statements.SUCCESSOR_FIELDS}
    try:
        with conn.begin_nested():  # savepoint a
            if _claims(take.unique_key, take.unique_states, take.state):
                _claim(conn, successor)
            _execute(conn, statements.insert_deferred(), successor, tmap)
        return Migrated(take.job_id, take.run_at, take.attempt)
    except UniqueConflict:
        pass  # a newer job owns the key: record the successor as a cancelled duplicate
    return _cancel_duplicate(conn, take, successor, schema, tmap)


def _cancel_duplicate(
    conn: Connection,
    take: Any,
    successor: dict[str, Any],
    schema: str,
    tmap: dict[str | None, str | None],
) -> Outcome:
    ring = _execute(conn, statements.ring_cursor(), {}, tmap).first()
    if ring is None:
        raise DatabaseError(f"{schema}.queue_ring_state has no singleton row")
    lane = {"b_queue": take.queue, "b_priority": take.priority}
    key = {"b_lane_key": f"{schema}:{take.queue}:{take.priority}:0"}
    _execute(conn, statements.lane_lock(), key)
    _execute(conn, statements.ensure_lane_row(), lane, tmap)
    _execute(conn, statements.ensure_lane_head("enqueue"), lane, tmap)
    _execute(conn, statements.ensure_lane_head("claim"), lane, tmap)
    _execute(conn, statements.ensure_lane_sequences(), lane, tmap)
    finalized_at = _execute(conn, statements.clock()).scalar_one()
    lifecycle = {
        "error": statements.LIFECYCLE_DUPLICATE,
        "attempt": take.attempt,
        "at": rfc3339_now(),
        "terminal": True,
    }
    row = {
        **successor,
        "b_ready_slot": ring.current_slot,
        "b_ready_generation": ring.generation,
        "b_finalized_at": finalized_at,
        "b_lifecycle_error": json.dumps(lifecycle),
    }
    try:
        with conn.begin_nested():  # savepoint b
            if _claims(take.unique_key, take.unique_states, "cancelled"):
                _claim(conn, row)
            _execute(conn, statements.insert_cancelled(), row, tmap)
    except UniqueConflict:
        # Last resort: the newer holder keeps the key; the record keeps everything else.
        stripped = {**row, "b_unique_key": None, "b_unique_states": None}
        _execute(conn, statements.insert_cancelled(), stripped, tmap)
    return CancelledDuplicate(take.job_id)


def _claims(unique_key: bytes | None, unique_states: str | None, state: str) -> bool:
    """Does a queue-storage row in *state* claim its key? (queue_storage.md §5.1)."""
    if unique_key is None or unique_states is None:
        return False
    bit = JOB_STATES.index(state)
    return len(unique_states) > bit and unique_states[bit] == "1"


def _claim(conn: Connection, row: Mapping[str, Any]) -> None:
    params = {"b_unique_key": row["b_unique_key"], "b_job_id": row["b_job_id"]}
    if len(_execute(conn, statements.claim_unique_key(), params).all()) != 1:
        raise UniqueConflict(statements.CLAIM_CONSTRAINT, "unique claim held by another job")


def _execute(
    conn: Connection,
    stmt: Executable,
    params: Mapping[str, Any] | None = None,
    tmap: dict[str | None, str | None] | None = None,
) -> Result[Any]:
    # Per-call options: Connection.execution_options() would change the caller's connection.
    options = {"schema_translate_map": tmap} if tmap is not None else {}
    with translated():
        return conn.execute(stmt, dict(params or {}), execution_options=options)


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
