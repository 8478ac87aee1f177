"""An open bug, pinned: a set-based batch racing a single enqueue onto a lane neither has made.

The single `enqueue` (Awa's own ``insert_job_compat``) creates the new lane's sequences while
its transaction is open; the batch's lane rows fire the heads' triggers, which create the same
sequences, wait on the first transaction's catalog row, and fail when it commits
(``pg_class_relname_nsp_index``, raised as ``UniqueConflict``): the batch is lost and must be
retried. Two single enqueues do not fail so. docs/contract.md#bulk-enqueue says so; this test
turns green, and must then lose its mark, when the batch waits for the lane as a single
enqueue does.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from conftest import Cluster
from racing import backend_pid, in_thread, wait_until_blocked

import awa_sa


@pytest.mark.parametrize("real_plane", ["active"], indirect=True)
@pytest.mark.xfail(strict=True, raises=awa_sa.UniqueConflict, reason="the open lane race")
def test_a_batch_racing_a_single_enqueue_onto_a_new_lane(real_plane: Cluster) -> None:
    engine = real_plane.engine
    first = engine.connect()
    first.begin()
    awa_sa.enqueue(first, {"n": 1}, kind="k", queue="fresh_lane")

    def batch() -> object:
        with engine.begin() as conn:
            return awa_sa.enqueue_many(conn, [{"n": 2}, {"n": 3}], kind="k", queue="fresh_lane")

    raced = in_thread(batch)
    wait_until_blocked(engine, backend_pid(first))
    first.commit()
    first.close()
    raced.result(timeout=60)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM awa.jobs")).scalar_one() == 3
