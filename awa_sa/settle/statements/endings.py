"""The endings of a canonical attempt: completed, cancelled, failed, in one UPDATE.

What Awa 0.6.9's worker writes when a canonical attempt ends (docs/contract.md#endings): the
row stays in ``awa.jobs_hot`` under its id, and only ``state``, ``finalized_at``, ``errors``
and ``progress`` change -- ``heartbeat_at`` and ``deadline_at`` are kept. A completion appends
no error and clears the progress; a cancel or a failure appends the worker's error entry
``{"error", "attempt", "at"}`` (``"terminal": true`` for a terminal failure) and writes the
progress given. No routing lock: an ending never migrates, in any phase, and the row triggers
release the unique claim exactly when the new state leaves the row's mask.

A retryable failure ends the attempt only on its final attempt (``attempt >= max_attempts``,
the worker's rule, read here from the row itself); with attempts left the row is not touched,
and the statement answers with the row's attempt and the clock, from which the flow builds the
error entry of the re-schedule with backoff that follows (as the worker's retry does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    CTE,
    BigInteger,
    Boolean,
    ColumnElement,
    Select,
    SmallInteger,
    Text,
    and_,
    case,
    cast,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import (
    EMPTY_OBJECT,
    bound_row,
    bound_rows,
    distinct_on,
    head_row,
    head_then,
    rows_as_binds,
    scalar,
    state,
)
from awa_sa.settle.statements.attempts import guard, identity, shared_key
from awa_sa.settle.statements.canonical import queue_storage_schema
from awa_sa.tables.canonical import Timestamp, jobs_hot

EndTag = Literal["complete", "cancel", "fail", "fail_terminal"]
"""An ending as the statement sees it, one per row."""


class EndItem(NamedTuple):
    """The parameters of one attempt's ending."""

    job_id: int
    run_lease: int
    tag: EndTag
    message: str | None
    """The cancel reason, or the failure's error text; None for a completion."""
    progress: str | None
    """JSON text of the progress to write (a completion writes NULL whatever is given)."""
    kind: str | None = None
    queue: str | None = None
    attempt: int | None = None
    """The identity a ``settle`` caller read, checked by the guard; None checks nothing."""
    checked: bool = False
    """A bare pair found to name no open queue-storage claim (docs/contract.md#bare-pair)."""


_BINDS = (
    "guard_id",
    "guard_lease",
    "b_tag",
    "b_message",
    "b_progress",
    "guard_kind",
    "guard_queue",
    "guard_attempt",
    "b_checked",
)
_FIELDS = list(
    zip(
        _BINDS,
        ("job_id", "lease", "tag", "message", "new_progress", "want_kind", "want_queue"),
        (BigInteger, BigInteger, Text, Text, Text, Text, Text),
        strict=False,
    )
)
_FIELDS.append(("guard_attempt", "want_attempt", SmallInteger))
_FIELDS.append(("b_checked", "checked", Boolean))


def _binds(items: Sequence[EndItem]) -> Mapping[str, Any]:
    return rows_as_binds([dict(zip(_BINDS, item, strict=True)) for item in items])


def _asked(batch: bool) -> CTE:
    """The endings asked for, one row each, the first of each ``(job_id, lease)`` kept."""
    if not batch:
        return bound_row(_FIELDS, ordinality=True).cte("asked")
    items = bound_rows("item", _FIELDS, batch, ordinality=True)
    firsts = distinct_on(select(items), items.c.job_id, items.c.lease)
    return firsts.order_by(items.c.job_id, items.c.lease, items.c.ord).cte("asked")


def rfc3339(stamp: ColumnElement[Any]) -> ColumnElement[Any]:
    """*stamp* as RFC 3339 text in UTC, microseconds always written (``...T12:00:00.000001+00:00``).

    The worker writes its own clock with chrono's ``to_rfc3339``, usually with nanoseconds (9
    digits); the database's clock has microseconds. Both are RFC 3339, in the same shape.
    """
    utc = func.timezone(literal_column("'UTC'"), stamp, type_=Text)
    return func.to_char(utc, literal_column('\'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"\''), type_=Text)


def _is(asked: Any, tag: EndTag) -> ColumnElement[bool]:
    tagged: ColumnElement[bool] = asked.c.tag == literal_column(f"'{tag}'")
    return tagged


