"""What each table says a job is: one candidate row per table that holds the job.

On the canonical plane a job is one row, of ``awa.jobs_hot`` or ``awa.scheduled_jobs``. On
queue storage a job leaves a row in each table it passes through, and awa-pg 0.6.9's
``get_job`` (awa-model's ``QueueStorage::load_job``) reads every one of them as a candidate
and answers with the greatest by ``(run_lease, transition time, state rank)``, the last of
equals in its reading order. The candidates, in that order:

1. each ``ready_entries`` row: ``available``;
2. the ``deferred_jobs`` row: ``scheduled`` or ``retryable``;
3. each ``leases`` row (a callback wait materialised it), with its ``attempt_state``;
4. each ``lease_claims`` receipt no closure evidence closes and no lease materialised:
   ``running``;
5. each position of a compact ``lease_claim_batches`` receipt, by the same evidence:
   ``running``;
6. each row of the schema's ``terminal_jobs`` view: a ``done_entries`` row (its ready row
   filling the columns a compact row leaves empty), or a ``receipt_completion_batches``
   position without a completion tombstone: ``completed``;
7. the ``dlq_entries`` row.

The transition time is the first of ``finalized_at``, ``heartbeat_at``, ``deadline_at``,
``attempted_at``, ``run_at``; the state rank running/waiting 4, scheduled/retryable 3,
available 2, terminal 1. A job's metadata, tags, errors and progress are read from the
payload as awa-pg reads them (``awa.queue_storage_payload_errors``/``_tags``, the metadata
object or ``{}``, a JSON null progress as none), a lease's or open receipt's
``attempt_state`` progress and callback result over it. awa-pg reports no ``unique_states``
on queue storage: neither do these.

Every candidate also names its anchor: the row of ``ready_entries``, ``done_entries``,
``deferred_jobs`` or ``dlq_entries`` it stands on (:mod:`awa_sa.read.statements.jobs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    LargeBinary,
    SmallInteger,
    Table,
    Text,
    Uuid,
    and_,
    any_,
    case,
    cast,
    column,
    exists,
    func,
    literal_column,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause, Select

from awa_sa.core.sql import state
from awa_sa.tables.canonical import Timestamp, job_state

JOB_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("id", BigInteger),
    ("kind", Text),
    ("queue", Text),
    ("args", JSONB),
    ("state", job_state),
    ("priority", SmallInteger),
    ("attempt", SmallInteger),
    ("max_attempts", SmallInteger),
    ("run_at", Timestamp),
    ("heartbeat_at", Timestamp),
    ("deadline_at", Timestamp),
    ("attempted_at", Timestamp),
    ("finalized_at", Timestamp),
    ("created_at", Timestamp),
    ("errors", ARRAY(JSONB)),
    ("metadata", JSONB),
    ("tags", ARRAY(Text)),
    ("unique_key", LargeBinary),
    ("unique_states", Text),
    ("callback_id", Uuid),
    ("callback_timeout_at", Timestamp),
    ("callback_filter", Text),
    ("callback_on_complete", Text),
    ("callback_on_fail", Text),
    ("callback_transform", Text),
    ("run_lease", BigInteger),
    ("progress", JSONB),
)
"""A job's columns as the canonical tables hold them, in their order (``unique_states`` as
its text, ``'11111000'``)."""

ANCHOR: tuple[tuple[str, Any], ...] = (
    ("anchor", SmallInteger),
    ("anchor_slot", Integer),
    ("anchor_generation", BigInteger),
    ("anchor_shard", SmallInteger),
    ("anchor_lane", BigInteger),
)
"""Which row a candidate stands on: its table's number and its place."""

HOT, SCHEDULED, READY, DONE, DEFERRED, DLQ = range(6)
"""The anchors' numbers: the tables of :mod:`awa_sa.read.statements.jobs`' outer rows."""


@dataclass(frozen=True, slots=True)
class Tables:
    """The queue-storage tables of one schema (the placeholder's, or a real one's copies)."""

    by_name: Mapping[str, Table]

    def __getitem__(self, name: str) -> Table:
        return self.by_name[name]


def _typed(value: Any, type_: Any) -> ColumnElement[Any]:
    return cast(null(), type_) if value is None else value


def row(values: Mapping[str, Any], anchor: tuple[Any, ...], order: int) -> list[Any]:
    """The candidate's columns in :data:`JOB_COLUMNS` order, then its anchor and sort key."""
    cols = [_typed(values.get(name), type_).label(name) for name, type_ in JOB_COLUMNS]
    cols += [
        _typed(value, type_).label(name)
        for (name, type_), value in zip(ANCHOR, anchor, strict=True)
    ]
    moment = func.coalesce(
        *(_typed(values.get(n), Timestamp) for n in ("finalized_at", "heartbeat_at")),
        *(_typed(values.get(n), Timestamp) for n in ("deadline_at", "attempted_at")),
        values["run_at"],
    )
    return [
        *cols,
        moment.label("moment"),
        literal_column(str(order)).label("reading"),
    ]


