"""``queue_stats``' statement on each plane, as awa-pg 0.6.9's ``queue_overviews`` answers.

Every queue any source knows (jobs, ``awa.queue_descriptors``, ``awa.queue_meta``, the queue
descriptors a runtime reports) gets one row, in queue order. While routing is canonical the
counts are ``awa.queue_state_counts``, the cache the maintenance leader refreshes every few
seconds, and the lag and last hour's completions are read from ``awa.jobs_hot`` against
``now()``; on queue storage all of them are counted from the rows of
:func:`~awa_sa.read.statements.current.current_jobs` against ``clock_timestamp()``. awa-pg's
overview has more columns (descriptors, their staleness); these are its ``QueueStat``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import (
    Boolean,
    and_,
    cast,
    column,
    extract,
    false,
    func,
    literal_column,
    select,
    true,
    union,
)
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause, Select

from awa_sa.core.registry import statement
from awa_sa.core.sql import state
from awa_sa.read.statements.current import current_jobs
from awa_sa.read.statements.schemas import placeholder
from awa_sa.tables.canonical import jobs_hot
from awa_sa.tables.runtime import (
    queue_descriptors,
    queue_meta,
    queue_state_counts,
    runtime_instances,
)

Plane = Literal["canonical", "queue_storage"]
QUEUED = ("scheduled", "available", "running", "retryable", "waiting_external")
COUNTED = ("scheduled", "available", "retryable", "running", "failed", "waiting_external")


@dataclass(frozen=True, slots=True)
class QueueStat:
    """A queue's counts, as awa-pg's ``QueueStat`` reports them."""

    queue: str
    total_queued: int
    scheduled: int
    available: int
    retryable: int
    running: int
    failed: int
    waiting_external: int
    completed_last_hour: int
    lag_seconds: float | None
    paused: bool


def _reported_queues() -> Select[Any]:
    """The queues a runtime reports a descriptor for."""
    ri = runtime_instances
    each = (
        func.jsonb_each_text(ri.c.queue_descriptor_hashes)
        .table_valued(column("key"), column("value"))
        .render_derived(name="descriptor")
    )
    return select(each.c.key.label("queue")).select_from(ri.join(each, true())).distinct()


def _counts(jobs: FromClause) -> Select[Any]:
    c = jobs.c
    counted = [func.count().filter(c.state == state(name)).label(name) for name in COUNTED]
    return select(c.queue, *counted).group_by(c.queue)


def _lag(jobs: FromClause, now: ColumnElement[Any]) -> Select[Any]:
    c = jobs.c
    waited = cast(extract("epoch", now - func.min(c.run_at)), DOUBLE_PRECISION)
    return (
        select(c.queue, waited.label("lag_seconds"))
        .where(c.state == state("available"))
        .group_by(c.queue)
    )


def _completed(jobs: FromClause, now: ColumnElement[Any]) -> Select[Any]:
    c = jobs.c
    hour_ago = now - literal_column("interval '1 hour'")
    return (
        select(c.queue, func.count().label("completed_last_hour"))
        .where(c.state == state("completed"), c.finalized_at > hour_ago)
        .group_by(c.queue)
    )


@statement
def queue_stats_rows(*, plane: Plane) -> Select[Any]:
    """Every known queue's :class:`QueueStat` columns on *plane*, in queue order."""
    counts: FromClause
    now: ColumnElement[Any]
    if plane == "canonical":
        jobs: FromClause = jobs_hot
        now = func.now()
        counts = queue_state_counts.alias("qs")
        known = select(queue_state_counts.c.queue)
    else:
        jobs = current_jobs(placeholder()).element.cte("current_jobs")
        now = func.clock_timestamp()
        counts = _counts(jobs).subquery("qc")
        known = select(jobs.c.queue)
    queues = union(
        known,
        select(queue_descriptors.c.queue),
        select(queue_meta.c.queue),
        _reported_queues(),
    ).subquery("all_queues")
    lag = _lag(jobs, now).subquery("available_lag")
    done = _completed(jobs, now).subquery("completed_recent")
    q, n = queues.c, counts.c
    zero: ColumnElement[Any] = literal_column("0")
    total = func.coalesce(sum_of(n[name] for name in QUEUED), zero)
    joined = (
        queues.outerjoin(counts, n.queue == q.queue)
        .outerjoin(lag, lag.c.queue == q.queue)
        .outerjoin(done, done.c.queue == q.queue)
        .outerjoin(queue_meta, and_(queue_meta.c.queue == q.queue))
    )
    return (
        select(
            q.queue,
            total.label("total_queued"),
            *(func.coalesce(n[name], zero).label(name) for name in COUNTED),
            func.coalesce(done.c.completed_last_hour, zero).label("completed_last_hour"),
            lag.c.lag_seconds,
            func.coalesce(queue_meta.c.paused, false(), type_=Boolean).label("paused"),
        )
        .select_from(joined)
        .order_by(q.queue)
    )


def sum_of(terms: Any) -> ColumnElement[Any]:
    listed = list(terms)
    total = listed[0]
    for term in listed[1:]:
        total = total + term
    return total  # type: ignore[no-any-return]


def queue_stats_of(rows: Sequence[Any]) -> list[QueueStat]:
    return [
        QueueStat(
            queue=row.queue,
            total_queued=int(row.total_queued),
            **{name: int(getattr(row, name)) for name in COUNTED},
            completed_last_hour=int(row.completed_last_hour),
            lag_seconds=None if row.lag_seconds is None else float(row.lag_seconds),
            paused=bool(row.paused),
        )
        for row in rows
    ]
