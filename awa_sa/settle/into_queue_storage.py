"""Step 5, the queue-storage branch: canonical attempts migrate into schema ``S``.

Awa's migration, statement for statement (docs/contract.md#take onwards): take the canonical
rows and allocate their successors; move canonically the attempts it did not take; claim the
successors' unique keys and insert them as deferred rows under one savepoint; and record each
successor whose key a newer job holds as a cancelled duplicate. The caller runs this under a
savepoint of its own, so an error after the take loses nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection

from awa_sa.core.compiled import run
from awa_sa.core.driver_errors import translated
from awa_sa.core.errors import DatabaseError, QueueStorageAttempt, UniqueConflict, ValidationError
from awa_sa.settle import canonical_move as moves
from awa_sa.settle.inputs import Call, items
from awa_sa.settle.results import CancelledDuplicate, Migrated, Outcome, Stale
from awa_sa.settle.statements.duplicate import (
    CLOCK,
    ENSURE_CLAIM_HEAD,
    ENSURE_ENQUEUE_HEAD,
    ENSURE_LANE_ROW,
    ENSURE_LANE_SEQUENCES,
    INSERT_CANCELLED,
    LANE_LOCK,
    LIFECYCLE_DUPLICATE,
    RING_CURSOR,
    CancelledRow,
    Lane,
)
from awa_sa.settle.statements.job_receipts import OPEN_CLAIMS
from awa_sa.settle.statements.migration import (
    CLAIM_UNIQUE_KEYS,
    INSERT_DEFERRED,
    TAKE_AND_ALLOCATE,
    Claim,
    Successor,
    Taken,
    TakenJob,
)
from awa_sa.tables.canonical import JOB_STATES


def migrated(conn: Connection, calls: Sequence[Call], schema: str) -> list[Outcome]:
    """The outcomes of migrating *calls* into *schema*, routing locked to it."""
    _refuse_queue_storage_pairs(conn, calls, schema)
    taken = run(conn, TAKE_AND_ALLOCATE, items(calls), schema)
    if not taken.shared_key:
        return _settled(conn, calls, taken, schema)
    # Two of the rows share a unique key, so the order of claims decides: one attempt at a
    # time, each taken by the one-row statement, which has no shared key to check.
    outcomes: list[Outcome] = []
    for call in calls:
        alone = run(conn, TAKE_AND_ALLOCATE, [call.item], schema)
        outcomes += _settled(conn, [call], alone, schema)
    return outcomes


def _refuse_queue_storage_pairs(conn: Connection, calls: Sequence[Call], schema: str) -> None:
    """Refuse, before anything is taken, a bare pair that names an open claim of *schema*.

    Only here can the planes' pairs collide: a queue-storage claim exists only once routing
    points to queue storage. Such a pair may mean that claim, not the canonical row under it
    (docs/contract.md#bare-pair); a call that passed the RunningAttempt it read names its
    plane, and is not asked.
    """
    bare = [call for call in calls if call.bare]
    if not bare:
        return
    claimed = run(conn, OPEN_CLAIMS, items(bare), schema)
    for call in bare:
        pair = (call.item.job_id, call.item.run_lease)
        if pair in claimed:
            raise QueueStorageAttempt(*pair, schema, canonical_too=claimed[pair])


def _settled(conn: Connection, calls: Sequence[Call], taken: Taken, schema: str) -> list[Outcome]:
    """What became of each call once *taken* says which rows the take took."""
    for index, metadata_type in taken.not_objects:
        raise ValidationError(
            "queue storage payload metadata must be a JSON object (job "
            f"{calls[index].job_id} has {metadata_type}); the job was left unchanged"
        )
    outcomes: list[Outcome] = [Stale()] * len(calls)
    left = sorted(set(range(len(calls))) - {job.index for job in taken.jobs})
    if left:
        # Callback wiring (the guard still matches) or a guard miss: the canonical move decides.
        moved = moves.canonical(conn, [calls[index] for index in left])
        for index, outcome in zip(left, moved, strict=True):
            outcomes[index] = outcome
    written, lost = _deferred(conn, taken.jobs, schema)
    for job in written:
        row = job.successor
        outcomes[job.index] = Migrated(row.job_id, row.run_at, row.attempt)
    for job in sorted(lost, key=lambda job: job.index):
        # A newer job owns the key: record the successor as a cancelled duplicate.
        outcomes[job.index] = _cancelled_duplicate(conn, job.successor, schema)
    return outcomes


@dataclass(frozen=True, slots=True)
class _Written:
    """Claims acquired (if any) and the rows written."""


@dataclass(frozen=True, slots=True)
class _Held:
    """Nothing written: other jobs hold the unique keys of these successors."""

    job_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Unexplained:
    """Nothing written: a unique violation that no lost claim explains."""


_ClaimedWrite = _Written | _Held | _Unexplained
"""How a claim-then-write under a savepoint ended."""


def _deferred(
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
            case _Written():
                return pending, lost
            case _Held(job_ids=held):
                lost += [job for job in pending if job.successor.job_id in held]
                pending = [job for job in pending if job.successor.job_id not in held]
            case _Unexplained() if len(pending) > 1:
                written, alone_lost = _deferred_each(conn, pending, schema)
                return written, lost + alone_lost
            case _Unexplained():
                return [], lost + pending
    return [], lost


def _deferred_each(
    conn: Connection, jobs: list[TakenJob], schema: str
) -> tuple[list[TakenJob], list[TakenJob]]:
    """Each job alone under its own savepoint, in order. Returns (written, lost)."""
    written, lost = list[TakenJob](), list[TakenJob]()
    for job in jobs:
        ended = _claim_and_insert(conn, [job], schema)
        (written if isinstance(ended, _Written) else lost).append(job)
    return written, lost


def _claim_and_insert(conn: Connection, jobs: list[TakenJob], schema: str) -> _ClaimedWrite:
    """Claim the jobs' keys, then insert them as deferred rows, under one savepoint."""
    rows = [job.successor for job in jobs]
    claiming = [row for row in rows if _claims(row, row.state)]
    return _claimed_then_written(conn, claiming, lambda: run(conn, INSERT_DEFERRED, rows, schema))


def _claimed_then_written(
    conn: Connection, claiming: Sequence[Successor], write: Callable[[], object]
) -> _ClaimedWrite:
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
                return _Held(held)
            write()
    except UniqueConflict:
        return _Unexplained()
    return _Written()


def _unacquired(conn: Connection, rows: Sequence[Successor]) -> frozenset[int]:
    """Claim ``(unique_key, job_id)`` for each row; the job ids whose key another job holds."""
    claims = [Claim(row.unique_key, row.job_id) for row in rows if row.unique_key is not None]
    if not claims:
        return frozenset()
    acquired = run(conn, CLAIM_UNIQUE_KEYS, claims)
    return frozenset(claim.job_id for claim in claims if claim.job_id not in acquired)


def _claims(row: Successor, state: str) -> bool:
    """Does *row*, in *state*, claim its key? (docs/contract.md#claims)."""
    if row.unique_key is None or row.unique_states is None:
        return False
    bit = JOB_STATES.index(state)
    return len(row.unique_states) > bit and row.unique_states[bit] == "1"


def _cancelled_duplicate(conn: Connection, successor: Successor, schema: str) -> Outcome:
    """Record *successor* as a cancelled ``done_entries`` row (docs/contract.md#cancelled)."""
    ring = run(conn, RING_CURSOR, None, schema)
    if ring is None:
        raise DatabaseError(f"{schema}.queue_ring_state has no singleton row")
    lane = Lane(schema, successor.queue, successor.priority)
    run(conn, LANE_LOCK, lane)
    for ensure in (ENSURE_LANE_ROW, ENSURE_ENQUEUE_HEAD, ENSURE_CLAIM_HEAD, ENSURE_LANE_SEQUENCES):
        run(conn, ensure, lane, schema)
    finalized_at = run(conn, CLOCK, None)
    lifecycle = {
        "error": LIFECYCLE_DUPLICATE,
        "attempt": successor.attempt,
        "at": rfc3339_now(),
        "terminal": True,
    }
    row = CancelledRow(successor, ring, finalized_at, json.dumps(lifecycle))
    claiming = [successor] if _claims(successor, "cancelled") else []
    write = _claimed_then_written(conn, claiming, lambda: run(conn, INSERT_CANCELLED, row, schema))
    if not isinstance(write, _Written):
        # Last resort: the newer holder keeps the key; the record keeps everything else.
        unkeyed = successor._replace(unique_key=None, unique_states=None)
        run(conn, INSERT_CANCELLED, row._replace(successor=unkeyed), schema)
    return CancelledDuplicate(successor.job_id)


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
