"""``list_jobs``' statement on each plane, as awa-pg 0.6.9's ``list_jobs`` answers.

While routing is canonical awa-pg reads ``awa.jobs`` (then ``jobs_hot`` and ``scheduled_jobs``)
filtered by state, kind, queue, tag and ``id < before_id``, newest id first, ``LIMIT`` as asked.
On queue storage it starts from :func:`~awa_sa.read.statements.current.current_jobs`, filtered
the same way by each row's own state, and loads each id it finds, newest first, as ``get_job``
does; it keeps a loaded job only when the job's own state, kind, queue and tags pass the
filters too, and stops at the limit (clamped to 1..1000). It pages through the candidates in
rounds of three times the limit; every round is read in full until the limit is met, so the
answer is the first ``limit`` candidates whose loaded job passes, which one statement gives:
the candidates joined to their jobs (:mod:`awa_sa.read.statements.jobs`), ordered by id.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import BigInteger, Text, bindparam, cast, or_, select
from sqlalchemy.dialects.postgresql import ARRAY, array
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Select

from awa_sa.core.registry import statement
from awa_sa.read.statements.current import current_jobs
from awa_sa.read.statements.jobs import job_selectable
from awa_sa.read.statements.schemas import placeholder
from awa_sa.tables.canonical import job_state

Plane = Literal["canonical", "queue_storage"]
QS_LIMIT = (1, 1000)
"""awa-pg clamps a queue-storage listing's limit into this range (a canonical one it does not)."""


def _asked(name: str, type_: Any) -> ColumnElement[Any]:
    return cast(bindparam(name, type_=Text), type_)


def _filters(
    state_of: Any, kind: Any, queue: Any, job_id: Any, tags: Any = None
) -> list[ColumnElement[bool]]:
    """awa-pg's ``($n IS NULL OR column = $n)`` filters, on the columns given."""
    asked_state = _asked("b_state", job_state)
    asked_kind, asked_queue = _asked("b_kind", Text), _asked("b_queue", Text)
    before = cast(bindparam("b_before_id", type_=BigInteger), BigInteger)
    found = [
        or_(asked_state.is_(None), state_of == asked_state),
        or_(asked_kind.is_(None), kind == asked_kind),
        or_(asked_queue.is_(None), queue == asked_queue),
    ]
    if tags is not None:
        tag = _asked("b_tag", Text)
        found.append(or_(tag.is_(None), tags.op("@>")(cast(array([tag]), ARRAY(Text)))))
    if job_id is not None:
        found.append(or_(before.is_(None), job_id < before))
    return found


@statement
def list_jobs_rows(*, plane: Plane) -> Select[Any]:
    """Jobs as awa-pg's ``list_jobs`` lists them on *plane* (``b_state``, ``b_kind``,
    ``b_queue``, ``b_tag``, ``b_before_id``, each NULL for any; ``b_limit``), newest id first,
    every column as ``get_job`` answers it."""
    limit = bindparam("b_limit", type_=BigInteger)
    if plane == "canonical":
        jobs = job_selectable(placeholder(), "canonical").subquery("job")
        j = jobs.c
        where = _filters(j.state, j.kind, j.queue, j.id, j.tags)
        return select(jobs).where(*where).order_by(j.id.desc()).limit(limit)
    listed = current_jobs(placeholder())
    c = listed.c
    candidates = (
        select(c.job_id).where(*_filters(c.state, c.kind, c.queue, c.job_id)).subquery("candidate")
    )
    jobs = job_selectable(placeholder(), "queue_storage").subquery("job")
    j = jobs.c
    return (
        select(jobs)
        .select_from(candidates.join(jobs, j.id == candidates.c.job_id))
        .where(*_filters(j.state, j.kind, j.queue, None, j.tags))
        .order_by(candidates.c.job_id.desc())
        .limit(limit)
    )
