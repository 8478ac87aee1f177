"""The running attempts of both planes, listed: the statements ``awa_sa.settle.running`` reads.

A canonical attempt is a ``running`` row of ``awa.jobs_hot``; a queue-storage attempt is an open
receipt of the routing schema (:func:`~awa_sa.settle.statements.receipts.open_receipts`). The
statements take every filter as a parameter (NULL: no filter), so each is compiled once
whatever a caller asks, and come with their typed parameters (:class:`Filters`) and rows
(:class:`Listed`). The queue-storage one has two shapes: with ``job_id`` given (every
``attempt_of``) it reads only that job's receipts, without it every receipt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    BigInteger,
    Integer,
    Interval,
    Select,
    SmallInteger,
    Subquery,
    Text,
    bindparam,
    case,
    cast,
    false,
    func,
    literal_column,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.core.registry import statement
from awa_sa.settle.statements.canonical import queue_storage_schema
from awa_sa.settle.statements.job_receipts import LOOKUP_BINDS, claim_of_job, receipts_of
from awa_sa.settle.statements.receipt_settles import generic_plan_next, receipt_lock_key
from awa_sa.settle.statements.receipts import COLUMNS, no_value, open_receipts
from awa_sa.tables.canonical import Timestamp, jobs_hot

DEFAULT_SCHEMA = "awa"
"""The queue-storage schema :func:`attempt_lookup` reads: the one ``awa migrate`` installs its
substrate in beside the canonical tables (so its tables exist on every migrated cluster, in
every phase), and the one an awa-pg runtime routes to unless told otherwise."""


def _param(name: str, type_: Any) -> ColumnElement[Any]:
    return cast(bindparam(name, type_=type_), type_)


def _filter(name: str, type_: Any, match: Any) -> ColumnElement[bool]:
    """``value IS NULL OR <match>``: a parameter left NULL filters nothing."""
    value = _param(name, type_)
    return or_(value.is_(None), match(value))


def _listed(attempts: Subquery, *leading: ColumnElement[Any]) -> Select[Any]:
    """The attempts of *attempts* that pass every ``f_*`` filter, oldest claim first."""
    a = attempts.c
    return (
        select(
            *leading,
            *(a[name] for name in COLUMNS),
            (func.now() - a.attempted_at).label("running_for"),
        )
        .where(
            _filter("f_queue", Text, lambda v: a.queue == v),
            _filter("f_kind", Text, lambda v: a.kind == v),
            _filter("f_running_for", Interval, lambda v: a.attempted_at <= func.now() - v),
            _filter("f_job_id", BigInteger, lambda v: a.job_id == v),
            _filter("f_attempt", SmallInteger, lambda v: a.attempt == v),
            _filter("f_created_at", Timestamp, lambda v: a.created_at == v),
        )
        .order_by(a.attempted_at, a.job_id)
        .limit(_param("f_limit", BigInteger))
    )


@cache
def canonical_attempts() -> Select[Any]:
    """The canonical running attempts, and the routing schema, in one statement.

    One row at least: the routing schema (NULL unless routing is queue storage) left-joined
    with the filtered attempts, so a canonical cluster is read in one round trip.
    """
    t = jobs_hot
    running = (
        select(
            t.c.id.label("job_id"),
            t.c.run_lease,
            t.c.kind,
            t.c.queue,
            t.c.args,
            t.c.created_at,
            t.c.attempt,
            t.c.max_attempts,
            t.c.attempted_at,
            t.c.heartbeat_at,
            t.c.deadline_at,
            no_value("claim_slot", Integer),
            no_value("receipt_id", BigInteger),
            no_value("claim_batch_id", BigInteger),
            no_value("claim_batch_index", Integer),
        )
        .where(t.c.state == "running")
        .subquery("running")
    )
    listed = _listed(running).subquery("listed")
    routing = select(func.awa.active_queue_storage_schema().label("routing")).subquery("routing")
    return (
        select(routing.c.routing, *(listed.c[name] for name in (*COLUMNS, "running_for")))
        .select_from(routing.outerjoin(listed, true()))
        .order_by(listed.c.attempted_at, listed.c.job_id)
    )


LookupReads = Literal["canonical", "receipts", "locked"]
"""What :func:`attempt_lookup` reads: the canonical row alone, with the receipt too, or with the
receipt locked for the settle that follows in the same call."""


@statement
def attempt_lookup(reads: LookupReads) -> Select[Any]:
    """``attempt_of`` in one statement: the routing schema, the job's running canonical row and,
    with receipts, while routing names the schema this statement is compiled for, the job's
    open ``lease_claims`` receipt there
    (:func:`~awa_sa.settle.statements.job_receipts.claim_of_job`).

    ``locked`` also takes the receipt's advisory lock and asks for the settle's generic plan, as
    :func:`~awa_sa.settle.statements.receipt_settles.receipt_lock` does, on the receipt it finds
    (``settle`` of a job: the lookup and the lock in one statement, the settle next, which
    restores the plan mode). The lookup's snapshot is taken before the lock: the settle's, taken
    after it, is the one that decides.

    ``canonical``: the statement is the routing and the canonical row alone: a tenth of the
    plan, and a third of the execution, of a statement that carries a receipt leg over every
    partition PostgreSQL must open even where it skips the leg. It answers the whole question
    while routing is canonical; where routing says otherwise the caller asks again with them.

    One row at least: the routing (NULL: canonical; ``canonical`` says it without calling the
    routing function where the installed functions are the known ones:
    :func:`~awa_sa.settle.statements.canonical.queue_storage_schema`) left-joined with the
    matches, each with ``on_queue_storage`` and the receipt's ``ready_slot``. Compile it for
    :data:`DEFAULT_SCHEMA` and bind ``b_schema`` to that name: a statement names its tables
    when it is parsed, so only a schema that exists on every migrated cluster may be named
    before routing is known. The receipt leg runs only when the routing read in this very
    statement (one snapshot) equals ``b_schema``: a pseudo-constant PostgreSQL checks once and
    skips the leg otherwise. Routing to another schema, or no receipt found, and the caller
    reads on in the routing schema. The canonical row is found by the job's whole identity,
    every parameter required, so its generic plan is an index lookup of ``jobs_hot``.
    """
    types: tuple[Any, ...] = (BigInteger, SmallInteger, Text, Text, Timestamp)
    job, attempt, queue, kind, created_at = (
        _param(name, type_) for name, type_ in zip(LOOKUP_BINDS, types, strict=True)
    )
    # OFFSET 0 keeps the row found by its key alone: offered the queue and state too, the
    # generic plan scanned every running job of the queue (idx_awa_jobs_hot_queue_state).
    by_id = select(jobs_hot).where(jobs_hot.c.id == job).offset(literal_column("0"))
    t = by_id.subquery("hot").c
    # Where routing is expected canonical, the routing function is called only where needed.
    receipts = reads != "canonical"
    schema = queue_storage_schema()
    if receipts:
        schema = func.awa.active_queue_storage_schema(type_=Text)
    routing = select(schema.label("routing")).subquery("routing")
    canonical = select(
        t.id.label("job_id"),
        t.run_lease,
        t.kind,
        t.queue,
        t.args,
        t.created_at,
        t.attempt,
        t.max_attempts,
        t.attempted_at,
        t.heartbeat_at,
        t.deadline_at,
        no_value("claim_slot", Integer),
        no_value("receipt_id", BigInteger),
        no_value("claim_batch_id", BigInteger),
        no_value("claim_batch_index", Integer),
        (func.now() - t.attempted_at).label("running_for"),
        no_value("ready_slot", Integer),
        false().label("on_queue_storage"),
    ).where(
        t.id == job,
        t.state == literal_column("'running'"),
        t.attempt == attempt,
        t.queue == queue,
        t.kind == kind,
        t.created_at == created_at,
    )
    found = canonical.lateral("found")
    if receipts:
        claim = claim_of_job().subquery("receipt")
        receipt = select(*claim.c, true().label("on_queue_storage")).where(
            routing.c.routing == _param("b_schema", Text)
        )
        found = union_all(canonical, receipt).lateral("found")
    columns: list[Any] = [routing.c.routing, *found.c]
    if reads == "locked":
        on_receipt = found.c.on_queue_storage.is_(true())
        lock = func.pg_catalog.pg_advisory_xact_lock(
            receipt_lock_key(found.c.job_id, found.c.run_lease), type_=Text
        )
        columns += [
            case((on_receipt, lock)).label("locked"),
            case((on_receipt, generic_plan_next())).label("plan_mode"),
        ]
    return (
        select(*columns)
        .select_from(routing.outerjoin(found, true()))
        .order_by(found.c.attempted_at, found.c.job_id)
    )


@cache
def queue_storage_attempts(*, by_job: bool) -> Select[Any]:
    """The open receipts of one queue-storage schema, filtered (compile it with its translate
    map).

    ``by_job``: the shape for a listing with ``f_job_id`` given (``attempt_of`` always gives
    it). It reads only that job's receipts
    (:func:`~awa_sa.settle.statements.job_receipts.receipts_of`, a plan less than half as costly to
    make), and returns nothing when ``f_job_id`` is NULL; otherwise every receipt is read
    (:func:`open_receipts`), then filtered. The rows of a listing with ``f_job_id`` are the same
    either way: only the work differs (on a cluster with a few thousand settled compact receipts,
    every one unnested and checked against the closure evidence, and a cost that had PostgreSQL
    JIT-compile the plan).
    """
    if by_job:
        return _listed(receipts_of(_param("f_job_id", BigInteger)).subquery("attempts"))
    return _listed(open_receipts())


# --- the listings' parameters and rows -----------------------------------------------------


class Filters(NamedTuple):
    """What :func:`canonical_attempts` and :func:`queue_storage_attempts` filter on; None
    filters nothing."""

    queue: str | None = None
    kind: str | None = None
    running_for: timedelta | None = None
    job_id: int | None = None
    attempt: int | None = None
    created_at: datetime | None = None
    limit: int | None = None


def filter_binds(filters: Filters) -> dict[str, Any]:
    """The ``f_<field>`` parameters of *filters*."""
    return {f"f_{name}": value for name, value in filters._asdict().items()}


class Listed(NamedTuple):
    """One running attempt as a listing returns it, in :data:`COLUMNS` order."""

    job_id: int
    run_lease: int
    kind: str
    queue: str
    args: Any
    created_at: datetime
    attempt: int
    max_attempts: int
    attempted_at: datetime
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    claim_slot: int | None
    receipt_id: int | None
    claim_batch_id: int | None
    claim_batch_index: int | None
    running_for: timedelta


def listed(rows: Sequence[Any]) -> list[Listed]:
    """The attempts among the rows of a listing (:func:`queue_storage_attempts` too)."""
    return [
        Listed(*(getattr(r, name) for name in Listed._fields)) for r in rows if r.job_id is not None
    ]


@dataclass(frozen=True, slots=True)
class CanonicalListing:
    """The canonical attempts, and where routing points (None: canonical)."""

    routing: str | None
    attempts: list[Listed]

    @classmethod
    def read(cls, rows: Sequence[Any]) -> CanonicalListing:
        return cls(rows[0].routing, listed(rows))
