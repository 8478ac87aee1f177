"""Steps 2 to 5 of a call (docs/architecture.md#flow), one function per step.

Each step returns what it settled, with the routing it settled on, or why the call must go on
(:class:`~awa_sa.settle.statements.canonical.GoOn`); the ladder below reads that and takes the next
step. The routing is known where each statement runs, so a failure is logged with it there and
a success with the routing its step returned: one ``DEBUG`` record per attempt on the
``awa_sa`` logger.

Statements per path, for a batch of any size:

* canonical: the one statement (docs/contract.md#one-statement): the routing lock, routing
  from the locked row, a guard on the routing functions' bodies, and the move;
* queue storage: the one statement (it moves nothing), the routing read under the lock it took
  (the Engine form: in a new transaction, the lock and the read, one statement more), then the
  queue-storage branch (:mod:`awa_sa.settle.into_queue_storage`);
* routing functions not the known ones: the one statement, then the lock and the routing read
  as before it existed (the two-statement path).

Two rows of one batch that share a unique key make the order of claim releases and
acquisitions matter (one by one, a row that still holds the key while running blocks an
earlier item that claims it; set-wise, every release would come first), which set-wise
statements cannot reproduce. The move or take then touches nothing and says so, and the batch
goes one attempt at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection

from awa_sa.core.compiled import Runner, run
from awa_sa.core.driver_errors import translated_error
from awa_sa.core.errors import QueueStorageAttempt, ValidationError
from awa_sa.core.internals import in_autocommit
from awa_sa.settle import canonical_move as moves
from awa_sa.settle import into_queue_storage as migrate
from awa_sa.settle.inputs import (
    AnyCall,
    Call,
    EndCall,
    ReceiptCall,
    first_of_each_pair,
    items,
    retry_of,
)
from awa_sa.settle.results import Cancelled, Completed, Ending, Failed, Outcome, Rescheduled, Stale
from awa_sa.settle.statements.canonical import MOVE_IF_CANONICAL, ROUTED_MOVE, ROUTING_LOCK, GoOn
from awa_sa.settle.statements.endings import END_ATTEMPTS, Answer, EndItem
from awa_sa.settle.statements.job_receipts import OPEN_CLAIMS
from awa_sa.settle.statements.receipt_settles import RECEIPT_LOCKS, SETTLE_LEASE, SETTLE_RECEIPT
from awa_sa.settle.statements.receipt_settles import Settled as Closed
from awa_sa.tables.queue_storage import translate_map

log = logging.getLogger("awa_sa")

CANONICAL = "canonical"
NO_SINGLETON = "canonical (no transition singleton)"
UNDECIDED = "?"


@dataclass(frozen=True, slots=True)
class Settled:
    """The outcomes of a step, and the routing it settled them on."""

    outcomes: list[Outcome]
    routing: str


def settle(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    """Inside the transaction *conn* has: each run of re-schedules or endings in turn.

    Consecutive calls of one class share their statements; the runs keep the caller's order,
    so a batch's rows are those of its items settled one after another.
    """
    with _failing(calls, UNDECIDED):
        if in_autocommit(conn):
            # Each statement would commit alone: the routing lock would be gone before the
            # write, and the savepoints would protect nothing.
            raise ValidationError("bind is in AUTOCOMMIT mode; the reschedule needs a transaction")
    outcomes: list[Ending] = []
    for run_ in _runs(calls):
        first = run_[0]
        if isinstance(first, Call):
            outcomes += _rescheduled(conn, cast(list[Call], run_))
        elif isinstance(first, EndCall):
            outcomes += _ended(conn, cast(list[EndCall], run_))
        else:
            outcomes += receipts(conn, cast(list[ReceiptCall], run_))
    return outcomes


def _runs(calls: Sequence[AnyCall]) -> Iterator[list[AnyCall]]:
    """The calls in runs of one class: re-schedules, endings, or one schema's receipts."""
    run_: list[AnyCall] = []
    for call in calls:
        if run_ and _class(run_[-1]) != _class(call):
            yield run_
            run_ = []
        run_.append(call)
    if run_:
        yield run_


def _class(call: AnyCall) -> tuple[type, str | None]:
    return type(call), call.schema if isinstance(call, ReceiptCall) else None


def _rescheduled(conn: Connection, calls: Sequence[Call]) -> list[Outcome]:
    """Steps 2 to 5 for re-schedules: the one statement, then what it says to go on with."""
    first = one_statement(conn, calls)
    return _logged(calls, first if isinstance(first, Settled) else _go_on(conn, calls, first))


def _ended(conn: Connection, calls: Sequence[EndCall]) -> list[Ending]:
    """The endings, then the re-schedule of each retryable failure with attempts left."""
    answered = endings(conn, calls)
    retries = [answer for answer in answered if isinstance(answer, Call)]
    moved = iter(_rescheduled(conn, retries) if retries else ())
    return [next(moved) if isinstance(answer, Call) else answer for answer in answered]


