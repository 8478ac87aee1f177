"""Settling running attempts: the public calls (docs/contract.md).

Each call validates every input first (:mod:`awa_sa.settle.inputs`), then runs the one flow
(:mod:`awa_sa.settle.flow`) in the form its bind asks for (:mod:`awa_sa.settle.binds`). A single
call is a batch of one: a batch's outcomes and rows are those of its attempts re-scheduled one after
another in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Engine

from awa_sa.core.binds import administered, check_bind
from awa_sa.core.errors import CompactReceipt, ValidationError
from awa_sa.settle.binds import within
from awa_sa.settle.by_job import settle_job_step
from awa_sa.settle.inputs import (
    AnyCall,
    prepare,
    prepare_all,
    prepare_batch,
    prepare_result,
    settling,
)
from awa_sa.settle.results import Attempt, Ending, Kind, Outcome, Result, Settle, Settlement
from awa_sa.settle.running import JobLike, RunningAttempt

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


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

    Raises :class:`~awa_sa.core.errors.ValidationError`,
    :class:`~awa_sa.core.errors.UniqueConflict` or :class:`~awa_sa.core.errors.DatabaseError`; see
    :mod:`awa_sa.core.errors` for what each leaves behind.
    """
    check_bind(bind)
    return _rescheduled(within(bind, [prepare(job_id, run_lease, kind, error, progress)]))[0]


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

    The statements do not grow in number with the batch (docs/contract.md#batches counts
    them). The exception is a batch in which two rows share a unique key: the order then
    matters, so it goes one attempt at a time (same outcomes, one move or take per attempt).
    Large batches rely on ``awa.jobs_hot`` having statistics, as autovacuum keeps them: on a
    table bulk-loaded and never analysed, PostgreSQL can join items to rows in quadratic time.

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
    return _rescheduled(within(bind, calls)) if calls else []


def settle_canonical_attempt(
    bind: Engine | Connection | Session,
    job_id: int,
    run_lease: int,
    result: Result,
    *,
    error: Any = None,
    progress: Any = None,
) -> Ending:
    """End or re-schedule the running canonical attempt ``(job_id, run_lease)`` as *result*
    says, writing what Awa 0.6.9's worker writes (docs/contract.md#endings).

    ``Complete()`` ends it ``completed``, ``Cancel(reason)`` ``cancelled``, ``Fail(error)``
    ``failed`` when terminal or on the final attempt and otherwise retries it with Awa's
    backoff (the worker's rule, decided from the attempt's row); ``Snooze``, ``RetryAfter`` and
    ``RetryBackoff`` are :func:`reschedule_canonical_attempt`'s, with its ``error``. An ending
    stays in ``awa.jobs_hot`` under its id, in every phase, with no routing lock. ``progress``
    replaces the stored progress (None clears it; a completion always clears it). ``bind`` is
    as for the reschedule. Answers ``Completed``, ``Cancelled``, ``Failed``, a reschedule's
    outcome, or ``Stale``.
    """
    check_bind(bind)
    return within(bind, [prepare_result(job_id, run_lease, result, error, progress)])[0]


def settle_canonical_attempts(
    bind: Engine | Connection | Session, attempts: Iterable[Settle | Attempt]
) -> list[Ending]:
    """Settle many running canonical attempts in one transaction, any result each.

    As :func:`reschedule_canonical_attempts`, with every result :func:`settle_canonical_attempt`
    takes: the outcomes and rows are those of settling each item in turn. Consecutive items
    of one class (endings, re-schedules) share their statements, the endings one UPDATE that
    locks its rows lowest id first.
    """
    check_bind(bind)
    calls = prepare_batch(attempts)
    return within(bind, calls) if calls else []


def settle(
    bind: Engine | Connection | Session,
    attempt: RunningAttempt | JobLike,
    result: Result,
    *,
    error: Any = None,
    progress: Any = None,
) -> Ending:
    """Settle *attempt*, as :func:`~awa_sa.running_attempts` or :func:`~awa_sa.attempt_of`
    returned it, as *result* says: the call that cannot touch another job.

    *attempt* may also be the awa-pg ``Job`` a handler was given (anything
    :func:`~awa_sa.attempt_of` takes): its running attempt is then found and settled in the one
    call, in two statements on either plane (the lookup takes the receipt's lock itself; one
    for a canonical ending that never re-schedules once routing was seen canonical), and a job
    whose attempt is no longer running is ``Stale``.

    A canonical attempt is settled as :func:`settle_canonical_attempt` does, with its kind,
    queue and attempt checked beside ``(job_id, run_lease)`` in the same statement: a row that
    is no longer that attempt is ``Stale``. A queue-storage attempt is settled in its schema
    as Awa 0.6.9's runtime settles it (docs/contract.md#receipts): its receipt closed, its
    ending in ``done_entries`` (or the runtime's compact completion of a bare job), a
    re-schedule in ``deferred_jobs`` under the same id (``Rescheduled``); ``Stale`` when
    anything closed the receipt first. ``progress`` None keeps what a queue-storage attempt
    last flushed, as the runtime does. An attempt whose handler registered a callback (its
    receipt materialised into a running ``leases`` row) is settled as the runtime ends it: the
    lease deleted, one statement more. A compact receipt (its queue claims without a deadline)
    is refused with :class:`~awa_sa.core.errors.CompactReceipt`, and one a callback
    materialised with :class:`~awa_sa.core.errors.MaterialisedAttempt`, before any statement.
    ``bind`` and ``error`` are as for those calls.
    """
    check_bind(bind)
    if not isinstance(attempt, RunningAttempt):
        return administered(bind, settle_job_step(attempt, result, error, progress))
    return within(bind, [settling(attempt, result, error, progress)])[0]


def settle_attempts(
    bind: Engine | Connection | Session, settlements: Iterable[Settlement]
) -> list[Ending]:
    """Settle many running attempts, of either plane, in one transaction: one outcome each.

    Each :class:`~awa_sa.settle.results.Settlement` is what :func:`settle` takes; the outcomes and
    rows are those of settling each in turn inside one transaction (a repeated attempt is ``Stale``
    the second time). Every item is validated before any statement (a refusal names its
    index). Consecutive canonical items share their statements as in
    :func:`settle_canonical_attempts`; consecutive queue-storage items of one schema take
    their receipts' locks in one statement, then one statement each
    (docs/contract.md#statement-counts). ``bind`` is as for :func:`settle`.
    """
    check_bind(bind)
    calls = settlings(settlements)
    return within(bind, calls) if calls else []


def settlings(settlements: object) -> list[AnyCall]:
    """The validated calls of a batch of settlements, or the first item's reason to refuse."""
    if isinstance(settlements, str | bytes) or not isinstance(settlements, Iterable):
        raise ValidationError(
            f"settlements must be an iterable of Settlement, got {type(settlements).__name__}"
        )
    calls: list[AnyCall] = []
    for index, item in enumerate(settlements):
        if not isinstance(item, Settlement):
            raise ValidationError(
                f"settlements[{index}] must be a Settlement, got {type(item).__name__}"
            )
        try:
            calls.append(settling(item.attempt, item.result, item.error, item.progress))
        except CompactReceipt as exc:
            raise CompactReceipt(exc.job_id, exc.run_lease, exc.schema, exc.queue, index) from exc
        except ValidationError as exc:
            raise ValidationError(f"settlements[{index}]: {exc}") from exc
    return calls


def _rescheduled(outcomes: list[Ending]) -> list[Outcome]:
    """The outcomes of re-schedules, which are never endings."""
    return cast(list[Outcome], outcomes)
