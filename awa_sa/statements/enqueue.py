"""New jobs, written by Awa's own producer function ``awa.insert_job_compat``.

The function is the producer contract Awa documents for v040: it reads the routing, writes the
job to the plane the current phase puts new work on (``awa.jobs_hot`` or ``awa.scheduled_jobs``
on the canonical plane, ``ready_entries`` or ``deferred_jobs`` of the routing schema once
routing is flipped), takes the unique claim and notifies the queue's listeners. This statement
only feeds it rows: writing its tables here would fork Awa's routing rules.

One job binds scalars; a batch binds one array per field and calls the function once per
element, in a LATERAL join ordered by the element's position, so a batch of any size is one
statement and its rows come back in input order. Values travel as text where a driver would
otherwise have to adapt them its own way (JSON, timestamps, bytes as hex, the tags as a JSON
array, since a batch's tags are an array of arrays that do not share a length).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, BIT, BYTEA, JSONB
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.statements.registry import Query, Rows, statement
from awa_sa.statements.sql import bound_rows, rows_as_binds
from awa_sa.tables import Timestamp, job_state, job_unique_claims


@dataclass(frozen=True, slots=True)
class JobValues:
    """One job as the statement binds it: every value already validated and encoded.

    ``args``, ``metadata`` and ``tags`` are JSON text, ``unique_key`` and ``ordering_key`` hex,
    ``run_at`` an ISO 8601 text with its offset, ``unique_states`` the BIT(8) text.
    """

    kind: str
    queue: str
    args: str
    state: str
    priority: int
    max_attempts: int
    run_at: str | None
    metadata: str
    tags: str
    unique_key: str | None
    unique_states: str | None
    ordering_key: str | None


_FIELDS = (
    ("b_kind", "kind", Text),
    ("b_queue", "queue", Text),
    ("b_args", "args", Text),
    ("b_state", "state", Text),
    ("b_priority", "priority", SmallInteger),
    ("b_max_attempts", "max_attempts", SmallInteger),
    ("b_run_at", "run_at", Text),
    ("b_metadata", "metadata", Text),
    ("b_tags", "tags", Text),
    ("b_unique_key", "unique_key", Text),
    ("b_unique_states", "unique_states", Text),
    ("b_ordering_key", "ordering_key", Text),
)


def _hex(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return func.decode(value, literal_column("'hex'"), type_=BYTEA)


def _tags(value: ColumnElement[Any]) -> ColumnElement[Any]:
    """The JSON array of tags as ``text[]``, in its order."""
    elements = (
        func.jsonb_array_elements_text(cast(value, JSONB))
        .table_valued(column("value", Text), with_ordinality="n")
        .render_derived(name="tag")
    )
    listed = select(elements.c.value).order_by(elements.c.n).scalar_subquery()
    return func.array(listed, type_=ARRAY(Text))


@statement
def insert_jobs(*, batch: bool) -> Select[Any]:
    """``awa.insert_job_compat`` once per bound job, its rows in input order."""
    given = bound_rows("given", _FIELDS, batch, ordinality=True)
    c = given.c
    job = (
        func.awa.insert_job_compat(
            c.kind,
            c.queue,
            cast(c.args, JSONB),
            cast(c.state, job_state),
            c.priority,
            c.max_attempts,
            cast(c.run_at, Timestamp),
            cast(c.metadata, JSONB),
            _tags(c.tags),
            _hex(c.unique_key),
            cast(c.unique_states, BIT(8)),
            _hex(c.ordering_key),
        )
        .table_valued(
            column("id", BigInteger),
            column("kind", Text),
            column("queue", Text),
            column("args", JSONB),
            column("state", job_state),
            column("priority", SmallInteger),
            column("attempt", SmallInteger),
            column("max_attempts", SmallInteger),
            column("run_at", Timestamp),
            column("created_at", Timestamp),
            column("metadata", JSONB),
            column("tags", ARRAY(Text)),
            column("unique_key", BYTEA),
        )
        .lateral("job")
    )
    return (
        select(
            job.c.id,
            job.c.kind,
            job.c.queue,
            cast(job.c.state, Text).label("state"),
            cast(job.c.priority, Integer).label("priority"),
            cast(job.c.attempt, Integer).label("attempt"),
            cast(job.c.max_attempts, Integer).label("max_attempts"),
            job.c.run_at,
            job.c.created_at,
            cast(job.c.args, Text).label("args"),
            cast(job.c.metadata, Text).label("metadata"),
            cast(func.to_jsonb(job.c.tags), Text).label("tags"),
            func.encode(job.c.unique_key, literal_column("'hex'"), type_=Text).label("unique_key"),
        )
        .select_from(given)
        .join(job, literal_column("true"))
        .order_by(c.ord)
    )


@dataclass(frozen=True, slots=True)
class InsertedRow:
    """A row the function answered, as the statement reads it (JSON still text)."""

    id: int
    kind: str
    queue: str
    state: str
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    args: str
    metadata: str
    tags: str
    unique_key: str | None


def _binds(jobs: Sequence[JobValues]) -> Mapping[str, Any]:
    rows = [{bind: getattr(job, name) for bind, name, _ in _FIELDS} for job in jobs]
    return rows_as_binds(rows)


def _read(rows: Rows) -> list[InsertedRow]:
    return [InsertedRow(*row) for row in rows]


INSERT_JOBS: Query[Sequence[JobValues], list[InsertedRow]] = Query(
    shape=lambda jobs: insert_jobs(batch=len(jobs) > 1),
    binds=_binds,
    read=_read,
)


def tags_text(tags: Sequence[str]) -> str:
    """The tags as the statement binds them: a JSON array of strings."""
    return json.dumps(list(tags), ensure_ascii=False)


@statement
def unique_holder() -> Select[Any]:
    """The job holding a unique key, for a duplicate's error (both planes claim in one table)."""
    key = func.decode(bindparam("b_unique_key", type_=Text), literal_column("'hex'"), type_=BYTEA)
    return select(job_unique_claims.c.job_id).where(job_unique_claims.c.unique_key == key)


UNIQUE_HOLDER: Query[str, int | None] = Query(
    shape=lambda _: unique_holder(),
    binds=lambda key: {"b_unique_key": key},
    read=lambda rows: int(rows[0][0]) if rows else None,
)
