"""New jobs, written by Awa's own producer function ``awa.insert_job_compat``.

The function is the producer contract Awa documents for v040: it reads the routing, writes the
job to the plane the current phase puts new work on (``awa.jobs_hot`` or ``awa.scheduled_jobs``
on the canonical plane, ``ready_entries`` or ``deferred_jobs`` of the routing schema once
routing is flipped), takes the unique claim and notifies the queue's listeners. This statement
only feeds it rows: writing its tables here would fork Awa's routing rules.

One job binds scalars, as text where a driver would otherwise adapt them its own way (JSON,
timestamps, bytes as hex, tags as an array literal). A batch binds one parameter, a JSON array
with one object per job (:func:`element`), and calls the function once per object, in a
LATERAL join ordered by a position each object carries, so a batch of any size is one
statement and its rows come back in input order. One JSON text costs the client one pass of
the stdlib's C encoder where twelve arrays cost the driver a Python loop over every value.
A batch whose jobs differ only in their args (awa-pg's ``insert_many_copy`` call: a list of
args under one set of keywords) binds the one job's scalars and, as its args, the JSON array
of every job's args, read by ``jsonb_array_elements``: per job, the client makes no object
and the server parses no name or default.

The server reads the objects with ``jsonb_to_recordset`` into typed columns, each value through
its type's input function once, rather than with twelve ``->>`` and casts per job (backend
CPU: docs/performance.md#enqueue). An object leaves out what the function takes a NULL for (its
``COALESCE`` to the defaults awa-pg also uses), so the common job is its kind and args alone:
less to write, send and parse. Its ``args`` are a JSON value inside the array, parsed once with
it; only args whose text awa-sa writes its own way (what the C encoder does not write as
serde_json does, :mod:`awa_sa.core.unique_keys`, and a unique job's, whose text is hashed anyway)
go as that text, under ``args_text``, cast to ``jsonb`` in their place: the same stored value.

Only what the client cannot know comes back: the id, ``run_at`` and ``created_at`` the
function stamped, and ``args`` and ``metadata`` as stored (``jsonb`` orders keys and writes
numbers its own way). The rest of the new row is what was sent, which the function stores as
given (:mod:`awa_sa.enqueue.new_jobs` builds the typed row from both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

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

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import bound_row
from awa_sa.tables.canonical import Timestamp, job_state, job_unique_claims


class JobValues(NamedTuple):
    """One job as the statement binds it: every value already validated and encoded.

    ``args`` is the JSON-able value itself when ``args_text`` is None (its C encoder text is
    awa-sa's, checked by :func:`awa_sa.enqueue.new_jobs.batch_of`), else None beside that text.
    ``metadata`` is JSON text, ``tags`` a ``text[]`` literal, ``unique_key`` and
    ``ordering_key`` hex, ``run_at`` an ISO 8601 text with its offset, ``unique_states`` the
    BIT(8) text. A tuple, so that a batch is written as JSON arrays in this field order.

    ``tag_list`` is not bound: the tags as the typed row gives them back (and a batch's
    element sends them). ``element`` is the job as a batch sends it (:func:`element`), made
    with the values.
    """

    kind: str
    queue: str
    args: Any
    state: str
    priority: int
    max_attempts: int
    run_at: str | None
    metadata: str
    tags: str
    unique_key: str | None
    unique_states: str | None
    ordering_key: str | None
    args_text: str | None
    tag_list: tuple[str, ...]
    element: dict[str, Any]


Shape = Literal["one", "objects", "shared"]
"""How jobs are bound: ``one`` job's scalars; a JSON array of ``objects``, one per job; or the
scalars ``shared`` by jobs that differ only in their args, and the JSON array of those."""


class Batch(NamedTuple):
    """Checked jobs, and for more than one the JSON array a batch binds (written once).

    A ``shared`` batch's jobs are one job's values, repeated, and its text their args.
    """

    jobs: Sequence[JobValues]
    text: str | None
    shape: Shape = "one"
    many: bool = False
    """From ``enqueue_many``: where routing allows, written as awa-pg's ``enqueue_many_copy``
    writes it (:mod:`awa_sa.enqueue.bulk`), whatever its size."""


_FIELDS = tuple(
    (f"b_{name}", name, SmallInteger if name in ("priority", "max_attempts") else Text)
    for name in JobValues._fields[:12]
)
_BATCH = "b_jobs"
_POSITION = "position"
_DEFAULTS = {"queue": "default", "state": "available", "priority": 2, "max_attempts": 25}
"""What ``awa.insert_job_compat`` takes a NULL for (its ``COALESCE``): left out of a batch."""
_ELEMENT = (
    column("kind", Text),
    column("queue", Text),
    column("args", JSONB),
    column("state", job_state),
    column("priority", SmallInteger),
    column("max_attempts", SmallInteger),
    column("run_at", Timestamp),
    column("metadata", Text),
    column("tags", ARRAY(Text)),
    column("unique_key", BYTEA),
    column("unique_states", BIT(8)),
    column("ordering_key", BYTEA),
    column("args_text", Text),
    column(_POSITION, Integer),
)


def element(job: JobValues) -> dict[str, Any]:
    """*job* as one object of a batch's array: its values by name, those the function takes a
    NULL for left out, bytes as ``bytea``'s ``\\x`` text, tags as a JSON array."""
    out: dict[str, Any] = {"kind": job.kind}
    if job.args_text is None:
        out["args"] = job.args
    else:
        out["args_text"] = job.args_text
    for name, default in _DEFAULTS.items():
        value = getattr(job, name)
        if value != default:
            out[name] = value
    if job.run_at is not None:
        out["run_at"] = job.run_at
    if job.metadata != "{}":
        out["metadata"] = job.metadata
    if job.tag_list:
        out["tags"] = job.tag_list
    for name in ("unique_key", "ordering_key"):
        if getattr(job, name) is not None:
            out[name] = "\\x" + getattr(job, name)
    if job.unique_states is not None:
        out["unique_states"] = job.unique_states
    return out


def bound_jobs(shape: Shape) -> tuple[Any, list[ColumnElement[Any]], ColumnElement[Any] | None]:
    """The bound jobs as rows, the function's arguments from them, and their order (None for
    one job)."""
    if shape == "objects":
        return _objects()
    row = bound_row(_FIELDS).subquery("given")
    if shape == "one":
        return row, _scalars(row.c, cast(row.c.args, JSONB)), None
    each = (
        func.jsonb_array_elements(cast(row.c.args, JSONB))
        .table_valued(column("args", JSONB), with_ordinality=_POSITION)
        .render_derived(name="each")
    )
    rows = row.join(each, literal_column("true"))
    return rows, _scalars(row.c, each.c.args), each.c[_POSITION]


def _scalars(c: Any, args: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    """The function's arguments from one job's bound scalars, and *args*."""
    return [
        c.kind,
        c.queue,
        args,
        cast(c.state, job_state),
        c.priority,
        c.max_attempts,
        cast(c.run_at, Timestamp),
        cast(c.metadata, JSONB),
        cast(c.tags, ARRAY(Text)),
        _hex(c.unique_key),
        cast(c.unique_states, BIT(8)),
        _hex(c.ordering_key),
    ]


def _objects() -> tuple[Any, list[ColumnElement[Any]], ColumnElement[Any]]:
    """A batch of objects as rows, the function's arguments from them, and their order."""
    rows = (
        func.jsonb_to_recordset(cast(bindparam(_BATCH, type_=Text), JSONB))
        .table_valued(*_ELEMENT)
        .render_derived(name="given", with_types=True)
    )
    c = rows.c
    args = func.coalesce(cast(c.args_text, JSONB), c.args, type_=JSONB)
    return (
        rows,
        [
            c.kind,
            c.queue,
            args,
            c.state,
            c.priority,
            c.max_attempts,
            c.run_at,
            cast(c.metadata, JSONB),
            c.tags,
            c.unique_key,
            c.unique_states,
            c.ordering_key,
        ],
        c[_POSITION],
    )


def _hex(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return func.decode(value, literal_column("'hex'"), type_=BYTEA)


@statement
def insert_jobs(*, shape: Shape) -> Select[Any]:
    """``awa.insert_job_compat`` once per bound job, its rows in input order."""
    given, arguments, position = bound_jobs(shape)
    job = (
        func.awa.insert_job_compat(*arguments)
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
    return query if position is None else query.order_by(position)


_ENCODE = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":")).encode


def batch_text(elements: list[dict[str, Any]]) -> str:
    """The JSON array a batch binds: its jobs' :func:`element` objects, numbered in order."""
    for position, item in enumerate(elements):
        item[_POSITION] = position
    return _ENCODE(elements)


def args_array(payloads: Sequence[Any]) -> str:
    """The JSON array a ``shared`` batch binds as its args: each job's, in order."""
    return _ENCODE(payloads)


def insert_binds(batch: Batch) -> Mapping[str, Any]:
    if batch.shape == "objects":
        return {_BATCH: batch.text}
    job = batch.jobs[0]
    values = dict(zip([bind for bind, _, _ in _FIELDS], job, strict=False))
    if batch.shape == "shared":
        values["b_args"] = batch.text
    else:
        values["b_args"] = _ENCODE(job.args) if job.args_text is None else job.args_text
    return values


INSERT_JOBS: Query[Batch, Rows] = Query(
    shape=lambda batch: insert_jobs(shape=batch.shape),
    binds=insert_binds,
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
