"""``settle`` given the awa-pg ``Job`` itself: the attempt found, locked and settled in one call.

A handler holding its job would otherwise send ``attempt_of``'s lookup, then the receipt's lock,
then the settle. Given the job, the lookup takes the receipt's lock itself (``attempt_lookup``
with ``reads="locked"``), so the settle follows at once: two statements on either plane. Where
the engine last saw routing canonical, an ending that never re-schedules is first tried as one
UPDATE of the row with the job's identity (``end_job``): one statement, and the lookup only
when it found nothing. The rows and outcomes are those of settling the attempt ``attempt_of``
would have returned.
"""

from __future__ import annotations

from functools import partial

from sqlalchemy import Connection

from awa_sa.core.compiled import run
from awa_sa.core.errors import AmbiguousAttempt
from awa_sa.settle import flow
from awa_sa.settle.inputs import EndCall, ReceiptCall, prepare_result, settling
from awa_sa.settle.results import Ending, Stale
from awa_sa.settle.running import job_filters, look_up, routing_seen_canonical
from awa_sa.settle.statements.endings import END_JOB, JobEnding
from awa_sa.settle.statements.listings import Filters


def settle_job_step(
    job: object, result: object, error: object, progress: object
) -> partial[Ending]:
    """The step that settles *job*'s running attempt, every input checked first (a bad one
    raises before any statement); run it with :func:`awa_sa.core.binds.administered`."""
    filters = job_filters(job)
    probe = prepare_result(filters.job_id, 1, result, error, progress)  # every input checked
    ending: tuple[EndCall, JobEnding] | None = None
    if isinstance(probe, EndCall) and probe.item.tag != "fail":  # never a re-schedule
        assert filters.attempt is not None  # job_filters sets every part of the identity
        assert filters.kind is not None
        assert filters.queue is not None
        assert filters.created_at is not None
        item = probe.item
        identity = (filters.kind, filters.queue, filters.attempt, filters.created_at)
        ending = probe, JobEnding(item.job_id, item.tag, item.message, item.progress, *identity)
    return partial(
        _settled, filters=filters, result=result, error=error, progress=progress, ending=ending
    )


def _settled(
    conn: Connection,
    *,
    filters: Filters,
    result: object,
    error: object,
    progress: object,
    ending: tuple[EndCall, JobEnding] | None,
) -> Ending:
    if ending is not None and routing_seen_canonical(conn.engine):
        ended = run(conn, END_JOB, ending[1])
        if ended is not None:
            return flow.ending_of(ending[0], ended[2])
    found, locked = look_up(conn, filters, lock=True)
    if not found:
        return Stale()  # settled, rescued or claimed again since the handler was given the job
    if len(found) > 1:
        raise AmbiguousAttempt(found[0].job_id, found[0].attempt, found)
    call = settling(found[0], result, error, progress)
    if locked and isinstance(call, ReceiptCall):
        return flow.locked_receipt(conn, call)
    return flow.settle(conn, [call])[0]
