"""Unique jobs against awa-pg 0.6.9 on one real cluster: the same key, conflicts both ways.

A job awa-pg enqueued blocks awa-sa's duplicate (so awa-sa computed the very key awa-pg wrote,
for every JSON shape below) and the reverse; a duplicate never poisons the caller's
transaction, on the canonical plane and on queue storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import Cluster
from enqueuing import listening
from runtimes import pg_url

import awa_sa


@dataclass
class Address:
    city: str
    lines: list[str] = field(default_factory=list)


@dataclass
class SendHTMLEmail:
    to: str
    address: Address
    weight: float = 0.1


class ModelLike:
    """What awa-pg and awa-sa take for a pydantic model: ``model_dump(mode="json")``."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def model_dump(self, *, mode: str) -> dict[str, Any]:
        assert mode == "json"
        return dict(self.values)


SHAPES: list[tuple[Any, dict[str, Any]]] = [
    ({"b": 1, "a": 2}, {}),
    ({"f": [1.0, 1e16, 1e-5, 1e-7, 0.1, -0.0, 5e-324, 1e300]}, {}),
    ({"i": [2**63 - 1, -(2**63), 2**63, 2**64 + 1, True, None]}, {}),
    ({"s": 'é\u2028\x01\x1f\x7f/<>&"\\😀', "é": {"Z": 1, "a": 2, "_": 3}}, {}),
    ({"deep": [[[[{"x": [[]]}]]]], "empty": {}}, {}),
    (SendHTMLEmail("a@b", Address("Wellington", ["1", "2"])), {}),
    (ModelLike(z=1, a=[1, 2]), {}),
    ({"n": 1}, {"unique_opts": {"by_queue": True}, "queue": "other"}),
    ({"n": 1}, {"unique_opts": {"by_period": -(2**63)}}),
    ({"n": 1}, {"unique_opts": {"by_args": False, "by_period": 3600}}),
]


@pytest.fixture
def cluster(real_plane: Cluster) -> Cluster:
    return real_plane


def _options(extra: dict[str, Any]) -> dict[str, Any]:
    return {"unique_opts": {}, **extra}


def test_awa_pgs_job_blocks_awa_sas_duplicate(cluster: Cluster) -> None:
    client = awa.Client(pg_url(cluster.url))
    try:
        theirs = [client.insert(args, **_options(extra)) for args, extra in SHAPES]
    finally:
        client.close()
    for (args, extra), job in zip(SHAPES, theirs, strict=True):
        with pytest.raises(awa_sa.DuplicateJob) as raised:
            awa_sa.enqueue(cluster.engine, args, **_options(extra))
        assert raised.value.existing_id == job.id
        assert isinstance(raised.value, awa_sa.UniqueConflict)
    kinds = {job.kind for job in theirs}
    assert {"send_html_email", "model_like", "dict"} <= kinds  # derived as awa-pg derives


def test_awa_sas_job_blocks_awa_pgs_duplicate(cluster: Cluster) -> None:
    ours = [awa_sa.enqueue(cluster.engine, args, **_options(extra)) for args, extra in SHAPES]
    client = awa.Client(pg_url(cluster.url))
    try:
        for args, extra in SHAPES:
            with pytest.raises(awa.UniqueConflict):
                client.insert(args, **_options(extra))
    finally:
        client.close()
    assert len({job.unique_key for job in ours}) == len(SHAPES)


def test_a_duplicate_leaves_the_callers_transaction_usable(cluster: Cluster) -> None:
    first = awa_sa.enqueue(cluster.engine, {"n": 1}, kind="once", unique_opts={})
    with cluster.engine.connect() as conn:
        before = awa_sa.enqueue(conn, {"n": 2}, kind="plain")
        with pytest.raises(awa_sa.DuplicateJob) as raised:
            awa_sa.enqueue(conn, {"n": 1}, kind="once", unique_opts={})
        after = awa_sa.enqueue(conn, {"n": 3}, kind="plain")
        conn.commit()
    assert raised.value.existing_id == first.id
    assert raised.value.unique_key == first.unique_key
    ids = _job_ids(cluster.engine)
    assert ids == sorted([first.id, before.id, after.id])


def test_a_batch_skips_or_raises_on_its_duplicates(cluster: Cluster) -> None:
    held = awa_sa.enqueue(cluster.engine, {"n": 0}, kind="once", unique_opts={})
    batch = [
        awa_sa.NewJob({"n": 1}, kind="once", unique_opts={}),
        awa_sa.NewJob({"n": 0}, kind="once", unique_opts={}),  # held already
        awa_sa.NewJob({"n": 2}, kind="plain"),
        awa_sa.NewJob({"n": 1}, kind="once", unique_opts={}),  # the first item's twin
    ]
    with cluster.engine.connect() as conn:
        with pytest.raises(awa_sa.DuplicateJob) as raised:
            awa_sa.enqueue_many(conn, batch)
        assert raised.value.index == 1
        assert raised.value.existing_id == held.id
        assert _job_ids(conn) == [held.id]  # nothing of the batch
        answers = awa_sa.enqueue_many(conn, batch, on_duplicate="skip")
        conn.commit()
    new, skipped, plain, twin = answers
    assert isinstance(new, awa_sa.EnqueuedJob)
    assert isinstance(plain, awa_sa.EnqueuedJob)
    assert skipped == awa_sa.Duplicate("once", held.unique_key or b"", held.id)
    assert twin == awa_sa.Duplicate("once", new.unique_key or b"", new.id)
    assert _job_ids(cluster.engine) == sorted([held.id, new.id, plain.id])


def test_rollback_leaves_nothing_and_no_notify(cluster: Cluster) -> None:
    """A commit delivers the NOTIFY, a rollback none.

    On the canonical plane Awa's producer function notifies nobody, for awa-pg alike: its
    trigger wants ``run_at <= now()``, and the function stamps ``clock_timestamp()``, later
    than the transaction's ``now()``. Queue storage notifies the queue's channel itself.
    """
    canonical = _routing(cluster.engine) is None
    with listening(cluster.url, ["awa:default"]) as listener:
        with cluster.engine.connect() as conn:
            awa_sa.enqueue(conn, {"n": 1}, kind="dropped", unique_opts={})
            conn.rollback()
        assert listener.drain() == []
        assert _job_ids(cluster.engine) == []
        with cluster.engine.connect() as conn:
            job = awa_sa.enqueue(conn, {"n": 1}, kind="kept", unique_opts={})
            assert listener.drain() == []  # not before the commit
            conn.commit()
        heard = listener.drain()
    assert heard == ([] if canonical else [("awa:default", "")])
    assert _job_ids(cluster.engine) == [job.id]


def _routing(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()


def _job_ids(bind: sa.Engine | sa.Connection) -> list[int]:
    """Every job's id, from whichever plane holds it (Awa's own view)."""
    query = sa.text("SELECT id FROM awa.jobs ORDER BY id")
    if isinstance(bind, sa.Connection):
        return list(bind.execute(query).scalars())
    with bind.connect() as conn:
        return list(conn.execute(query).scalars())
