"""Awa's own: a lane stops behind a cancelled job that follows a rolled-back enqueue's gap.

awa-pg 0.6.9's claim (``S.claim_ready_runtime``) passes a gap (a lane number a rolled-back
enqueue reserved) while the lane's first row past the cursor is live. When that row is spent
(a tombstone: a cancelled available job), its spent-prefix step moves the cursor only over
spent rows starting exactly at the cursor, so with a gap before the tombstone it moves nothing
and claims nothing, on every poll: every later job of the lane waits for good. The same
follows awa-pg's own ``Client.cancel`` and awa-sa's ``cancel_job`` (the rows are the same; awa-pg
moves the cursor after its commit only past a cancelled row the cursor stands on). Pinned here
on an ``awa migrate`` cluster with queue storage active, the runtime's post-commit cursor move
sent as it sends it; docs/administer.md gives the operator's way out, checked last.
"""

from __future__ import annotations

import asyncio

import awa
import pytest
import sqlalchemy as sa
from conftest import Cluster
from runtimes import pg_url

import awa_sa

HEAD = "FROM awa_qs.queue_claim_heads WHERE queue = 'gap'"
CLAIM = "SELECT job_id, lane_seq FROM awa_qs.claim_ready_runtime('gap', 1, 30.0, 0)"


def _enqueue(engine: sa.Engine, n: int, *, commit: bool = True) -> int:
    with engine.connect() as conn:
        job = awa_sa.enqueue(conn, {"n": n}, kind="g", queue="gap")
        conn.commit() if commit else conn.rollback()
    return job.id


def _claimed(engine: sa.Engine) -> list[tuple[int, int]]:
    """One claim of the lane, and the runtime's cursor move after its commit."""
    with engine.begin() as conn:
        got = [(row.job_id, row.lane_seq) for row in conn.exec_driver_sql(CLAIM)]
    with engine.begin() as conn:
        for _, lane_seq in got:
            conn.exec_driver_sql(
                f"SELECT awa_qs.set_sequence_next(seq_name, {lane_seq + 1}) {HEAD}"
            )
    return got


def _cursor(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        sql = f"SELECT awa_qs.sequence_next_value(seq_name) {HEAD}"
        return int(conn.exec_driver_sql(sql).scalar_one())


@pytest.mark.parametrize("real_plane", ["active"], indirect=True)
@pytest.mark.parametrize("by", ["awa-pg", "awa-sa"])
def test_a_tombstone_behind_a_gap_holds_the_lane_back(real_plane: Cluster, by: str) -> None:
    cluster = real_plane
    engine = cluster.engine
    first = _enqueue(engine, 0)  # lane number 1
    _enqueue(engine, 1, commit=False)  # 2: a gap
    cancelled, behind = _enqueue(engine, 2), _enqueue(engine, 3)  # 3, 4
    if by == "awa-pg":

        async def cancel() -> None:
            client = awa.AsyncClient(pg_url(cluster.url))
            try:
                await client.cancel(cancelled)
            finally:
                await client.close()

        asyncio.run(cancel())
    else:
        with engine.begin() as conn:
            assert awa_sa.cancel_job(conn, cancelled) is not None
    assert _claimed(engine) == [(first, 1)]
    assert _cursor(engine) == 2
    for _ in range(3):  # every poll: nothing claimed, the cursor where it was
        assert _claimed(engine) == []
        assert _cursor(engine) == 2
    # The way out: the cursor moved onto the tombstone, over the dead number alone.
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SELECT awa_qs.set_sequence_next(seq_name, 3) {HEAD}")
    assert _claimed(engine) == []  # the spent prefix passed: the cursor past the tombstone
    assert _claimed(engine) == [(behind, 4)]
