"""The read statements awa-sa sends: routing, and one job by id with the routing it met.

awa-pg 0.6.9's ``get_job`` reads routing (``awa.active_queue_storage_schema()``) and then the
job on that plane alone: the canonical ``awa.jobs`` rows while routing is canonical, the
routing schema's candidates once it points at queue storage (``mixed_transition`` and
``active``). :func:`read_job` does both in one statement, in the caller's transaction;
:func:`read_routing` alone serves the first read on an Engine and the listings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import BigInteger, Select, Text, bindparam, func, select

from awa_sa.core.job_rows import JobRow
from awa_sa.core.registry import Query, no_binds, statement
from awa_sa.read.statements.candidates import JOB_COLUMNS
from awa_sa.read.statements.jobs import one_job
from awa_sa.read.statements.schemas import placeholder

Plane = Literal["canonical", "queue_storage"]


@statement
def read_routing() -> Select[Any]:
    """The queue-storage schema routing points at (NULL while it is canonical), read without
    a lock, as awa-pg's reads read it."""
    return select(func.awa.active_queue_storage_schema(type_=Text).label("routing_schema"))


@statement
def read_job(*, plane: Plane) -> Select[Any]:
    """Job ``b_job_id`` as awa-pg's ``get_job`` answers it, and the routing it read, in one
    row: on the canonical plane its ``jobs_hot`` or ``scheduled_jobs`` row; on queue storage,
    while routing names ``b_schema`` (the schema the text was compiled for), the greatest of
    its candidates, each read through an index. *plane* ``canonical`` is the text for a
    cluster whose routing was last seen canonical (it reads no queue-storage table)."""
    job = bindparam("b_job_id", type_=BigInteger)
    schema = bindparam("b_schema", type_=Text)
    return one_job(placeholder(), "canonical" if plane == "canonical" else "routed", job, schema)


ROUTING: Query[None, str | None] = Query(
    lambda _: read_routing(), no_binds, lambda rows: rows[0].routing_schema
)


def job_rows(rows: Sequence[Any], storage: str) -> list[JobRow]:
    """Rows of :data:`~awa_sa.read.statements.candidates.JOB_COLUMNS` as :class:`JobRow`."""
    found = []
    for row in rows:
        fields = dict(zip([name for name, _ in JOB_COLUMNS], row, strict=False))
        fields["errors"] = list(fields["errors"] or [])
        fields["tags"] = list(fields["tags"] or [])
        key = fields["unique_key"]
        fields["unique_key"] = None if key is None else bytes(key)
        found.append(JobRow(**fields, storage=storage))
    return found