def endings(conn: Runner, calls: Sequence[EndCall]) -> list[Ending | Call]:
    """The one UPDATE that ends attempts (docs/contract.md#endings), or one per attempt when
    two of them share a unique key; a retryable failure with attempts left comes back as the
    re-schedule it becomes. No routing lock: an ending never migrates."""
    answered = _end(conn, calls)
    if answered is None:
        # The one-row statement has no shared key to check: it always answers.
        answered = [answer for call in calls for answer in _end(conn, [call]) or ()]
    if log.isEnabledFor(logging.DEBUG):
        for call, answer in zip(calls, answered, strict=True):
            if not isinstance(answer, Call):  # a retry is logged as the re-schedule it is
                _log(call, CANONICAL, type(answer).__name__)
    return answered


def _end(conn: Runner, calls: Sequence[EndCall]) -> list[Ending | Call] | None:
    items = [call.item for call in calls]
    with _failing(calls, CANONICAL):
        ended = run(conn, END_ATTEMPTS, items)
    if ended.shared_key:
        return None
    answers = {(a.job_id, a.run_lease): a for a in ended.answers}
    unchecked = [
        call.item
        for call in calls
        if call.bare and (call.item.job_id, call.item.run_lease) not in answers
    ]
    if ended.routing_schema is not None and unchecked:
        answers |= _checked_then_ended(conn, calls, unchecked, ended.routing_schema)
    first = first_of_each_pair(items)
    answered: list[Ending | Call] = [Stale()] * len(calls)
    for pair, answer in answers.items():
        call = calls[first[pair]]
        if answer.ended is None:
            assert answer.attempt is not None  # a retried row answers with its attempt
            answered[first[pair]] = retry_of(call, answer.attempt, ended.at)
        else:
            answered[first[pair]] = ending_of(call, answer.ended)
    return answered


def _checked_then_ended(
    conn: Runner, calls: Sequence[EndCall], unchecked: list[EndItem], schema: str
) -> dict[tuple[int, int], Answer]:
    """Bare pairs the UPDATE left alone while routing is queue storage: refused if one names
    an open claim of *schema* (docs/contract.md#bare-pair), else ended now."""
    with _failing(calls, schema):
        translate_map(schema)
        claimed = run(conn, OPEN_CLAIMS, unchecked, schema)
        for item in unchecked:
            pair = (item.job_id, item.run_lease)
            if pair in claimed:
                raise QueueStorageAttempt(*pair, schema, canonical_too=claimed[pair])
    with _failing(calls, CANONICAL):
        again = run(conn, END_ATTEMPTS, [item._replace(checked=True) for item in unchecked])
    return {(a.job_id, a.run_lease): a for a in again.answers}


def receipts(conn: Connection, calls: Sequence[ReceiptCall]) -> list[Ending]:
    """Queue-storage attempts of one schema, each settled as the runtime settles it: the
    receipts' advisory locks, then one statement per attempt (docs/contract.md#receipts).

    A batch runs under a savepoint, so that a refusal after an earlier item's writes loses
    nothing on a caller's connection either.
    """
    schema = calls[0].schema
    with _failing(calls, schema):
        translate_map(schema)
        if len(calls) == 1:
            run(conn, RECEIPT_LOCKS, [calls[0].item], schema)
            return [_receipt(conn, calls[0])]
        with conn.begin_nested():
            run(conn, RECEIPT_LOCKS, [call.item for call in calls], schema)
            return [_receipt(conn, call) for call in calls]


def locked_receipt(conn: Connection, call: ReceiptCall) -> Ending:
    """A receipt whose lock the lookup that found it took (``settle`` of a job): the settle."""
    with _failing([call], call.schema):
        translate_map(call.schema)
        return _receipt(conn, call)


def _receipt(conn: Connection, call: ReceiptCall) -> Ending:
    closed = run(conn, SETTLE_RECEIPT, call.item, call.schema)
    if closed.materialised:
        # A callback registered: the runtime's ending deletes the running lease (one statement
        # more, under the receipt's lock already held; Stale once it is parked or gone).
        closed = run(conn, SETTLE_LEASE, call.item, call.schema)
    outcome = _closed(call, closed)
    if log.isEnabledFor(logging.DEBUG):
        _log(call, call.schema, type(outcome).__name__)
    return outcome


def _closed(call: ReceiptCall, closed: Closed) -> Ending:
    if closed.job_id is None or closed.state is None:
        return Stale()
    if closed.state in ("retryable", "scheduled"):
        assert closed.run_at is not None
        assert closed.attempt is not None
        return Rescheduled(closed.job_id, closed.run_at, closed.attempt)
    return _state(closed.job_id, closed.state, terminal=call.item.tag == "fail_terminal")


