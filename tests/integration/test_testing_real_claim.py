"""``running_attempt`` writes the row a real Awa 0.6.9 worker leaves when it claims a job.

A real worker (the published awa-pg 0.6.9, its Rust runtime) claims four jobs on an
``awa migrate`` cluster, and each handler blocks on an event while the row is read: a first
attempt with every optional column set, a second attempt after a failure, an attempt after a
snooze, and one that registered a callback. ``running_attempt`` then writes the same four jobs on
a second clone of the same cluster, and the rows are compared column by column. Only what cannot
be equal is compared as a relation: the ids, and timestamps taken by different transactions.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from runtimes import pg_url

from awa_sa.testing import running_attempt

pytestmark = pytest.mark.slow  # a claim by a real awa-pg runtime

SAME = (
    "kind",
    "queue",
    "args",
    "state",
    "priority",
    "attempt",
    "max_attempts",
    "finalized_at",
    "errors",
    "metadata",
    "tags",
    "unique_key",
    "unique_states",
    "callback_id",
    "callback_filter",
    "callback_on_complete",
    "callback_on_fail",
    "callback_transform",
    "run_lease",
    "progress",
)
DEADLINE = dt.timedelta(minutes=5)  # the runtime's default queue deadline
CALLBACK_TIMEOUT = 600.0


@dataclass
class Marked:
    to: str


@dataclass
class Fails:
    n: int


@dataclass
class Snoozes:
    n: int


@dataclass
class Calls:
    n: int


class Worker:
    """A real awa-pg worker on one queue whose handlers hold their attempt until released."""

    def __init__(self, url: str) -> None:
        self.client = awa.AsyncClient(url)
        self.holding = {name: asyncio.Event() for name in ("marked", "fails", "snoozes", "calls")}
        self.release = asyncio.Event()
        self.snoozed = False
        task = self.client.task
        task(Marked, queue="q")(self.marked)
        task(Fails, queue="q")(self.fails)
        task(Snoozes, queue="q")(self.snoozes)
        task(Calls, queue="q")(self.calls)

    async def hold(self, name: str) -> None:
        self.holding[name].set()
        await self.release.wait()

    async def marked(self, job: Any) -> None:
        await self.hold("marked")

    async def fails(self, job: Any) -> None:
        if job.attempt == 1:
            raise RuntimeError("upstream refused")
        await self.hold("fails")

    async def snoozes(self, job: Any) -> Any:
        if not self.snoozed:
            self.snoozed = True
            return awa.Snooze(0)
        await self.hold("snoozes")
        return None

    async def calls(self, job: Any) -> None:
        await job.register_callback(timeout_seconds=CALLBACK_TIMEOUT)
        await self.hold("calls")


Rows = dict[str, dict[str, Any]]


def claim_for_real(url: str, read: Callable[[], Rows]) -> Rows:
    """Insert the four jobs, let the worker claim and hold them, and *read* while it does."""

    async def run() -> Rows:
        worker = Worker(pg_url(url))
        client = worker.client
        await client.insert(
            Marked(to="a@example.com"),
            queue="q",
            priority=3,
            max_attempts=7,
            tags=["billing", "eu"],
            metadata={"tenant": 42},
            unique_opts={"by_args": True},
        )
        for args in (Fails(1), Snoozes(1), Calls(1)):
            await client.insert(args, queue="q")
        # Promotion every 50 ms brings the failed and the snoozed job back quickly; no
        # heartbeat may rewrite heartbeat_at while the rows are read.
        await client.start([("q", 4)], promote_interval_ms=50, heartbeat_interval_ms=600_000)
        try:
            for event in worker.holding.values():
                await asyncio.wait_for(event.wait(), 60)
            return await asyncio.to_thread(read)
        finally:
            worker.release.set()
            await client.shutdown()
            await client.close()

    return asyncio.run(run())


def rows(engine: sa.Engine) -> Rows:
    """Each job's row by kind, with its unique claims and its timestamps as relations."""
    out = {}
    with engine.connect() as conn:
        for row in conn.execute(sa.text("SELECT * FROM awa.jobs_hot")).mappings():
            claims = conn.execute(
                sa.text("SELECT unique_key FROM awa.job_unique_claims WHERE job_id = :id"),
                {"id": row["id"]},
            ).scalars()
            out[row["kind"]] = {**row, "claims": list(claims)}
    return out


def relations(row: dict[str, Any]) -> dict[str, Any]:
    """What a claim guarantees about the timestamps, whichever transactions took them."""
    callback_after = (
        None
        if row["callback_timeout_at"] is None
        else (row["callback_timeout_at"] - row["attempted_at"]).total_seconds()
    )
    return {
        "heartbeat_at is attempted_at": row["heartbeat_at"] == row["attempted_at"],
        "deadline after attempted_at": row["deadline_at"] - row["attempted_at"],
        "created <= run_at <= attempted": row["created_at"] <= row["run_at"] <= row["attempted_at"],
        "callback timeout from claim": None
        if callback_after is None
        else CALLBACK_TIMEOUT <= callback_after < CALLBACK_TIMEOUT + 60,
        "claims its own key": row["claims"] == ([row["unique_key"]] if row["unique_key"] else []),
    }


@pytest.fixture
def real_rows(real_engine: sa.Engine, real_db_url: str) -> Rows:
    return claim_for_real(real_db_url, lambda: rows(real_engine))


@pytest.fixture
def kit_engine(clone_database: Callable[[str], str], real_template: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(clone_database(real_template))
    yield engine
    engine.dispose()


def test_running_attempt_writes_what_a_real_claim_leaves(
    real_rows: Rows, kit_engine: sa.Engine
) -> None:
    real = real_rows
    assert set(real) == {"marked", "fails", "snoozes", "calls"}
    with kit_engine.begin() as conn:
        running_attempt(
            conn,
            kind="marked",
            queue="q",
            args={"to": "a@example.com"},
            priority=3,
            max_attempts=7,
            tags=["billing", "eu"],
            metadata={"tenant": 42},
            unique_key=real["marked"]["unique_key"],  # Awa's hash of kind and args
        )
        running_attempt(
            conn,
            kind="fails",
            queue="q",
            args={"n": 1},
            attempt=2,
            errors=real["fails"]["errors"],  # the message, traceback and worker clock
            finalized_at=real["fails"]["finalized_at"],  # stamped by the retry
        )
        running_attempt(conn, kind="snoozes", queue="q", args={"n": 1}, run_lease=2)
        running_attempt(
            conn,
            kind="calls",
            queue="q",
            args={"n": 1},
            callback_id=real["calls"]["callback_id"],  # drawn by the runtime
            callback_timeout_secs=CALLBACK_TIMEOUT,
        )
    kit = rows(kit_engine)
    for kind, real_row in real.items():
        assert {c: kit[kind][c] for c in SAME} == {c: real_row[c] for c in SAME}, kind
        assert relations(kit[kind]) == relations(real_row), kind
        assert relations(real_row)["deadline after attempted_at"] == DEADLINE
    # The cases differ where they should, so the comparison above is not vacuous.
    assert real["marked"]["claims"] == [real["marked"]["unique_key"]] != [None]
    assert (real["fails"]["attempt"], real["fails"]["run_lease"]) == (2, 2)
    assert (real["snoozes"]["attempt"], real["snoozes"]["run_lease"]) == (1, 2)
    assert real["fails"]["finalized_at"] is not None
    assert real["calls"]["callback_id"] is not None
