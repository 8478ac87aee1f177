"""The duplicate guard is race-safe: two transactions enqueue one unique job at once.

The holder enqueues and keeps its transaction open; the contender's insert waits on the claim's
unique index (seen in ``pg_stat_activity``, never by sleeping). When the holder commits, the
contender gets ``DuplicateJob`` naming the holder's job, and its own transaction goes on; when
the holder rolls back, the contender's job is written.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from racing import DEFAULT_TIMEOUT, held, in_thread, wait_until_blocked

import awa_sa

UNIQUE: dict[str, Any] = {"kind": "once", "unique_opts": {}}


@pytest.fixture
def cluster(real_plane: Cluster) -> Cluster:
    return real_plane


def _contender(engine: sa.Engine) -> tuple[list[int], awa_sa.DuplicateJob | None]:
    """Enqueue a plain job, then the unique one, then another; commit whatever was written."""
    with engine.connect() as conn:
        ids = [awa_sa.enqueue(conn, {"n": 1}, kind="plain").id]
        refused = None
        try:
            ids.append(awa_sa.enqueue(conn, {"n": 0}, **UNIQUE).id)
        except awa_sa.DuplicateJob as exc:
            refused = exc
        ids.append(awa_sa.enqueue(conn, {"n": 2}, kind="plain").id)
        conn.commit()
    return ids, refused


@pytest.mark.parametrize("holder_commits", [True, False])
def test_a_concurrent_duplicate_waits_then_is_refused_or_written(
    cluster: Cluster, holder_commits: bool
) -> None:
    with held(cluster.engine) as holder:
        holders = awa_sa.enqueue(holder.conn, {"n": 0}, **UNIQUE)
        pending = in_thread(lambda: _contender(cluster.engine))
        wait_until_blocked(cluster.engine, holder.pid, pending=[pending])
        if holder_commits:
            holder.commit()
        else:
            holder.rollback()
    ids, refused = pending.result(timeout=DEFAULT_TIMEOUT)
    with cluster.engine.connect() as conn:
        stored = list(conn.execute(sa.text("SELECT id FROM awa.jobs ORDER BY id")).scalars())
    if holder_commits:
        assert refused is not None
        assert refused.existing_id == holders.id
        assert len(ids) == 2
        assert stored == sorted([holders.id, *ids])
    else:
        assert refused is None
        assert len(ids) == 3
        assert stored == sorted(ids)
