"""``settle`` given the awa-pg ``Job`` itself: the attempt found, locked and settled in one call.

A handler holding its job would otherwise send ``attempt_of``'s lookup, then the receipt's lock,
then the settle. Given the job, the lookup takes the receipt's lock itself (``attempt_lookup``
with ``reads="locked"``), so the settle follows at once: two statements on either plane. The
rows and outcomes are those of settling the attempt ``attempt_of`` would have returned.
"""

from __future__ import annotations

from functools import partial

from sqlalchemy import Connection

from awa_sa.core.errors import AmbiguousAttempt
from awa_sa.settle import flow
from awa_sa.settle.inputs import ReceiptCall, prepare_result, settling
from awa_sa.settle.results import Ending, Stale
from awa_sa.settle.running import job_filters, look_up
from awa_sa.settle.statements.listings import Filters


def settle_job_step(
    job: object, result: object, error: object, progress: object
) -> partial[Ending]:
    """The step that settles *job*'s running attempt, every input checked first (a bad one
    raises before any statement); run it with :func:`awa_sa.core.binds.administered`."""
    filters = job_filters(job)
    prepare_result(1, 1, result, error, progress)  # the result, error and progress, checked
    return partial(_settled, filters=filters, result=result, error=error, progress=progress)


def _settled(
    conn: Connection, *, filters: Filters, result: object, error: object, progress: object
) -> Ending:
    found, locked = look_up(conn, filters, lock=True)
    if not found:
        return Stale()  # settled, rescued or claimed again since the handler was given the job
    if len(found) > 1:
        raise AmbiguousAttempt(found[0].job_id, found[0].attempt, found)
    call = settling(found[0], result, error, progress)
    if locked and isinstance(call, ReceiptCall):
        return flow.locked_receipt(conn, call)
    return flow.settle(conn, [call])[0]
