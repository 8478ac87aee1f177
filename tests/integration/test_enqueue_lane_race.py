"""A set-based batch racing a single enqueue onto a lane neither has made: it waits for the lane.

The single ``enqueue`` (Awa's own ``insert_job_compat``) creates the new lane's sequences while
its transaction is open, and the batch's head rows' triggers create the same sequences. The
batch writes its ``queue_lanes`` row first, and so waits on the single's uncommitted one, as a
second single enqueue does, rather than meeting its uncommitted sequences and failing
(``pg_class_relname_nsp_index``) when it commits.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from conftest import Cluster
from racing import backend_pid, in_thread, wait_until_blocked

import awa_sa


@pytest.mark.parametrize("real_plane", ["active"], indirect=True)
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
