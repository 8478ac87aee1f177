"""New jobs' rows as ``enqueue`` and ``enqueue_many`` answer them, built for batches.

A batch answers one :class:`~awa_sa.enqueue.new_jobs.EnqueuedJob` per job, so what building
one costs is paid thousands of times: :func:`new_row` builds it without the dataclass's
``__init__``, :func:`enqueued` reads a batch's JSON texts in one call, and
:func:`plain_answers` reads nothing back from the server but ids (docs/performance.md#enqueue).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from awa_sa.enqueue.bulk_lanes import Plan
from awa_sa.enqueue.bulk_plain import Written
from awa_sa.enqueue.new_jobs import EnqueuedJob, Prepared
from awa_sa.enqueue.statements import Batch

_NEW = object.__new__
(_ID, _KIND, _QUEUE, _STATE, _PRIORITY, _ATTEMPT, _MAX_ATTEMPTS, _RUN_AT, _CREATED_AT, _ARGS) = (
    getattr(EnqueuedJob, name).__set__ for name in EnqueuedJob.__slots__[:10]
)
(_METADATA, _TAGS, _UNIQUE_KEY) = (
    getattr(EnqueuedJob, name).__set__ for name in EnqueuedJob.__slots__[10:]
)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a batch's rows are made.

    Making thousands of rows (each with its args' dicts) starts the collector every 700
    allocations, and every tenth of its passes walks the older generations too: in a service's
    large heap that pass, not the rows, was most of the client's time for a batch. Nothing a
    batch makes holds a cycle, so the collector is held off for the loop and left as it was
    found (a caller's ``gc.disable()`` stays).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def new_row(  # noqa: PLR0917 -- EnqueuedJob's fields, in order, as its __init__ takes them
    job_id: int,
    kind: str,
    queue: str,
    state: str,
    priority: int,
    attempt: int,
    max_attempts: int,
    run_at: datetime,
    created_at: datetime,
    args: Any,
    metadata: dict[str, Any],
    tags: tuple[str, ...],
    unique_key: bytes | None,
) -> EnqueuedJob:
    """``EnqueuedJob(...)`` in less than half the time, for a batch's thousands of rows.

    The frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, which
    finds the slot's descriptor by name every time; here each slot's descriptor is found once,
    at import, and called directly. The row is whole before anyone sees it, and
    ``EnqueuedJob`` has no ``__post_init__`` to skip (tests/unit checks both).
    """
    row = _NEW(EnqueuedJob)
    _ID(row, job_id)
    _KIND(row, kind)
    _QUEUE(row, queue)
    _STATE(row, state)
    _PRIORITY(row, priority)
    _ATTEMPT(row, attempt)
    _MAX_ATTEMPTS(row, max_attempts)
    _RUN_AT(row, run_at)
    _CREATED_AT(row, created_at)
    _ARGS(row, args)
    _METADATA(row, metadata)
    _TAGS(row, tags)
    _UNIQUE_KEY(row, unique_key)
    return row


@collector_paused()
def enqueued(jobs: Sequence[Prepared], rows: Sequence[Any]) -> list[EnqueuedJob]:
    """The typed rows of new jobs: what was sent, and what the function answered for each.

    The JSON texts are read in one call for the whole batch (a JSON array of them), and each
    row is built with positional arguments, in :class:`EnqueuedJob`'s field order: keywords
    made the construction twice as slow, a cost a batch pays per job.
    """
    args = json.loads("[" + ",".join([row[3] for row in rows]) + "]")
    out = []
    for values, (job_id, run_at, created_at, _, metadata), payload in zip(
        jobs, rows, args, strict=True
    ):
        key = values.unique_key
        out.append(
            new_row(
                job_id,
                values.kind,
                values.queue,
                values.state,
                values.priority,
                0,
                values.max_attempts,
                run_at,
                created_at,
                payload,
                {} if metadata == "{}" else json.loads(metadata),
                values.tag_list,
                None if key is None else bytes.fromhex(key),
            )
        )
    return out


@collector_paused()
def plain_answers(batch: Batch, planned: Plan, written: Written) -> list[EnqueuedJob]:
    """Each position's row from what the client sent and the ids drawn: the args and
    metadata parsed from the batch's own text (:func:`is_plain`: stored as written), the ids
    put back in input order, ``run_at`` the clock reading for a ready job."""
    jobs = batch.jobs
    assert batch.text is not None  # a batch of one job has its args as text: never plain
    count = len(jobs)
    ids, created_at = written.ids, written.created_at
    if len(ids) != count:
        raise RuntimeError(f"the batch wrote {len(ids)} jobs of {count}")
    if batch.shape == "shared":
        payloads = json.loads(batch.text)
    else:
        payloads = [item["args"] for item in json.loads(batch.text)]
    run_ats: list[datetime] = [created_at] * (count - len(written.run_ats))
    run_ats += written.run_ats
    order = planned.order
    if order is not None:
        by_position, at = [0] * count, [created_at] * count
        for drawn, position in enumerate(order):
            by_position[position], at[position] = ids[drawn], run_ats[drawn]
        ids, run_ats = by_position, at
    out = []
    for job_id, job, run_at, payload in zip(ids, jobs, run_ats, payloads, strict=True):
        metadata = job.metadata
        out.append(
            new_row(
                job_id,
                job.kind,
                job.queue,
                job.state,
                job.priority,
                0,
                job.max_attempts,
                run_at,
                created_at,
                payload,
                {} if metadata == "{}" else json.loads(metadata),
                job.tag_list,
                None,
            )
        )
    return out
