"""Jobs as one selectable, in the shape PostgreSQL can join by index.

PostgreSQL pushes a join's condition into a subquery only where it can pull the subquery up
into the join: a plain ``SELECT ... FROM ... WHERE``, or a UNION ALL whose every branch reads
one table with no WHERE. A union of candidates per job, or ``DISTINCT ON`` over it, stays a
subquery that is built whole and then hashed against the caller's rows: every job, per
statement. So the selectable is put together in the shape that pulls up:

* the **anchors**: one branch per table a job's answer can stand on, each a bare read of
  that table (the canonical ``jobs_hot`` and ``scheduled_jobs``, and the schema's
  ``ready_entries``, ``done_entries``, ``deferred_jobs`` and ``dlq_entries``), with the job's
  id, kind and queue. A filter or a join on those reaches each table's own index;
* for each anchor, **the job's answer** in a LATERAL subquery on its id: the job's
  candidates (:mod:`awa_sa.read.statements.candidates`), each read by the job's id, the
  greatest picked as awa-pg picks it;
* the anchor row kept only where the answer stands on it, so each job is one row.

A job with three rows behind it reads its candidates three times; every read is by index.
A filter on the state or any column of the answer is applied to each job the anchors found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    case,
    cast,
    func,
    literal_column,
    select,
    true,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause, Subquery

from awa_sa.read.statements.candidates import (
    ANCHOR,
    DEFERRED,
    DLQ,
    DONE,
    HOT,
    JOB_COLUMNS,
    READY,
    SCHEDULED,
    Tables,
    canonical_leg,
    completed_leg,
    deferred_leg,
    dlq_leg,
    done_leg,
    rank_of,
    ready_leg,
)
from awa_sa.read.statements.running import batch_claims_leg, claims_leg, leases_leg
from awa_sa.tables.canonical import jobs_hot, scheduled_jobs

Planes = Literal["canonical", "queue_storage", "routed"]
"""Which jobs: the canonical plane's, one queue-storage schema's, or those of whichever
plane routing points at when the statement runs (as awa-pg reports them)."""

Leg = Callable[[Tables, ColumnElement[Any]], Select[Any]]
QUEUE_STORAGE_LEGS: tuple[Leg, ...] = (
    ready_leg,
    deferred_leg,
    leases_leg,
    claims_leg,
    batch_claims_leg,
    done_leg,
    completed_leg,
    dlq_leg,
)


def _number(n: int, type_: Any = SmallInteger) -> ColumnElement[Any]:
    return cast(literal_column(str(n)), type_)


def _anchor_leg(
    table: FromClause, anchor: int, id_name: str, place: Sequence[str] | None
) -> Select[Any]:
    c = table.c
    spots: list[ColumnElement[Any]]
    if place is None:
        types = (Integer, BigInteger, SmallInteger, BigInteger)
        spots = [_number(0, type_) for type_ in types]
    else:
        spots = [c[name] for name in place]
    names = [name for name, _ in ANCHOR[1:]]
    return select(
        _number(anchor).label("anchor"),
        c[id_name].label("id"),
        c.kind,
        c.queue,
        *(spot.label(name) for spot, name in zip(spots, names, strict=True)),
    )


_NAMES = [name for name, _ in JOB_COLUMNS]
_PLACE = ("ready_slot", "ready_generation", "enqueue_shard", "lane_seq")


def anchors(t: Tables, planes: Planes) -> Subquery:
    """Every row a job's answer can stand on, one bare read per table."""
    legs = []
    if planes != "queue_storage":
        legs += [_anchor_leg(jobs_hot, HOT, "id", None)]
        legs += [_anchor_leg(scheduled_jobs, SCHEDULED, "id", None)]
    if planes != "canonical":
        legs += [
            _anchor_leg(t["ready_entries"], READY, "job_id", _PLACE),
            _anchor_leg(t["done_entries"], DONE, "job_id", _PLACE),
            _anchor_leg(t["deferred_jobs"], DEFERRED, "job_id", None),
            _anchor_leg(t["dlq_entries"], DLQ, "job_id", None),
        ]
    return union_all(*legs).subquery("anchored")


def _routing() -> ColumnElement[Any]:
    return select(func.awa.active_queue_storage_schema(type_=Text)).scalar_subquery()


