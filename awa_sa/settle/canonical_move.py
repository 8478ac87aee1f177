"""The canonical move of a set of attempts, and what it means for each one.

See docs/contract.md#canonical-move. Shared by the flow's canonical steps and by the
queue-storage branch, which moves canonically the attempts it did not take (callback wiring, a
guard miss).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from awa_sa.core.compiled import Runner, run
from awa_sa.settle.inputs import Call, first_of_each_pair, items
from awa_sa.settle.results import Outcome, Rescheduled, Stale
from awa_sa.settle.statements.canonical import CANONICAL_MOVE, GoOn, Moved, MovedJob


def canonical(conn: Connection, calls: Sequence[Call]) -> list[Outcome]:
    """Move *calls* with routing already fixed (locked, or no singleton to lock)."""
    return outcomes(conn, calls, run(conn, CANONICAL_MOVE, items(calls)))


def outcomes(conn: Runner, calls: Sequence[Call], moved: Moved) -> list[Outcome]:
    """The outcomes of a canonical move; one move per attempt when it touched nothing."""
    if moved.go_on is GoOn.SHARED_KEY:
        return one_by_one(conn, calls)
    return _answered(calls, moved.jobs)


def one_by_one(conn: Runner, calls: Sequence[Call]) -> list[Outcome]:
    """Each attempt moved by itself, in order: the one-row move has no shared key to check."""
    return [_answered([call], run(conn, CANONICAL_MOVE, [call.item]).jobs)[0] for call in calls]


def _answered(calls: Sequence[Call], jobs: list[MovedJob]) -> list[Outcome]:
    """Each moved job answers the first item that asked for its ``(id, run_lease)``."""
    first = first_of_each_pair(items(calls))
    answered: list[Outcome] = [Stale()] * len(calls)
    for job in jobs:
        answered[first[(job.job_id, job.run_lease)]] = Rescheduled(
            job.job_id, job.run_at, job.attempt
        )
    return answered