def ending_of(call: EndCall, state: str) -> Ending:
    return _state(call.job_id, state, terminal=call.item.tag == "fail_terminal")


def _state(job_id: int, state: str, *, terminal: bool) -> Ending:
    if state == "completed":
        return Completed(job_id)
    if state == "cancelled":
        return Cancelled(job_id)
    return Failed(job_id, terminal=terminal)


def alone(conn: Runner, calls: Sequence[Call]) -> list[Outcome] | GoOn:
    """The one statement committed by itself (the Engine form's first try), or why to go on.

    Alone, its lock ends with it, so every reason to go on -- a shared key too -- needs a
    transaction of its own: :func:`go_on`.
    """
    first = one_statement(conn, calls)
    return first if isinstance(first, GoOn) else _logged(calls, first)


def go_on(conn: Connection, calls: Sequence[Call]) -> list[Outcome]:
    """In a new transaction, after :func:`alone` gave a reason to go on: lock, then route."""
    return _logged(calls, _locked_then_routed(conn, calls))


def one_statement(conn: Runner, calls: Sequence[Call]) -> Settled | GoOn:
    """Step 2: lock, route, guard and move (docs/contract.md#one-statement)."""
    with _failing(calls, CANONICAL):  # the only route on which it writes, and so can fail
        moved = run(conn, MOVE_IF_CANONICAL, items(calls))
    if moved.go_on is not None:
        return moved.go_on
    return Settled(moves.outcomes(conn, calls, moved), CANONICAL)


def _go_on(conn: Connection, calls: Sequence[Call], reason: GoOn) -> Settled:
    """Step 3, in the transaction of the one statement, which holds the singleton's lock."""
    if reason is GoOn.SHARED_KEY:
        # Routing was canonical under the lock, and the lock keeps it so.
        with _failing(calls, CANONICAL):
            return Settled(moves.one_by_one(conn, calls), CANONICAL)
    if reason is GoOn.QUEUE_STORAGE:
        return _routed(conn, calls)  # locked already: read routing afresh
    return _locked_then_routed(conn, calls)


def _locked_then_routed(conn: Connection, calls: Sequence[Call]) -> Settled:
    """Step 3 on the two-statement path: lock the singleton, then step 4."""
    with _failing(calls, UNDECIDED):
        singleton = run(conn, ROUTING_LOCK, None)
    if not singleton:
        with _failing(calls, NO_SINGLETON):
            return Settled(moves.canonical(conn, calls), NO_SINGLETON)
    return _routed(conn, calls)


def _routed(conn: Connection, calls: Sequence[Call]) -> Settled:
    """Step 4, the singleton locked: routing read by the installed function, moved if NULL."""
    with _failing(calls, CANONICAL):
        moved = run(conn, ROUTED_MOVE, items(calls))
        schema = moved.routing_schema
        if schema is None:
            return Settled(moves.outcomes(conn, calls, moved), CANONICAL)
    return _queue_storage(conn, calls, schema)


def _queue_storage(conn: Connection, calls: Sequence[Call], schema: str) -> Settled:
    """Step 5: the branch into *schema*, under a savepoint.

    The schema name is checked before any write, so a bad one changes nothing; the savepoint
    makes "an error after the take loses nothing" hold for a caller's connection too: the take
    is undone and the caller's transaction stays usable.
    """
    with _failing(calls, schema):
        translate_map(schema)
        with conn.begin_nested():
            return Settled(migrate.migrated(conn, calls, schema), schema)


class _failing:
    """The block's errors translated, and each attempt's failure logged under *routing*.

    A class, not ``@contextmanager``: it is entered around every statement, and a generator
    costs eight calls to enter and leave where this costs two; :func:`translated_error` runs
    only once something was raised.
    """

    __slots__ = ("calls", "routing")

    def __init__(self, calls: Sequence[AnyCall], routing: str) -> None:
        self.calls = calls
        self.routing = routing

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        if not isinstance(exc, Exception):
            return  # success, or an exit exception (KeyboardInterrupt, a cancelled task)
        error = translated_error(exc)
        if log.isEnabledFor(logging.DEBUG):
            for call in self.calls:
                _log(call, self.routing, f"error {type(error).__name__}")
        if error is not exc:
            raise error


def _logged(calls: Sequence[Call], settled: Settled) -> list[Outcome]:
    if log.isEnabledFor(logging.DEBUG):
        for call, outcome in zip(calls, settled.outcomes, strict=True):
            _log(call, settled.routing, type(outcome).__name__)
    return settled.outcomes


def _log(call: AnyCall, routing: str, outcome: str) -> None:
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