def answer(t: Tables, anchored: Subquery, planes: Planes, schema: ColumnElement[Any] | None) -> Any:
    """The job's answer for each anchor row, as a LATERAL subquery on its id."""
    a = anchored.c
    legs: list[Select[Any]] = []
    canonical_gate: list[ColumnElement[bool]] = []
    qs_gate: list[ColumnElement[bool]] = [a.anchor >= _number(READY)]
    if planes == "routed":
        canonical_gate.append(_routing().is_(None))
        assert schema is not None
        qs_gate.append(_routing() == schema)
    if planes != "queue_storage":
        for table, number in ((jobs_hot, HOT), (scheduled_jobs, SCHEDULED)):
            gate = and_(a.anchor == _number(number), *canonical_gate)
            legs.append(canonical_leg(table, number, a.id).where(gate).correlate(anchored))
    if planes != "canonical":
        legs += [leg(t, a.id).where(*qs_gate).correlate(anchored) for leg in QUEUE_STORAGE_LEGS]
    return _best(legs, "candidate").lateral("answer")


def _best(legs: list[Select[Any]], name: str) -> Select[Any]:
    """The greatest of the candidates, as awa-pg picks it."""
    found = union_all(*legs).subquery(name)
    c = found.c
    return (
        select(found)
        .order_by(
            c.run_lease.desc(),
            c.moment.desc(),
            rank_of(c.state).desc(),
            c.reading.desc(),
            c.anchor_lane.desc(),
        )
        .limit(literal_column("1"))
    )


def one_job(t: Tables, planes: Planes, job: ColumnElement[Any], schema: Any) -> Select[Any]:
    """Job *job* on the plane routing points at, and routing itself, in one row: the
    candidates read straight by the job's id, without the anchors a join needs (every
    candidate stands on a row of its own tables). The routing function runs once; the
    canonical candidates are read only while it says canonical, those of *schema* (a bound
    value) only while it names *schema*: a row whose ``routing_schema`` is another schema
    carries no job, and the caller reads again for that one."""
    # Materialised, so the function runs once rather than in every leg's gate.
    routing = (
        select(func.awa.active_queue_storage_schema(type_=Text).label("schema"))
        .cte("routing")
        .prefix_with("MATERIALIZED")
    )
    now = routing.c.schema
    legs = [
        canonical_leg(table, number, job).where(now.is_(None))
        for table, number in ((jobs_hot, HOT), (scheduled_jobs, SCHEDULED))
    ]
    if planes != "canonical":
        legs += [leg(t, job).where(now == schema) for leg in QUEUE_STORAGE_LEGS]
    best = _best(legs, "candidate").lateral("answer")
    columns = [now.label("routing_schema"), *(best.c[name] for name, _ in JOB_COLUMNS)]
    return select(*columns).select_from(routing.outerjoin(best, true()))


def job_selectable(
    t: Tables, planes: Planes, schema: ColumnElement[Any] | None = None
) -> Select[Any]:
    """One row per job: its columns as awa-pg answers them (:data:`JOB_COLUMNS` order), and
    ``storage`` when *schema* names the queue-storage schema (``'canonical'`` otherwise)."""
    if planes == "canonical":
        return _canonical_only(schema is not None)
    anchored = anchors(t, planes)
    found = answer(t, anchored, planes, schema)
    a, w = anchored.c, found.c
    columns: list[Any] = [a.id, a.kind, a.queue]
    columns += [w[name] for name, _ in JOB_COLUMNS[3:]]
    if schema is not None:
        is_canonical = a.anchor < _number(READY)
        canonical = cast(literal_column("'canonical'"), Text)
        columns.append(case((is_canonical, canonical), else_=schema).label("storage"))
    same = [a[name] == w[name] for name, _ in ANCHOR]
    return select(*columns).select_from(anchored.join(found, and_(*same)))


def _canonical_only(with_storage: bool) -> Select[Any]:
    """The canonical plane alone: a bare union of its two tables, as ``awa.jobs`` reads."""
    legs = []
    for table in (jobs_hot, scheduled_jobs):
        c = table.c
        cols: list[Any] = [c[name] for name, _ in JOB_COLUMNS]
        cols[_NAMES.index("unique_states")] = cast(c.unique_states, Text).label("unique_states")
        if with_storage:
            cols.append(cast(literal_column("'canonical'"), Text).label("storage"))
        legs.append(select(*cols))
    return union_all(*legs)  # type: ignore[return-value]
