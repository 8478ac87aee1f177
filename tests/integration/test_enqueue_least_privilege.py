"""The application role docs/deploying.md grants can enqueue, on both planes.

Awa's producer function runs with its caller's rights, so what it writes (the canonical tables,
or the routing schema's ready entries, lanes and claims) must be covered by the documented
GRANTs; this enqueues a plain job, a unique one and its duplicate as that role.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from conftest import Cluster
from test_least_privilege import ROLE_IN_DOCS, documented_grants, role

import awa_sa

__all__ = ["role"]  # the module's fixture, used here


@pytest.fixture
def cluster(real_plane: Cluster) -> Cluster:
    return real_plane


def test_the_documented_role_enqueues(cluster: Cluster, role: str) -> None:
    with cluster.engine.begin() as conn:
        for statement in documented_grants()[1:]:
            conn.exec_driver_sql(statement.replace(ROLE_IN_DOCS, role))
    url = sa.make_url(cluster.url).set(username=role, password=role)
    app = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with app.connect() as conn:
            plain = awa_sa.enqueue(conn, {"n": 1}, kind="plain", queue="new_queue")
            once = awa_sa.enqueue(conn, {"n": 1}, kind="once", unique_opts={})
            with pytest.raises(awa_sa.DuplicateJob) as raised:
                awa_sa.enqueue(conn, {"n": 1}, kind="once", unique_opts={})
            conn.commit()
    finally:
        app.dispose()
    assert raised.value.existing_id == once.id
    with cluster.engine.connect() as conn:
        ids = list(conn.execute(sa.text("SELECT id FROM awa.jobs ORDER BY id")).scalars())
    assert ids == sorted([plain.id, once.id])