def _rank(state_of: ColumnElement[Any]) -> ColumnElement[Any]:
    return case(
        (state_of.in_([state("running"), state("waiting_external")]), literal_column("4")),
        (state_of.in_([state("retryable"), state("scheduled")]), literal_column("3")),
        (state_of == state("available"), literal_column("2")),
        else_=literal_column("1"),
    )


def _listed(body: ColumnElement[Any], key: str) -> ColumnElement[Any]:
    """The payload's array *key*, ``'[]'`` where missing or JSON null."""
    return func.coalesce(
        func.nullif(body.op("->", return_type=JSONB)(literal_column(f"'{key}'")), _json("null")),
        _json("[]"),
    )


def _json(text: str) -> ColumnElement[Any]:
    return cast(literal_column(f"'{text}'"), JSONB)


def _elements(listed: ColumnElement[Any], function: Any, type_: Any) -> ColumnElement[Any]:
    each = function(listed).table_valued(column("value", type_)).render_derived(name="each")
    return select(func.array_agg(each.c.value, type_=ARRAY(type_))).scalar_subquery()


def _payload(payload: ColumnElement[Any]) -> dict[str, Any]:
    """Metadata, tags, errors and progress from a payload (NULL read as ``{}``), as
    ``awa.queue_storage_payload_errors`` and ``_tags`` read them: errors NULL when none."""
    body = func.coalesce(payload, _json("{}"))
    errors = _listed(body, "errors")
    tags = _elements(_listed(body, "tags"), func.jsonb_array_elements_text, Text)
    return {
        "errors": case(
            (func.jsonb_typeof(errors) != literal_column("'array'"), cast(null(), ARRAY(JSONB))),
            else_=_elements(errors, func.jsonb_array_elements, JSONB),
        ),
        "metadata": func.coalesce(
            body.op("->", return_type=JSONB)(literal_column("'metadata'")), _json("{}")
        ),
        "tags": func.coalesce(tags, cast(literal_column("'{}'"), ARRAY(Text))),
        "progress": func.nullif(
            body.op("->", return_type=JSONB)(literal_column("'progress'")), _json("null")
        ),
    }


def with_attempt(payload: ColumnElement[Any], attempt: FromClause) -> dict[str, Any]:
    """A running attempt's payload with its ``attempt_state``: progress over the payload's,
    the callback result as ``metadata._awa_callback_result``."""
    read = _payload(payload)
    result = attempt.c.callback_result
    merged = read["metadata"].op("||", return_type=JSONB)(
        func.jsonb_build_object(literal_column("'_awa_callback_result'"), result, type_=JSONB)
    )
    return {
        **read,
        "metadata": case((result.is_(None), read["metadata"]), else_=merged),
        "progress": func.coalesce(attempt.c.progress, read["progress"]),
        "callback_filter": attempt.c.callback_filter,
        "callback_on_complete": attempt.c.callback_on_complete,
        "callback_on_fail": attempt.c.callback_on_fail,
        "callback_transform": attempt.c.callback_transform,
    }


def ready_anchor(ready: FromClause) -> tuple[Any, ...]:
    r = ready.c
    return (
        literal_column(str(READY)),
        r.ready_slot,
        r.ready_generation,
        r.enqueue_shard,
        r.lane_seq,
    )


def of_ready(ready: FromClause) -> dict[str, Any]:
    """What a candidate standing on a ready row reads from it."""
    r = ready.c
    return {
        "id": r.job_id,
        "kind": r.kind,
        "queue": r.queue,
        "args": r.args,
        "priority": r.priority,
        "run_at": r.run_at,
        "created_at": r.created_at,
        "unique_key": r.unique_key,
        **_payload(r.payload),
    }


def lane_match(ready: FromClause, of: FromClause, lane_seq: Any) -> ColumnElement[bool]:
    r, o = ready.c, of.c
    return and_(
        r.ready_slot == o.ready_slot,
        r.ready_generation == o.ready_generation,
        r.queue == o.queue,
        r.enqueue_shard == o.enqueue_shard,
        r.lane_seq == lane_seq,
    )


def ready_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    ready = t["ready_entries"].alias("ready")
    r = ready.c
    values = {**of_ready(ready), "state": state("available"), "attempt": r.attempt}
    values |= {"run_lease": r.run_lease, "max_attempts": r.max_attempts}
    values["attempted_at"] = r.attempted_at
    return select(*row(values, ready_anchor(ready), 1)).where(r.job_id == job)


def deferred_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    d = t["deferred_jobs"].alias("deferred").c
    values = {name: d[name] for name in _STORED if name in d}
    values |= {"id": d.job_id, **_payload(d.payload)}
    return select(*row(values, _own(DEFERRED), 2)).where(d.job_id == job)


