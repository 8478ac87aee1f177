"""New jobs, written by Awa's own producer function ``awa.insert_job_compat``.

The function is the producer contract Awa documents for v040: it reads the routing, writes the
job to the plane the current phase puts new work on (``awa.jobs_hot`` or ``awa.scheduled_jobs``
on the canonical plane, ``ready_entries`` or ``deferred_jobs`` of the routing schema once
routing is flipped), takes the unique claim and notifies the queue's listeners. This statement
only feeds it rows: writing its tables here would fork Awa's routing rules.

One job binds scalars. A batch binds one parameter, a JSON array with one array of values per
job, and calls the function once per element, in a LATERAL join ordered by the element's
position, so a batch of any size is one statement and its rows come back in input order. One
JSON text costs the client one pass of the stdlib's C encoder where twelve arrays cost the
driver a Python loop over every value, escapes included; the server reads either in a small
part of what the function itself costs. Values travel as text where a driver would otherwise
adapt them its own way (JSON, timestamps, bytes as hex, tags as an array literal).

Only what the client cannot know comes back: the id, ``run_at`` and ``created_at`` the
function stamped, and ``args`` and ``metadata`` as stored (``jsonb`` orders keys and writes
numbers its own way). The rest of the new row is what was sent, which the function stores as
given (:mod:`awa_sa.jobs` builds the typed row from both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
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
from awa_sa.statements.sql import bound_row
from awa_sa.tables import Timestamp, job_state, job_unique_claims


class JobValues(NamedTuple):
    """One job as the statement binds it: every value already validated and encoded.

    ``args`` and ``metadata`` are JSON text, ``tags`` a ``text[]`` literal, ``unique_key`` and
    ``ordering_key`` hex, ``run_at`` an ISO 8601 text with its offset, ``unique_states`` the
    BIT(8) text. A tuple, so that a batch is written as JSON arrays in this field order.

    ``tag_list`` is not bound (a batch's array carries it, the statement reads no further than
    ``ordering_key``): the tags as the typed row gives them back, kept in this one object per
    job rather than in a second one beside it, and as a tuple, so that a job's values hold no
    mutable object and the garbage collector stops tracking them once it has seen them.
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
    tag_list: tuple[str, ...]


_FIELDS = tuple(
    (f"b_{name}", name, SmallInteger if name in ("priority", "max_attempts") else Text)
    for name in JobValues._fields[:-1]
)
_BATCH = "b_jobs"


def _given(batch: bool) -> tuple[Any, dict[str, ColumnElement[Any]]]:
    """The bound jobs as rows, and each field as a column of them (text in a batch)."""
    if not batch:
        row = bound_row(_FIELDS).subquery("given")
        return row, {name: row.c[name] for _, name, _ in _FIELDS}
    rows = (
        func.jsonb_array_elements(cast(bindparam(_BATCH, type_=Text), JSONB))
        .table_valued(column("job", JSONB), with_ordinality="ord")
        .render_derived(name="given")
    )
    field = rows.c.job.op("->>", return_type=Text)
    return rows, {name: field(literal_column(str(n))) for n, (_, name, _) in enumerate(_FIELDS)}


def _hex(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return func.decode(value, literal_column("'hex'"), type_=BYTEA)


@statement
def insert_jobs(*, batch: bool) -> Select[Any]:
    """``awa.insert_job_compat`` once per bound job, its rows in input order."""
    given, c = _given(batch)
    small = (lambda v: cast(v, SmallInteger)) if batch else (lambda v: v)
    job = (
        func.awa.insert_job_compat(
            c["kind"],
            c["queue"],
            cast(c["args"], JSONB),
            cast(c["state"], job_state),
            small(c["priority"]),
            small(c["max_attempts"]),
            cast(c["run_at"], Timestamp),
            cast(c["metadata"], JSONB),
            cast(c["tags"], ARRAY(Text)),
            _hex(c["unique_key"]),
            cast(c["unique_states"], BIT(8)),
            _hex(c["ordering_key"]),
        )
        .table_valued(
            column("id", BigInteger),
            column("run_at", Timestamp),
            column("created_at", Timestamp),
            column("args", JSONB),
            column("metadata", JSONB),
        )
        .lateral("job")
    )
    query = select(
        job.c.id,
        job.c.run_at,
        job.c.created_at,
        cast(job.c.args, Text).label("args"),
        cast(job.c.metadata, Text).label("metadata"),
    ).select_from(given.join(job, literal_column("true")))
    return query.order_by(given.c.ord) if batch else query


_ENCODE = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":")).encode


def _binds(jobs: Sequence[JobValues]) -> Mapping[str, Any]:
    if len(jobs) == 1:
        return dict(zip([bind for bind, _, _ in _FIELDS], jobs[0], strict=False))
    return {_BATCH: _ENCODE(jobs)}


INSERT_JOBS: Query[Sequence[JobValues], Rows] = Query(
    shape=lambda jobs: insert_jobs(batch=len(jobs) > 1),
    binds=_binds,
    read=lambda rows: rows,
    by_position=True,
)
"""Each job's row: ``(id, run_at, created_at, args, metadata)``, JSON as text, in input order."""


def tags_literal(tags: Sequence[str]) -> str:
    """The tags as the statement binds them: a ``text[]`` literal, every element quoted."""
    if not tags:
        return "{}"
    quoted = ('"' + tag.replace("\\", "\\\\").replace('"', '\\"') + '"' for tag in tags)
    return "{" + ",".join(quoted) + "}"


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
