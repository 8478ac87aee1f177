"""The exactly-once recipe: a handler's rows and its attempt's end commit together, or neither.

A handler that writes business rows and ends its attempt with ``Complete()`` on the same
``Connection`` gets one transaction for both (awa-sa joins the caller's transaction and never
commits it). So a commit keeps both, a rollback undoes both and leaves the attempt running, to
be retried or rescued as if the handler had never run, and a stale attempt (the claim was
settled, rescued or re-claimed meanwhile) answers ``Stale``: the caller raises and its rows are
never committed. Each case reads the rows back, on the Alembic fixture and on an
``awa migrate`` cluster, in the sync and the async face.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_sa_asyncio
from awa_sa import Complete, Completed, Stale
from awa_sa.testing import running_attempt

INVOICES = sa.Table(
    "invoices",
    sa.MetaData(),
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("total_cents", sa.Integer, nullable=False),
)
"""The handler's business rows: an invoice each time it runs. No unique job_id, so nothing but
the attempt's end can keep a second run from adding a second invoice."""


class AttemptWentStale(RuntimeError):
    """What the recipe's handler raises on ``Stale``, so that its transaction rolls back."""


@pytest.fixture
def attempt(cluster: Cluster) -> tuple[int, int]:
    """A running attempt and an empty business table beside Awa's, both committed."""
    with cluster.engine.begin() as conn:
        INVOICES.create(conn)
        return running_attempt(conn, kind="bill_customer", queue="billing", args={"order": 7})


def handle(conn: sa.Connection, job_id: int, run_lease: int) -> Completed:
    """The recipe: the business row, then the attempt's end, in the caller's transaction."""
    conn.execute(INVOICES.insert().values(job_id=job_id, total_cents=1250))
    outcome = awa_sa.settle_canonical_attempt(conn, job_id, run_lease, Complete())
    if isinstance(outcome, Stale):
        raise AttemptWentStale(f"job {job_id} lease {run_lease} is no longer running")
    assert isinstance(outcome, Completed)
    return outcome


def read_back(engine: sa.Engine, job_id: int) -> dict[str, Any]:
    """The invoices, and the job's state and lease, as another session sees them."""
    with engine.connect() as conn:
        invoices = conn.execute(sa.select(INVOICES.c.job_id, INVOICES.c.total_cents)).all()
        job = conn.execute(
            sa.text("SELECT state::text, run_lease, finalized_at FROM awa.jobs_hot WHERE id = :id"),
            {"id": job_id},
        ).one()
    return {"invoices": [tuple(r) for r in invoices], "job": tuple(job)}


def test_a_commit_keeps_the_business_row_and_the_completion(
    cluster: Cluster, attempt: tuple[int, int]
) -> None:
    job_id, lease = attempt
    with cluster.engine.begin() as conn:
        assert handle(conn, job_id, lease) == Completed(job_id)
    after = read_back(cluster.engine, job_id)
    assert after["invoices"] == [(job_id, 1250)]
    state, run_lease, finalized_at = after["job"]
    assert (state, run_lease) == ("completed", lease)
    assert finalized_at is not None


def test_a_rollback_undoes_both_and_leaves_the_attempt_running(
    cluster: Cluster, attempt: tuple[int, int]
) -> None:
    job_id, lease = attempt
    with cluster.engine.connect() as conn:
        tx = conn.begin()
        assert handle(conn, job_id, lease) == Completed(job_id)
        # Inside the transaction both writes are there...
        assert conn.execute(sa.select(sa.func.count()).select_from(INVOICES)).scalar_one() == 1
        tx.rollback()
    # ...and after the rollback neither is: the attempt runs on, under the same lease.
    assert read_back(cluster.engine, job_id) == {"invoices": [], "job": ("running", lease, None)}
    [still] = awa_sa.running_attempts(cluster.engine, job_id=job_id)
    assert still.run_lease == lease
    # The same attempt can still end, exactly once.
    with cluster.engine.begin() as conn:
        assert handle(conn, job_id, lease) == Completed(job_id)
    assert read_back(cluster.engine, job_id)["invoices"] == [(job_id, 1250)]


def test_a_stale_attempt_leaves_the_callers_rows_uncommitted(
    cluster: Cluster, attempt: tuple[int, int]
) -> None:
    job_id, lease = attempt
    with pytest.raises(AttemptWentStale), cluster.engine.begin() as conn:
        handle(conn, job_id, lease + 1)  # a lease this job's row does not hold
    assert read_back(cluster.engine, job_id) == {"invoices": [], "job": ("running", lease, None)}


def test_an_attempt_already_completed_is_stale_the_second_time(
    cluster: Cluster, attempt: tuple[int, int]
) -> None:
    """A redelivered handler (the same attempt run twice) writes its rows once."""
    job_id, lease = attempt
    with cluster.engine.begin() as conn:
        handle(conn, job_id, lease)
    with pytest.raises(AttemptWentStale), cluster.engine.begin() as conn:
        handle(conn, job_id, lease)
    assert read_back(cluster.engine, job_id)["invoices"] == [(job_id, 1250)]


async def test_the_async_face_commits_and_rolls_back_the_same_way(
    cluster: Cluster, attempt: tuple[int, int]
) -> None:
    job_id, lease = attempt
    engine = create_async_engine(cluster.url, poolclass=sa.NullPool)
    try:
        async with engine.connect() as conn:
            tx = await conn.begin()
            await conn.execute(INVOICES.insert().values(job_id=job_id, total_cents=1250))
            outcome = await awa_sa_asyncio.settle_canonical_attempt(conn, job_id, lease, Complete())
            assert outcome == Completed(job_id)
            await tx.rollback()
        assert read_back(cluster.engine, job_id) == {
            "invoices": [],
            "job": ("running", lease, None),
        }
        async with engine.begin() as conn:
            await conn.execute(INVOICES.insert().values(job_id=job_id, total_cents=1250))
            outcome = await awa_sa_asyncio.settle_canonical_attempt(conn, job_id, lease, Complete())
            assert outcome == Completed(job_id)
    finally:
        await engine.dispose()
    after = read_back(cluster.engine, job_id)
    assert after["invoices"] == [(job_id, 1250)]
    assert after["job"][:2] == ("completed", lease)