_STORED = (
    "kind",
    "queue",
    "args",
    "state",
    "priority",
    "attempt",
    "run_lease",
    "max_attempts",
    "run_at",
    "attempted_at",
    "finalized_at",
    "created_at",
    "unique_key",
)


def _own(anchor: int) -> tuple[Any, ...]:
    zero: ColumnElement[Any] = literal_column("0")
    return (literal_column(str(anchor)), zero, zero, zero, zero)


def done_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    """``terminal_jobs``' first half: a ``done_entries`` row, its ready row filling in."""
    done = t["done_entries"].alias("done")
    ready = t["ready_entries"].alias("ready")
    d, r = done.c, ready.c
    values: dict[str, Any] = {n: d[n] for n in ("kind", "queue", "state", "priority", "attempt")}
    values |= {"id": d.job_id, "run_lease": d.run_lease, "finalized_at": d.finalized_at}
    values |= {
        "args": func.coalesce(d.args, r.args, cast(literal_column("'{}'"), JSONB)),
        "max_attempts": func.coalesce(
            d.max_attempts, r.max_attempts, cast(literal_column("25"), SmallInteger)
        ),
        "run_at": func.coalesce(d.run_at, r.run_at, d.finalized_at),
        "attempted_at": func.coalesce(d.attempted_at, r.attempted_at),
        "created_at": func.coalesce(d.created_at, r.created_at, d.finalized_at),
        "unique_key": func.coalesce(d.unique_key, r.unique_key),
        **_payload(func.coalesce(d.payload, r.payload)),
    }
    anchor: tuple[Any, ...] = (literal_column(str(DONE)), d.ready_slot, d.ready_generation)
    joined = done.outerjoin(ready, lane_match(ready, done, d.lane_seq) & (r.priority == d.priority))
    columns = row(values, (*anchor, d.enqueue_shard, d.lane_seq), 6)
    return select(*columns).select_from(joined).where(d.job_id == job)


def completed_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    """``terminal_jobs``' second half: a compact completion's position, found from each of the
    job's ready rows. ``receipt_completion_batches`` has no index by job (Awa dropped its GIN
    index to keep completions cheap), so the batches of the ready row's slot, generation and
    lane are read through their lane index, each tested for the job before it is expanded."""
    batch = t["receipt_completion_batches"].alias("batch")
    ready = t["ready_entries"].alias("ready")
    tomb = t["receipt_completion_tombstones"].alias("tomb")
    b, r = batch.c, ready.c
    items = (
        func.unnest(b.job_ids, b.run_leases, b.lane_seqs, b.attempts, b.attempted_ats)
        .table_valued(
            column("job_id", BigInteger),
            column("run_lease", BigInteger),
            column("lane_seq", BigInteger),
            column("attempt", SmallInteger),
            column("attempted_at", Timestamp),
        )
        .render_derived(name="item")
    )
    i = items.c
    buried = exists().where(
        tomb.c.ready_slot == b.ready_slot,
        tomb.c.ready_generation == b.ready_generation,
        tomb.c.job_id == i.job_id,
        tomb.c.run_lease == i.run_lease,
    )
    position = (
        select(b.priority, b.queue, b.finalized_at, i.attempt, i.run_lease, i.attempted_at)
        .select_from(batch.join(items, true()))
        .where(
            b.ready_slot == r.ready_slot,
            b.ready_generation == r.ready_generation,
            b.queue == r.queue,
            b.priority == r.priority,
            b.enqueue_shard == r.enqueue_shard,
            r.job_id == any_(b.job_ids),
            i.lane_seq == r.lane_seq,
            i.job_id == r.job_id,
            ~buried,
        )
        .lateral("completion")
    )
    p = position.c
    values = {**of_ready(ready), "state": state("completed"), "priority": p.priority}
    values |= {name: p[name] for name in ("attempt", "run_lease", "attempted_at")}
    values |= {"max_attempts": r.max_attempts, "finalized_at": p.finalized_at}
    values["queue"] = p.queue
    return (
        select(*row(values, ready_anchor(ready), 6))
        .select_from(ready.join(position, true()))
        .where(r.job_id == job)
    )


def dlq_leg(t: Tables, job: ColumnElement[Any]) -> Select[Any]:
    d = t["dlq_entries"].alias("dlq").c
    values = {name: d[name] for name in _STORED}
    values |= {"id": d.job_id, **_payload(d.payload)}
    return select(*row(values, _own(DLQ), 7)).where(d.job_id == job)


def canonical_leg(table: Table, anchor: int, job: ColumnElement[Any]) -> Select[Any]:
    job_row = table.alias("canonical_job").c
    values: dict[str, Any] = {name: job_row[name] for name, _ in JOB_COLUMNS}
    values["unique_states"] = cast(job_row.unique_states, Text)
    return select(*row(values, _own(anchor), 0)).where(job_row.id == job)


def rank_of(state_of: ColumnElement[Any]) -> ColumnElement[Any]:
    """awa-pg's state rank: what breaks a tie of run lease and transition time."""
    return _rank(state_of)
