"""The attempts a moving statement works on, as rows, and what each attempt's successor becomes.

Every moving statement (the canonical move, the one statement, the queue-storage take) starts
from the same rows: one per attempt asked for, the first of each ``(job_id, lease)`` kept,
guarded by ``id``, ``state = 'running'`` and ``run_lease``. The kind is a per-row value
(``tag``), not part of the statement's shape, so one statement serves a batch of mixed kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Double,
    Select,
    SmallInteger,
    Text,
    and_,
    case,
    cast,
    delete,
    exists,
    false,
    func,
    literal_column,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB

from awa_sa.core.sql import (
    ZERO,
    bound_row,
    bound_rows,
    distinct_on,
    rows_as_binds,
    scalar,
    state,
)
from awa_sa.tables.canonical import jobs_hot

KindTag = Literal["snooze", "retry_after", "retry_backoff"]
"""A kind as the statements see it, one per row; the delay is a value of its own."""


class MoveItem(NamedTuple):
    """The parameters of one attempt for every moving statement."""

    job_id: int
    run_lease: int
    tag: KindTag
    delay: float | None
    """Seconds, for Snooze and RetryAfter; None for RetryBackoff."""
    error: str | None
    """JSON text of the error entry to append, or None."""
    progress: str | None
    """JSON text of the new progress, or None to clear it."""
    kind: str | None = None
    """The job's kind as its claim knew it, checked by the guard; None checks nothing."""
    queue: str | None = None
    """The job's queue, checked likewise."""
    attempt: int | None = None
    """The claim's attempt number, checked likewise."""


_ITEM_BINDS = (
    "guard_id",
    "guard_lease",
    "b_tag",
    "b_delay",
    "b_error",
    "b_progress",
    "guard_kind",
    "guard_queue",
    "guard_attempt",
)
"""The bind names of :class:`MoveItem`'s fields, in unnest order."""


def item_binds(items: Sequence[MoveItem]) -> Mapping[str, Any]:
    """The binds of a moving statement for *items*: scalars for one, arrays for more."""
    return rows_as_binds([dict(zip(_ITEM_BINDS, item, strict=True)) for item in items])


def attempt_rows(batch: bool) -> CTE:
    """The attempts as rows ``(job_id, lease, tag, delay, error, new_progress, want_kind,
    want_queue, want_attempt, ord)``.

    Only the first item of each ``(job_id, lease)`` survives: one by one, a repeat finds the
    row already gone and is Stale, and at most one lease can match a row. ``new_progress``
    would clash with the row's own ``progress`` in ``RETURNING``.
    """
    names = (
        *("job_id", "lease", "tag", "delay", "error", "new_progress"),
        *("want_kind", "want_queue", "want_attempt"),
    )
    types = (BigInteger, BigInteger, Text, Double, Text, Text, Text, Text, SmallInteger)
    fields = list(zip(_ITEM_BINDS, names, types, strict=True))
    if not batch:
        return bound_row(fields, ordinality=True).cte("asked")
    items = bound_rows("item", fields, batch, ordinality=True)
    firsts = distinct_on(select(items), items.c.job_id, items.c.lease)
    return firsts.order_by(items.c.job_id, items.c.lease, items.c.ord).cte("asked")


def guard(row: Any, firsts: CTE) -> list[ColumnElement[bool]]:
    """The running attempt ``(id, run_lease)``, and the identity the caller gave, if any.

    A caller that names the attempt it read (``awa_sa.settle``) has its kind, queue and
    attempt checked in the same statement: a row that no longer is that attempt is Stale.
    """
    return [
        row.c.id == firsts.c.job_id,
        row.c.state == literal_column("'running'"),
        row.c.run_lease == firsts.c.lease,
        *identity(row, firsts),
    ]


def identity(row: Any, asked: Any, *more: tuple[str, str]) -> list[ColumnElement[bool]]:
    """The identity the caller gave (kind, queue, attempt, and *more* ``(column, asked)``
    pairs), each checked only where given: the columns are never NULL, so a NULL asked for
    compares the column with itself, and the check is never an index condition."""
    return [
        row.c[name] == func.coalesce(asked.c[want], row.c[name])
        for name, want in (*_IDENTITY, *more)
    ]


_IDENTITY = (("kind", "want_kind"), ("queue", "want_queue"), ("attempt", "want_attempt"))


def shared_key(firsts: CTE, batch: bool) -> ColumnElement[bool]:
    """Do two rows the batch would touch share a unique key?

    Then the order of claim releases and acquisitions decides outcomes (a row released later
    in the list still blocks an earlier one, one by one), which set-wise statements cannot
    reproduce; the flow then goes one attempt at a time instead. An alias, so the subquery
    does not correlate with the DELETE's own ``jobs_hot``.
    """
    if not batch:
        return false()
    row = jobs_hot.alias("candidate")
    shared: Select[Any] = (
        select(literal_column("1"))
        .select_from(row)
        .join(firsts, true())
        .where(*guard(row, firsts), row.c.unique_key.is_not(None))
        .group_by(row.c.unique_key)
        .having(func.count() > literal_column("1"))
    )
    return exists(shared)


