"""``queue_storage_attempt`` writes the rows a real Awa 0.6.9 enqueue and claim leave.

A real awa-pg 0.6.9 runtime on a fresh ``awa migrate`` cluster (auto-finalized to queue
storage in schema ``awa``) claims one job with every optional column set and holds it while its
``ready_entries`` row and ``lease_claims`` receipt are read. The kit then writes the same job on
the fixture routed to ``awa``, and the rows are compared column by column; only what cannot be
equal (timestamps taken by different transactions) is compared as a relation.
"""

from __future__ import annotations

import asyncio
import doctest
import io
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import _janitor, database_url, run_awa

import awa_sa.testing.receipts
from awa_sa import attempt_of
from awa_sa.testing import job_of, queue_storage_attempt, running_attempt, set_phase
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

READY_SAME = (
    "ready_slot",
    "ready_generation",
    "job_id",
    "kind",
    "queue",
    "args",
    "priority",
    "attempt",
    "run_lease",
    "max_attempts",
    "lane_seq",
    "enqueue_shard",
    "attempted_at",
    "unique_key",
    "unique_states",
    "payload",
)
RECEIPT_SAME = (
    "claim_slot",
    "job_id",
    "run_lease",
    "ready_slot",
    "ready_generation",
    "queue",
    "priority",
    "attempt",
    "max_attempts",
    "lane_seq",
    "enqueue_shard",
    "materialized_at",
    "closed_at",
)


@dataclass
class Marked:
    to: str


Rows = dict[str, dict[str, Any]]


def read(engine: sa.Engine) -> Rows:
    with engine.connect() as conn:
        [ready] = conn.execute(sa.text("SELECT * FROM awa.ready_entries")).mappings()
        [receipt] = conn.execute(sa.text("SELECT * FROM awa.lease_claims")).mappings()
        [heads] = conn.execute(
            sa.text(
                "SELECT e.seq_name AS enqueue, c.seq_name AS claim FROM awa.queue_enqueue_heads e"
                " JOIN awa.queue_claim_heads c USING (queue, priority, enqueue_shard)"
            )
        ).mappings()
        sequences = {
            side: conn.execute(sa.text(f"SELECT last_value FROM awa.{name}")).scalar_one()
            for side, name in heads.items()
        }
    return {"ready": dict(ready), "receipt": dict(receipt), "sequences": sequences}


@pytest.fixture
def real_rows(pg: EmbeddedPostgres) -> Iterator[Rows]:
    name = f"fresh_{uuid.uuid4().hex[:12]}"
    janitor = _janitor(pg, name)
    janitor.init()
    url = database_url(pg, name)
    engine = sa.create_engine(url, poolclass=sa.NullPool)

    async def claim() -> Rows:
        holding, release = asyncio.Event(), asyncio.Event()
        client = awa.AsyncClient(
            sa.make_url(url).set(drivername="postgresql").render_as_string(False)
        )

        @client.task(Marked, queue="q")
        async def hold(job: Any) -> None:
            holding.set()
            await release.wait()

        await client.start([("q", 1)], heartbeat_interval_ms=600_000)
        try:
            await client.insert(
                Marked(to="a@example.com"),
                queue="q",
                priority=3,
                max_attempts=7,
                tags=["billing", "eu"],
                metadata={"tenant": 42},
            )
            await asyncio.wait_for(holding.wait(), 60)
            return await asyncio.to_thread(read, engine)
        finally:
            release.set()
            await client.shutdown()
            await client.close()

    try:
        run_awa(pg, name, "migrate")
        yield asyncio.run(claim())
    finally:
        engine.dispose()
        janitor.drop()


def test_queue_storage_attempt_writes_what_a_real_claim_leaves(
    real_rows: Rows, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        set_phase(conn, "active", "awa")
        mine = queue_storage_attempt(
            conn,
            schema="awa",
            kind="marked",
            queue="q",
            args={"to": "a@example.com"},
            priority=3,
            max_attempts=7,
            tags=["billing", "eu"],
            metadata={"tenant": 42},
        )
    kit = read(engine)
    real = real_rows
    assert {c: kit["ready"][c] for c in READY_SAME} == {c: real["ready"][c] for c in READY_SAME}
    assert {c: kit["receipt"][c] for c in RECEIPT_SAME} == {
        c: real["receipt"][c] for c in RECEIPT_SAME
    }
    assert kit["sequences"] == real["sequences"]  # the lane's enqueue and claim sequences
    for rows in (kit, real):
        receipt = rows["receipt"]
        assert round((receipt["deadline_at"] - receipt["claimed_at"]).total_seconds()) == 300
        assert rows["ready"]["run_at"] <= receipt["claimed_at"]
    assert (mine.storage, mine.job_id, mine.run_lease) == ("awa", 1, 1)
    assert mine.receipt_id == kit["receipt"]["receipt_id"]
    assert mine.created_at == kit["ready"]["created_at"]
    with engine.connect() as conn:
        assert attempt_of(conn, job_of(mine)).receipt_id == mine.receipt_id


def test_a_fresh_database_is_finalized_to_awa_as_the_first_runtime_would(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        mine = queue_storage_attempt(conn, kind="send_email")
        phase = conn.execute(
            sa.text("SELECT state, details->>'schema' FROM awa.storage_transition_state")
        ).one()
    assert tuple(phase) == ("active", "awa")
    assert (mine.storage, mine.on_queue_storage) == ("awa", True)
    with engine.connect() as conn:
        assert attempt_of(conn, job_of(mine)).receipt_id == mine.receipt_id


def test_a_named_schema_is_where_a_fresh_database_is_finalized(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert queue_storage_attempt(conn, schema="awa_qs").storage == "awa_qs"
        assert queue_storage_attempt(conn).storage == "awa_qs"  # routing points there now


def test_the_kit_refuses_where_no_runtime_would_finalize(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        running_attempt(conn)  # a canonical job: the cluster is no longer fresh
    with engine.begin() as conn, pytest.raises(ValueError, match="not fresh"):
        queue_storage_attempt(conn)


def test_the_kit_refuses_a_schema_routing_does_not_point_at(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        set_phase(conn, "active", "awa_qs")
    with engine.begin() as conn, pytest.raises(ValueError, match="routing is awa_qs, not awa"):
        queue_storage_attempt(conn, schema="awa")


def test_the_example_in_its_docstring_runs(awa_engine: sa.Engine) -> None:
    """Run as test_docstring_examples runs the kit's other examples, on the plugin's engine."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    [example] = [t for t in finder.find(awa_sa.testing.receipts) if t.examples]
    example.globs = {**example.globs, "engine": awa_engine}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    runner.run(example, out=report.write)
    assert runner.failures == 0, report.getvalue()
