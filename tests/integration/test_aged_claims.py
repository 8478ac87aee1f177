"""A claim the runtime aged: its receipt's priority is below its lane's (issue 40's soak).

``claim_ready_runtime`` ages a job that waited longer than the queue's aging interval: the
receipt (a ``lease_claims`` row, or a compact ``lease_claim_batches`` row) carries the lowered
effective priority, while the ready row stays in its lane. The runtime's completions carry the
lane's priority (its claim reference's), and ``terminal_jobs`` joins a completion back to its
ready row by it: a compact completion under the receipt's priority would be counted by the
queue's terminal count and missing from ``terminal_jobs``. On a real cluster, for a
``lease_claims`` receipt (awa-sa settles no compact one), both completion paths and a cancel:
each job is in ``terminal_jobs`` once, under
its lane's priority, and the queue's count equals its rows. A ready-backed ``done_entries`` row
sits at its ready row's lane position: under the aged priority it would join no ready row, and
could take the key of another lane's row at the same position (seen in the deadline soak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from runtimes import rows

import awa_sa
from awa_sa.testing import queue_storage_attempt

QS = "awa_qs"

COUNTED = f"""
    SELECT COALESCE((SELECT sum(terminal_delta) FROM {QS}.queue_terminal_count_deltas
                     WHERE queue = :queue), 0)
         + COALESCE((SELECT sum(completed_count) FROM {QS}.receipt_completion_batches
                     WHERE queue = :queue), 0) AS counted,
           (SELECT count(*) FROM {QS}.terminal_jobs WHERE queue = :queue) AS rows
"""


@pytest.fixture
def active(
    pg: Any, clone_database: Callable[[str], str], real_template: str
) -> Iterator[sa.Engine]:
    url = clone_database(real_template)
    engine = sa.create_engine(url)
    try:
        Cluster("real", pg, url, engine).set_phase("active", QS)
        yield engine
    finally:
        engine.dispose()


def aged(engine: sa.Engine, *, tags: list[str]) -> awa_sa.RunningAttempt:
    """A claimed attempt whose receipt carries priority 1 in a lane of priority 2."""
    with engine.begin() as conn:
        a = queue_storage_attempt(conn, schema=QS, queue="aged", priority=2, tags=tags)
        conn.execute(
            sa.text(f"UPDATE {QS}.lease_claims SET priority = 1 WHERE job_id = :j"),
            {"j": a.job_id},
        )
    return a


def test_a_completion_of_an_aged_claim_is_in_terminal_jobs(active: sa.Engine) -> None:
    engine = active
    bare = aged(engine, tags=[])  # the compact completion
    tagged = aged(engine, tags=["t"])  # a done_entries row
    cancelled = aged(engine, tags=[])
    assert awa_sa.settle(engine, bare, awa_sa.Complete()) == awa_sa.Completed(bare.job_id)
    assert awa_sa.settle(engine, tagged, awa_sa.Complete()) == awa_sa.Completed(tagged.job_id)
    assert awa_sa.settle(engine, cancelled, awa_sa.Cancel("x")) == awa_sa.Cancelled(
        cancelled.job_id
    )
    found = rows(
        engine,
        f"SELECT job_id, state::text AS state, priority FROM {QS}.terminal_jobs ORDER BY job_id",
    )
    assert found == [
        {"job_id": bare.job_id, "state": "completed", "priority": 2},
        {"job_id": tagged.job_id, "state": "completed", "priority": 2},
        {"job_id": cancelled.job_id, "state": "cancelled", "priority": 2},
    ]
    assert rows(engine, COUNTED, queue="aged") == [{"counted": 3, "rows": 3}]