_ITEM_COLUMNS = ("ord", "tag", "delay", "error", "new_progress")
"""What a taken row carries from its item, besides the ``jobs_hot`` columns."""


def take(
    firsts: CTE,
    head: CTE,
    *,
    batch: bool,
    routed_here: Sequence[ColumnElement[bool]] = (),
    eligible: Callable[[Any], Sequence[ColumnElement[bool]]] = lambda _: (),
) -> CTE:
    """DELETE the guarded rows, returning each with its item; none when ``head.shared_key``.

    *routed_here* says whether this statement's branch applies at all; *eligible* picks the
    rows this statement takes among those it may lock. A batch first locks every guarded row
    its branch may touch, in id order (:func:`_lock_in_id_order`), eligible or not: the rows
    left to a later statement of the same call (callback wiring, a shared key) are then locked
    already, and the call takes all its row locks in that one order. A single call has one
    row, whose lock needs no order.
    """
    unshared = ~scalar(head, "shared_key")
    hot: Any = jobs_hot.alias("hot")  # short: the statement names every column it returns
    if not batch:
        return (
            delete(hot)
            .where(*guard(hot, firsts), *routed_here, *eligible(hot), unshared)
            .returning(*hot.c, *(firsts.c[name] for name in _ITEM_COLUMNS))
            .cte("taken")
        )
    locked = _lock_in_id_order(firsts, routed_here, and_(*eligible(jobs_hot), unshared))
    return (
        delete(hot)
        .where(hot.c.id == locked.c.id, locked.c.take)
        .returning(*hot.c, *(locked.c[name] for name in _ITEM_COLUMNS))
        .cte("taken")
    )


def _lock_in_id_order(
    firsts: CTE, routed_here: Sequence[ColumnElement[bool]], take: ColumnElement[bool]
) -> CTE:
    """``SELECT ... ORDER BY id FOR UPDATE``: the guarded rows, locked lowest id first.

    A DELETE locks rows in whatever order its plan visits them, so two multi-row lockers could
    each hold a row the other waits for. PostgreSQL locks a ``FOR UPDATE`` query's rows as they
    leave its sort, so this order is the statement's own, whatever the plan, and a batch cannot
    deadlock with another locker that also goes by ascending id. A row changed while we waited
    is checked against the guard again before it is locked, as the DELETE alone would do.

    Whether the DELETE takes a row is the column ``take``, not a condition of the DELETE: a
    condition that does not depend on the row (the shared key) becomes a gate in front of the
    DELETE's join, and then nothing reads this CTE and nothing is locked.
    """
    return (
        select(
            jobs_hot.c.id,
            *(firsts.c[name] for name in _ITEM_COLUMNS),
            take.label("take"),
        )
        .where(*guard(jobs_hot, firsts), *routed_here)
        .order_by(jobs_hot.c.id)
        .with_for_update(of=jobs_hot)
        .cte("locked")
        .prefix_with("MATERIALIZED")
    )


def is_kind(taken: CTE, tag: KindTag) -> ColumnElement[bool]:
    return taken.c.tag == literal_column(f"'{tag}'")


def successor_state(taken: CTE) -> ColumnElement[Any]:
    return case((is_kind(taken, "snooze"), state("scheduled")), else_=state("retryable"))


def successor_attempt(taken: CTE) -> ColumnElement[Any]:
    """The snoozed attempt does not count: one less, but never below smallint's floor.

    Awa takes one off with a saturating subtraction, so -32768 stays -32768 where ``attempt
    - 1`` would leave smallint (22003).
    """
    one_less = func.greatest(taken.c.attempt - literal_column("1"), literal_column("-32768"))
    return case((is_kind(taken, "snooze"), cast(one_less, SmallInteger)), else_=taken.c.attempt)


def finalized_at(taken: CTE, snoozed: ColumnElement[Any]) -> ColumnElement[Any]:
    """``now()`` for a retry; *snoozed* (the branch's Snooze value) otherwise."""
    return case((is_kind(taken, "snooze"), snoozed), else_=func.now())


def run_at(taken: CTE) -> ColumnElement[Any]:
    # smallint arguments: the function has no int4 overload (docs/contract.md#backoff). CASE
    # evaluates only the matching branch, so the volatile backoff runs for retry_backoff rows alone.
    backoff = func.awa.backoff_duration(
        cast(taken.c.attempt, SmallInteger),
        cast(taken.c.max_attempts, SmallInteger),
        type_=INTERVAL,
    )
    zero = ZERO
    delay = func.make_interval(zero, zero, zero, zero, zero, zero, taken.c.delay, type_=INTERVAL)
    return func.now() + case((is_kind(taken, "retry_backoff"), backoff), else_=delay)


def errors_after(taken: CTE) -> ColumnElement[Any]:
    """``taken.errors`` with the item's error appended as one element; NULL stays NULL without."""
    error = cast(taken.c.error, JSONB)
    return case(
        (taken.c.error.is_(None), taken.c.errors),
        else_=func.array_append(taken.c.errors, error, type_=ARRAY(JSONB)),
    )