def _entry(asked: Any, row: Any) -> ColumnElement[Any]:
    """The worker's error entry: the error text (``cancelled: <reason>`` for a cancel), the
    attempt that ended, the clock, and ``"terminal": true`` for a terminal failure."""
    error = case(
        (_is(asked, "cancel"), literal_column("'cancelled: '", Text) + asked.c.message),
        else_=asked.c.message,
    )
    entry = func.jsonb_build_object(
        literal_column("'error'"),
        error,
        literal_column("'attempt'"),
        row.c.attempt,
        literal_column("'at'"),
        rfc3339(func.now()),
        type_=JSONB,
    )
    terminal = func.jsonb_build_object(literal_column("'terminal'"), true(), type_=JSONB)
    flag = case((_is(asked, "fail_terminal"), terminal), else_=EMPTY_OBJECT)
    return entry.op("||", return_type=JSONB)(flag)


def _ends(asked: Any, row: Any) -> ColumnElement[bool]:
    """Whether the row's attempt ends here: all but a retryable failure with attempts left."""
    return or_(~_is(asked, "fail"), row.c.attempt >= row.c.max_attempts)


def _ending(source: Any, hot: Any) -> dict[str, Any]:
    """The columns an ending writes, as the worker writes them (the module docstring)."""
    return {
        "state": case(
            (_is(source, "complete"), state("completed")),
            (_is(source, "cancel"), state("cancelled")),
            else_=state("failed"),
        ),
        "finalized_at": func.now(),
        "errors": case(
            (_is(source, "complete"), hot.c.errors),
            else_=func.array_append(hot.c.errors, _entry(source, hot), type_=ARRAY(JSONB)),
        ),
        "progress": case(
            (_is(source, "complete"), cast(null(), JSONB)),
            else_=cast(source.c.new_progress, JSONB),
        ),
    }


@statement
def end_job() -> Select[Any]:
    """End a job's running canonical attempt found by the job's identity alone, in one UPDATE.

    ``settle`` of an awa-pg ``Job`` (which carries no run lease) on a cluster whose routing was
    last seen canonical, for an ending that never re-schedules (a completion, a cancel, a
    terminal failure): the row that is running with the job's id, attempt, kind, queue and
    ``created_at`` (the identity ``attempt_of`` matches, which tells the planes apart) ends as
    :func:`end_attempts` ends it. Answers the row's id and lease, or nothing: then the caller
    looks the job up (queue storage, or no longer running).
    """
    fields = [
        ("b_job_id", "job_id", BigInteger),
        ("b_tag", "tag", Text),
        ("b_message", "message", Text),
        ("b_progress", "new_progress", Text),
        ("b_kind", "want_kind", Text),
        ("b_queue", "want_queue", Text),
        ("b_attempt", "want_attempt", SmallInteger),
        ("b_created_at", "created_at", Timestamp),
    ]
    asked = bound_row(fields).cte("asked")
    hot: Any = jobs_hot.alias("hot")
    named = identity(hot, asked, ("created_at", "created_at"))  # the key's index alone
    ended = (
        update(hot)
        .where(hot.c.id == asked.c.job_id, hot.c.state == literal_column("'running'"), *named)
        .values(**_ending(asked, hot))
        .returning(hot.c.id, hot.c.run_lease, cast(hot.c.state, Text).label("ended"))
    )
    return select(ended.cte("ended"))


class JobEnding(NamedTuple):
    """The parameters of :func:`end_job`: the job's identity and its ending."""

    job_id: int
    tag: EndTag
    message: str | None
    progress: str | None
    kind: str
    queue: str
    attempt: int
    created_at: datetime


_JOB_BINDS = (
    "b_job_id",
    "b_tag",
    "b_message",
    "b_progress",
    "b_kind",
    "b_queue",
    "b_attempt",
    "b_created_at",
)
"""The binds of :func:`end_job`, in :class:`JobEnding`'s order."""
END_JOB: Query[JobEnding, tuple[int, int, str] | None] = Query(
    lambda _: end_job(),
    lambda item: dict(zip(_JOB_BINDS, item, strict=True)),
    lambda rows: (rows[0].id, rows[0].run_lease, rows[0].ended) if rows else None,
)


