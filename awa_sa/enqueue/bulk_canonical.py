"""A batch on the canonical plane in one statement, through the tables' own triggers.

While routing is canonical (the ``canonical`` and ``prepared`` phases), ``awa.insert_job_compat``
inserts each job into ``awa.jobs_hot`` (available) or ``awa.scheduled_jobs`` (scheduled) with
one ``INSERT ... VALUES``: its id from the column default, ``run_at`` its own
``clock_timestamp()`` when none is given, every other column the table's default. The tables'
row triggers do the rest (the unique claim, raising 23505 on a key held; the NOTIFY). So one
``INSERT ... SELECT`` per table writes the same rows, claims and NOTIFYs, with the ids drawn in
input order first (a batch of both kinds must not number one table's rows before the
other's). What differs is the statement trigger that appends dirty marks: once per statement
rather than once per job, so the same queues and kinds are marked with fewer identical rows
(docs/contract.md#bulk-enqueue). Checked against awa-pg's ``insert_many_copy`` on twin
clusters (``tests/integration/test_enqueue_twins.py``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Select,
    Text,
    cast,
    func,
    insert,
    literal_column,
    not_,
    select,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement

from awa_sa.core.registry import Query, Rows, statement
from awa_sa.core.sql import state
from awa_sa.enqueue.bulk import _jobs
from awa_sa.enqueue.statements import Batch, Shape, insert_binds
from awa_sa.tables.canonical import jobs_hot, scheduled_jobs

_ID = func.nextval(literal_column("'awa.jobs_id_seq'::regclass"), type_=BigInteger)
"""What the tables' ``id`` default draws, drawn here in input order."""


@statement
def bulk_canonical(*, shape: Shape) -> Select[Any]:
    """The batch into ``jobs_hot`` and ``scheduled_jobs``; per job in input order ``(id,
    run_at, created_at, args, metadata)``, JSON as text, as ``insert_jobs`` answers."""
    jobs = _jobs(shape)
    ordered = select(jobs).order_by(jobs.c.position).subquery("ordered")
    numbered = (
        select(ordered, cast(_ID, BigInteger).label("id"))
        .cte("numbered")
        .prefix_with("MATERIALIZED")
    )
    n = numbered.c
    writes = []
    for table, ready in ((jobs_hot, True), (scheduled_jobs, False)):
        values: dict[str, ColumnElement[Any]] = {
            "id": n.id,
            "kind": n.kind,
            "queue": n.queue,
            "args": n.args,
            "state": state("available" if ready else "scheduled"),
            "priority": n.priority,
            "max_attempts": n.max_attempts,
            "run_at": func.clock_timestamp() if ready else n.run_at,
            "metadata": n.metadata,
            "tags": n.tags,
            "unique_key": n.unique_key,
            "unique_states": n.unique_bits,
        }
        source = (
            select(*(v.label(name) for name, v in values.items()))
            .where(n.ready if ready else not_(n.ready))
            .order_by(n.id)
        )
        written = (
            insert(table)
            .from_select(list(values), source)
            .returning(
                table.c.id,
                table.c.run_at,
                table.c.created_at,
                cast(table.c.args, Text).label("args"),
                cast(table.c.metadata, Text).label("metadata"),
            )
            .cte("hot" if ready else "scheduled")
        )
        writes.append(select(written))
    both = union_all(*writes).subquery("written")
    return select(both).order_by(both.c.id)


BULK_CANONICAL: Query[Batch, Rows] = Query(
    shape=lambda batch: bulk_canonical(shape=batch.shape),
    binds=insert_binds,
    read=lambda rows: rows,
    by_position=True,
)
"""The batch in; per job, in input order, ``(id, run_at, created_at, args, metadata)``."""
