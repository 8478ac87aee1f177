"""A batch on queue storage, set-based: routing read under the singleton's share lock, then the
lanes and the one write (:mod:`awa_sa.enqueue.bulk`), as awa-pg's ``enqueue_many_copy`` writes.

Duplicates need no savepoint per job: the write claims each unique key with ``ON CONFLICT DO
NOTHING`` (waiting, as the claim index makes any insert wait, for a concurrent holder's
transaction), writes only the jobs whose claim it took, and says which. ``"skip"`` answers
the others as :class:`~awa_sa.enqueue.new_jobs.Duplicate`; ``"raise"`` must leave none of the
batch, so in the caller's transaction the lanes and the write run under one savepoint, rolled
back on a duplicate (the Engine form's own transaction is rolled back instead).
"""

from __future__ import annotations

from sqlalchemy import Connection

from awa_sa.core.compiled import run
from awa_sa.core.errors import DuplicateJob
from awa_sa.core.registry import Query, Rows
from awa_sa.enqueue.answers import enqueued, plain_answers
from awa_sa.enqueue.bulk import BULK_ROUTING, BULK_WRITE
from awa_sa.enqueue.bulk_canonical import BULK_CANONICAL
from awa_sa.enqueue.bulk_lanes import BULK_LANES, plan
from awa_sa.enqueue.bulk_plain import BULK_PLAIN, is_plain
from awa_sa.enqueue.new_jobs import Duplicate, EnqueuedJob
from awa_sa.enqueue.statements import INSERT_JOBS, UNIQUE_HOLDER, Batch


def set_based(
    conn: Connection, batch: Batch, on_duplicate: str, guard: bool
) -> list[EnqueuedJob | Duplicate] | Query[Batch, Rows]:
    """*batch* written set-based on queue storage, or (nothing written) the statement that
    writes it with the other planes' duplicate handling: ``insert_jobs``, the producer
    function per job, for a single ``enqueue`` (``Client.insert``'s rows), a transition seen
    moving or a queue with several enqueue shards; ``bulk_canonical`` for a batch while
    routing is canonical."""
    jobs = batch.jobs
    if not batch.many:
        return INSERT_JOBS
    routing = run(conn, BULK_ROUTING, sorted({job.queue for job in jobs}))
    schema = routing.set_based
    if schema is None:
        return BULK_CANONICAL if routing.canonical else INSERT_JOBS
    if is_plain(batch):
        planned = plan(batch)
        if planned.kinds != "scheduled":
            run(conn, BULK_LANES, (planned.lanes, schema), schema)
        written = run(conn, BULK_PLAIN, (batch, planned), schema)
        return [*plain_answers(batch, planned, written)]
    unique = any(job.unique_key is not None for job in jobs)
    if not (unique and on_duplicate == "raise" and guard):
        rows = _write(conn, batch, schema, on_duplicate)
        return _answer(conn, batch, rows, on_duplicate)
    savepoint = conn.begin_nested()
    try:
        rows = _write(conn, batch, schema, on_duplicate)
        out = _answer(conn, batch, rows, on_duplicate)
    except BaseException:
        savepoint.rollback()
        raise
    savepoint.commit()
    return out


def _write(conn: Connection, batch: Batch, schema: str, on_duplicate: str) -> Rows:
    planned = plan(batch)
    if planned.kinds != "scheduled":
        run(conn, BULK_LANES, (planned.lanes, schema), schema)
    return run(conn, BULK_WRITE, (batch, on_duplicate == "raise"), schema)


def _answer(
    conn: Connection, batch: Batch, rows: Rows, on_duplicate: str
) -> list[EnqueuedJob | Duplicate]:
    """Each position's answer: its row, or (a key already held) the duplicate's, which with
    ``"raise"`` is raised (its holder read before anything is rolled back)."""
    jobs = batch.jobs
    duplicates = [index for index, row in enumerate(rows) if row[6]]
    if duplicates and on_duplicate == "raise":
        index = duplicates[0]
        key = jobs[index].unique_key
        assert key is not None  # only a claim keeps a job out
        holder = run(conn, UNIQUE_HOLDER, key)
        raise DuplicateJob(jobs[index].kind, bytes.fromhex(key), holder, index)
    if not duplicates:
        return [*enqueued(jobs, [row[:5] for row in rows])]
    written = [index for index, row in enumerate(rows) if row[5]]
    made = iter(enqueued([jobs[i] for i in written], [rows[i][:5] for i in written]))
    out: list[EnqueuedJob | Duplicate] = []
    for job, row in zip(jobs, rows, strict=True):
        if row[5]:
            out.append(next(made))
            continue
        key = job.unique_key
        assert key is not None
        holder = run(conn, UNIQUE_HOLDER, key)
        out.append(Duplicate(job.kind, bytes.fromhex(key), holder))
    return out