@statement
def end_attempts(*, batch: bool, named: bool) -> Select[Any]:
    """End the guarded attempts as asked, one UPDATE for every kind of ending.

    Returns a first row ``(shared_key, at, routing_schema)``: two of a batch's rows share a
    unique key (then nothing was touched; see ``attempts.shared_key``), the clock as the error
    entries have it, and the queue-storage schema routing points at (then a bare pair not yet
    ``checked`` was not touched). Where every attempt is *named* (its kind given: the caller
    read it from the running attempt) routing decides nothing, and is neither read nor
    answered (NULL). Then one row per asked attempt whose row is running:
    ``ended`` the state it now has, or NULL with its ``attempt`` when it is a retryable
    failure with attempts left.
    A batch locks its rows lowest id first, as the worker's batched completion does.
    """
    asked = _asked(batch)
    routing = cast(null(), Text) if named else queue_storage_schema()
    head = head_row(
        shared_key(asked, batch).label("shared_key"),
        rfc3339(func.now()).label("at"),
        routing.label("routing_schema"),
    )
    hot: Any = jobs_hot.alias("hot")
    unshared = ~scalar(head, "shared_key")
    if batch:
        locked = (
            select(jobs_hot.c.id, *asked.c)
            .where(*guard(jobs_hot, asked))
            .order_by(jobs_hot.c.id)
            .with_for_update(of=jobs_hot)
            .cte("locked")
            .prefix_with("MATERIALIZED")
        )
        source: Any = locked
        matched = [hot.c.id == locked.c.id, unshared]
    else:
        source = asked
        matched = [*guard(hot, asked), unshared]
    # Where routing is queue storage a bare pair may name the other plane's claim: it ends
    # only once the flow has found none (``checked``), or when the caller named the attempt.
    unnamed = or_(
        source.c.want_kind.is_not(None),
        source.c.checked,
        scalar(head, "routing_schema").is_(None),
    )
    ended = (
        update(hot)
        .where(*matched, _ends(source, hot), *([] if named else [unnamed]))
        .values(**_ending(source, hot))
        .returning(hot.c.id, hot.c.run_lease, cast(hot.c.state, Text).label("ended"))
        .cte("ended")
    )
    row: Any = jobs_hot.alias("running")
    retried = (
        select(row.c.id, row.c.run_lease, row.c.attempt)
        .select_from(row)
        .join(asked, and_(*guard(row, asked)))
        .where(~_ends(asked, row), unshared)
        .cte("retried")
    )
    answers = (
        select(
            ended.c.id,
            ended.c.run_lease,
            ended.c.ended,
            cast(null(), SmallInteger).label("attempt"),
        )
        .union_all(
            select(
                retried.c.id,
                retried.c.run_lease,
                cast(null(), Text).label("ended"),
                retried.c.attempt,
            )
        )
        .subquery("answers")
    )
    return head_then(
        head, answers, answers.c.id, answers.c.run_lease, answers.c.ended, answers.c.attempt
    )


class Answer(NamedTuple):
    """One running attempt the statement answered for."""

    job_id: int
    run_lease: int
    ended: str | None
    """The state the row ended in; None for a retryable failure with attempts left."""
    attempt: int | None
    """That failure's attempt number, for its error entry."""


@dataclass(frozen=True, slots=True)
class Ended:
    """What :func:`end_attempts` did: the rows it answered for, or nothing (a shared key)."""

    answers: list[Answer]
    shared_key: bool
    at: str
    """The clock as the error entries have it (RFC 3339)."""
    routing_schema: str | None
    """Where routing points, if queue storage: a bare pair was then not ended unless checked."""

    @classmethod
    def read(cls, rows: Rows) -> Ended:
        answers = [Answer(r.id, r.run_lease, r.ended, r.attempt) for r in rows if r.id is not None]
        head = rows[0]
        return cls(answers, bool(head.shared_key), str(head.at), head.routing_schema)


END_ATTEMPTS: Query[Sequence[EndItem], Ended] = Query(
    lambda items: end_attempts(
        batch=len(items) > 1, named=all(item.kind is not None for item in items)
    ),
    _binds,
    Ended.read,
)
