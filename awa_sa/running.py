"""Where ``(job_id, run_lease)`` come from: the running attempts of ``awa.jobs_hot``.

A reschedule needs the pair a claim left. An Awa worker's handler knows its job's id and
attempt but not the lease (awa-pg's ``Job`` does not expose it); an admin tool knows neither.
Both read it here, from the row the claim wrote. The statement is built once and takes every
filter as a parameter (NULL: no filter), so it is compiled once whatever a caller asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Interval,
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    or_,
    select,
)
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.errors import translated
from awa_sa.tables import jobs_hot


@dataclass(frozen=True, slots=True)
class RunningAttempt:
    """One running attempt, as a reschedule and an admin screen need it."""

    job_id: int
    run_lease: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    attempted_at: datetime
    """When the claim was made (database clock)."""
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    running_for: timedelta
    """``now() - attempted_at`` on the database's clock, as of the query."""


def _filter(name: str, type_: Any, match: Any) -> ColumnElement[bool]:
    """``value IS NULL OR <match>``: a parameter left NULL filters nothing."""
    value = cast(bindparam(name, type_=type_), type_)
    return or_(value.is_(None), match(value))


@cache
def running_attempts_query() -> Select[Any]:
    """Running attempts, oldest claim first, filtered by the ``f_*`` parameters."""
    t = jobs_hot
    return (
        select(
            t.c.id.label("job_id"),
            t.c.run_lease,
            t.c.kind,
            t.c.queue,
            t.c.attempt,
            t.c.max_attempts,
            t.c.attempted_at,
            t.c.heartbeat_at,
            t.c.deadline_at,
            (func.now() - t.c.attempted_at).label("running_for"),
        )
        .where(
            t.c.state == "running",
            _filter("f_queue", Text, lambda v: t.c.queue == v),
            _filter("f_kind", Text, lambda v: t.c.kind == v),
            _filter("f_running_for", Interval, lambda v: t.c.attempted_at <= func.now() - v),
            _filter("f_job_id", BigInteger, lambda v: t.c.id == v),
            _filter("f_attempt", SmallInteger, lambda v: t.c.attempt == v),
        )
        .order_by(t.c.attempted_at, t.c.id)
        .limit(cast(bindparam("f_limit", type_=BigInteger), BigInteger))
    )


def running_attempts(
    bind: Engine | Connection,
    *,
    queue: str | None = None,
    kind: str | None = None,
    running_for: timedelta | None = None,
    job_id: int | None = None,
    attempt: int | None = None,
    limit: int | None = None,
) -> list[RunningAttempt]:
    """The running attempts of ``awa.jobs_hot`` that match every filter given, oldest first.

    ``running_for`` keeps the attempts claimed at least that long ago. ``job_id`` with
    ``attempt`` is how a handler finds its own lease: a claim after a rescue bumps the attempt,
    so it cannot hand over the lease of a later claim. A ``Connection`` reads in its
    transaction; an ``Engine`` opens one connection for the read. From async code:
    ``await conn.run_sync(running_attempts, ...)``.
    """
    params = {
        "f_queue": queue,
        "f_kind": kind,
        "f_running_for": running_for,
        "f_job_id": job_id,
        "f_attempt": attempt,
        "f_limit": limit,
    }
    with translated():
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                rows = conn.execute(running_attempts_query(), params).all()
        else:
            rows = bind.execute(running_attempts_query(), params).all()
    return [RunningAttempt(**row._mapping) for row in rows]
