"""The dead-letter queue of a queue-storage schema (``S.dlq_entries``), as awa-pg 0.6.9 reads
and writes it.

awa-pg's DLQ exists on queue storage only. A move takes a job's newest ``failed`` row out of
``S.done_entries`` (locked ``FOR UPDATE SKIP LOCKED``, read with what it shares with its ready
row), closes the removed attempt's ``lease_claims`` receipt as ``terminal_removed``, appends
the negative terminal-count delta, and files the row in ``dlq_entries`` with the reason, the
move's clock and the attempt's run lease (the unique claim stays: failed to failed). A purge
deletes ``dlq_entries`` rows. The listing filters are awa-pg's: kind, queue, a tag of the
payload, and a keyset cursor below ``(dlq_at, job_id)``; newest first.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Delete,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from awa_sa.administer.statements.failed_retry import (
    close_removed_receipts,
    removed_deltas,
    with_ready_columns,
)
from awa_sa.core.registry import statement
from awa_sa.core.sql import EMPTY_OBJECT, state
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import Timestamp

By = Literal["job", "filter"]


def _opt(name: str, type_: Any) -> ColumnElement[Any]:
    return bindparam(name, type_=type_)


def dlq_filter() -> ColumnElement[bool]:
    """awa-pg's filter: ``b_kind``, ``b_queue``, ``b_tag`` (each NULL for any) and the keyset
    cursor ``b_before_id`` / ``b_before_dlq_at`` (either, both, or neither)."""
    d = qs.dlq_entries.c
    kind, queue, tag = _opt("b_kind", Text), _opt("b_queue", Text), _opt("b_tag", Text)
    before_id, before_at = _opt("b_before_id", BigInteger), _opt("b_before_dlq_at", Timestamp)
    cursor = or_(
        and_(before_id.is_(None), before_at.is_(None)),
        and_(before_id.is_not(None), before_at.is_(None), d.job_id < before_id),
        and_(before_id.is_(None), before_at.is_not(None), d.dlq_at < before_at),
        and_(
            before_id.is_not(None),
            before_at.is_not(None),
            tuple_(d.dlq_at, d.job_id) < tuple_(before_at, before_id),
        ),
    )
    return and_(
        or_(kind.is_(None), d.kind == kind),
        or_(queue.is_(None), d.queue == queue),
        or_(
            tag.is_(None),
            d.payload.op("->")(literal_column("'tags'")).op("?", is_comparison=True)(tag),
        ),
        cursor,
    )


def _entry_columns() -> list[Any]:
    d = qs.dlq_entries.c
    payload = func.coalesce(d.payload, EMPTY_OBJECT).label("payload")
    return [*(c for c in d if c.name != "payload"), payload]


@statement
def list_dlq_rows() -> Select[Any]:
    """The DLQ rows the filter picks, newest move first, at most ``b_limit``."""
    d = qs.dlq_entries.c
    return (
        select(*_entry_columns())
        .where(dlq_filter())
        .order_by(d.dlq_at.desc(), d.job_id.desc())
        .limit(bindparam("b_limit", type_=BigInteger))
    )


@statement
def dlq_job_row() -> Select[Any]:
    """Job ``b_job_id``'s DLQ row, if it has one."""
    d = qs.dlq_entries.c
    return (
        select(*_entry_columns())
        .where(d.job_id == bindparam("b_job_id", type_=BigInteger))
        .order_by(d.dlq_at.desc())
        .limit(literal_column("1"))
    )


@statement
def dlq_count() -> Select[Any]:
    """How many DLQ rows, of queue ``b_queue`` or of every queue (NULL)."""
    d = qs.dlq_entries.c
    queue = _opt("b_queue", Text)
    return select(cast(func.count(), BigInteger).label("depth")).where(
        or_(queue.is_(None), d.queue == queue)
    )


@statement
def purge_dlq_rows(*, by: By) -> Delete:
    """Delete job ``b_job_id``'s DLQ row, or the rows the filter picks."""
    dlq = qs.dlq_entries
    if by == "job":
        return delete(dlq).where(dlq.c.job_id == bindparam("b_job_id", type_=BigInteger))
    return delete(dlq).where(dlq_filter())


@statement
def dlq_move_targets(*, by: By) -> Select[Any]:
    """Lock the failed rows a move takes (skipping locked ones, as awa-pg does): job
    ``b_job_id``'s newest, or every one of kind ``b_kind`` and queue ``b_queue`` (NULL for
    any); their ids, run leases and clocks, for the receipts' locks and the move."""
    done = qs.done_entries
    d = done.c
    failed = d.state == state("failed")
    if by == "job":
        return (
            select(d.job_id, d.run_lease, d.finalized_at)
            .where(d.job_id == bindparam("b_job_id", type_=BigInteger), failed)
            .order_by(d.finalized_at.desc())
            .limit(literal_column("1"))
            .with_for_update(skip_locked=True)
        )
    kind, queue = _opt("b_kind", Text), _opt("b_queue", Text)
    return (
        select(d.job_id, d.run_lease, d.finalized_at)
        .where(failed, or_(kind.is_(None), d.kind == kind), or_(queue.is_(None), d.queue == queue))
        .order_by(d.job_id, d.finalized_at)
        .with_for_update()
    )


@statement
def move_to_dlq() -> Select[Any]:
    """Take the locked failed rows (``b_job_ids`` with ``b_finalized_ats``) out of
    ``done_entries``, close their receipts, append their summed deltas, and file each in
    ``dlq_entries`` with reason ``b_reason``; answers the DLQ rows by id."""
    done, dlq = qs.done_entries, qs.dlq_entries
    keys = select(
        func.unnest(bindparam("b_job_ids", type_=ARRAY(BigInteger))).label("job_id"),
        func.unnest(bindparam("b_finalized_ats", type_=ARRAY(Timestamp))).label("at"),
    ).subquery("keys")
    removed = (
        delete(done)
        .where(
            tuple_(done.c.job_id, done.c.finalized_at).in_(select(keys.c.job_id, keys.c.at)),
            done.c.state == state("failed"),
        )
        .returning(*done.c)
        .cte("removed")
    )
    proj = with_ready_columns(removed, "run_at", "attempted_at").cte("moved_rows")
    p = proj.c
    values: dict[str, Any] = {
        "dlq_reason": bindparam("b_reason", type_=Text),
        "dlq_at": func.now(),
        "original_run_lease": p.run_lease,
        "payload": cast(case((p.payload == EMPTY_OBJECT, None), else_=p.payload), JSONB),
    }
    source = select(
        *(values[c.name].label(c.name) if c.name in values else p[c.name] for c in dlq.c)
    )
    filed = (
        insert(dlq)
        .from_select([c.name for c in dlq.c], source.select_from(proj))
        .returning(*_filed_columns(dlq))
        .cte("filed")
    )
    effects = [close_removed_receipts(removed), removed_deltas(removed, summed=True)]
    return select(*filed.c).order_by(filed.c.job_id).add_cte(*effects)


def _filed_columns(dlq: Any) -> list[Any]:
    payload = func.coalesce(dlq.c.payload, EMPTY_OBJECT).label("payload")
    return [*(c for c in dlq.c if c.name != "payload"), payload]


@statement
def dlq_routing() -> Select[Any]:
    """The queue-storage schema routing points at (NULL: canonical), read after the routing
    lock: the schema whose ``dlq_entries`` awa-pg's DLQ calls use."""
    return select(func.awa.active_queue_storage_schema(type_=Text).label("routing_schema"))
