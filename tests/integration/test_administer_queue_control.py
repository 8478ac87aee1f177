"""Pausing and resuming a queue: awa-pg 0.6.9's rows, and a real worker that honours them.

Twin clusters built by ``awa migrate``, one pair on the canonical plane and one flipped to
queue storage and finalized by the real CLI: each step done by awa-pg's own ``AsyncClient`` on
one twin and by awa-sa in a caller's transaction that also commits a business row on the
other leaves the same rows (every table of schema ``awa``, every sequence, clocks masked) and
the same NOTIFYs (none). A rollback leaves nothing.

Then, on each plane, a real awa-pg worker serves a queue that awa-sa paused: its claim of that
queue is caught twice behind a lock on ``awa.queue_meta`` (so at least one whole claim ran in
between, with the job there to take), the job is still untouched, and once awa-sa resumes the
queue the worker runs it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import Twin, change, pg_call, snapshot, twin, twins
from conftest import QUIESCED_FLIP, Cluster, run_awa
from racing import backend_pid, wait_until_blocked
from runtimes import hold_leadership, pg_url, rows
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import ValidationError
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

PHASES = ("canonical", "active")
CHANNELS = ("awa:paused_q", "awa:cancel")
CLAIMS = ("UPDATE awa.jobs_hot", ".claim_ready_runtime(")
"""A text of each plane's claim statement, the one that reads the pause."""


def flip_to_active(pg: EmbeddedPostgres, side: Twin) -> None:
    """Queue storage in ``awa_qs``, finalized, by the real CLI (no runtime needed)."""
    name = sa.make_url(side.url).database or ""
    details = '{"schema": "awa_qs"}'
    run_awa(pg, name, "storage", "prepare", "--engine", "queue_storage", "--details", details)
    run_awa(pg, name, *QUIESCED_FLIP)
    run_awa(pg, name, "storage", "finalize")


@pytest.fixture(scope="module", params=PHASES)
def sides(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[tuple[Twin, Twin]]:
    with ExitStack() as stack:
        made = [twin(stack, pg, awa_databases, real_template) for _ in range(2)]
        if request.param == "active":
            for side in made:
                flip_to_active(pg, side)
        yield made[0], made[1]


def _meta(engine: sa.Engine) -> list[dict[str, Any]]:
    return rows(engine, "SELECT queue, paused, paused_by FROM awa.queue_meta ORDER BY queue")


def test_pause_and_resume_write_what_awa_pg_writes(sides: tuple[Twin, Twin]) -> None:
    pg_side, sa_side = sides
    urls, engines = (pg_side.url, sa_side.url), (pg_side.engine, sa_side.engine)
    steps: list[tuple[Any, Any]] = [
        (lambda c: c.pause_queue("paused_q"), lambda conn: awa_sa.pause_queue(conn, "paused_q")),
        (  # paused again, by someone: the clock and the author rewritten
            lambda c: c.pause_queue("paused_q", "ops"),
            lambda conn: awa_sa.pause_queue(conn, "paused_q", paused_by="ops"),
        ),
        (lambda c: c.resume_queue("paused_q"), lambda conn: awa_sa.resume_queue(conn, "paused_q")),
        (lambda c: c.resume_queue("never_q"), lambda conn: awa_sa.resume_queue(conn, "never_q")),
        (lambda c: c.pause_queue("other_q", "x"), lambda c: awa_sa.pause_queue(c, "other_q", "x")),
    ]
    for on_pg, on_sa in steps:
        got_pg, got_sa, _, notes = twins(
            urls, engines, on_pg, on_sa, schemas=("awa",), channels=CHANNELS
        )
        # awa-pg's answer is pyo3's unit, an empty tuple (its stub says None); awa-sa's None.
        assert got_pg == ()
        assert got_sa is None
        assert notes == []
    assert (
        _meta(sa_side.engine)
        == _meta(pg_side.engine)
        == [
            {"queue": "other_q", "paused": True, "paused_by": "x"},
            {"queue": "paused_q", "paused": False, "paused_by": "ops"},
        ]
    )


def test_a_rolled_back_pause_leaves_nothing_and_the_async_twins_write_the_same(
    sides: tuple[Twin, Twin],
) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        awa_sa.pause_queue(conn, "rolled_q", "me")
        awa_sa.resume_queue(conn, "other_q")
        conn.rollback()
    assert snapshot(sa_side.engine) == before

    async def both() -> None:
        engine = create_async_engine(sa_side.url)
        try:
            async with engine.begin() as conn:
                await awa_async.pause_queue(conn, "async_q", paused_by="a")
            await awa_async.resume_queue(engine, "async_q")
        finally:
            await engine.dispose()

    asyncio.run(both())
    found = rows(
        sa_side.engine, "SELECT paused, paused_by FROM awa.queue_meta WHERE queue = 'async_q'"
    )
    assert found == [{"paused": False, "paused_by": "a"}]
    not_text: Any = 7
    with pytest.raises(ValidationError):
        awa_sa.pause_queue(sa_side.engine, not_text)
    with pytest.raises(ValidationError):
        awa_sa.resume_queue(sa_side.engine, "a\x00")


async def _paused_then_resumed(plane: Cluster) -> dict[str, Any]:
    """A job of a queue awa-sa paused, beside a live worker of that queue; two of its claims
    caught behind a lock on ``awa.queue_meta``; then awa-sa resumes the queue."""
    with plane.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE public.business (note text)"))
        conn.execute(sa.text("INSERT INTO public.business VALUES ('tenant suspended')"))
        awa_sa.pause_queue(conn, "paused_q", paused_by="billing")
    leader = hold_leadership(plane.engine)  # no maintenance reads queue_meta meanwhile
    client = awa.AsyncClient(pg_url(plane.url))
    ran: list[int] = []
    done = asyncio.Event()

    async def handler(job: Any) -> None:
        ran.append(job.id)
        done.set()

    client.task(dict, kind="held", queue="paused_q")(handler)
    job = await client.insert({"n": 1}, kind="held", queue="paused_q")
    with plane.engine.connect() as conn:
        schema = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
    await client.start([("paused_q", 2)], poll_interval_ms=50, queue_storage_schema=schema)
    caught: list[str] = []
    try:
        # The second catch of a claim proves a whole claim ran after the first. Another
        # reader of the row caught (the runtime's own bookkeeping) is let go and not counted.
        for _ in range(20):
            with plane.engine.connect() as holder:
                holder.execute(sa.text("LOCK TABLE awa.queue_meta IN ACCESS EXCLUSIVE MODE"))
                waiters = await asyncio.to_thread(
                    wait_until_blocked, plane.engine, backend_pid(holder)
                )
                caught.extend(w.query for w in waiters if any(c in w.query for c in CLAIMS))
                holder.rollback()
            if len(caught) >= 2:
                break
        untouched = ran == [] and _job_state(plane, job.id) == "available"
        with plane.engine.begin() as conn:
            awa_sa.resume_queue(conn, "paused_q")
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await client.shutdown()
        await client.close()
        leader.close()
    return {"untouched": untouched, "ran": ran, "job": job.id, "caught": caught}


def _job_state(plane: Cluster, job_id: int) -> str:
    with plane.engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT state::text FROM awa.jobs WHERE id = :i"), {"i": job_id}
            ).scalar_one()
        )


def test_a_real_worker_does_not_claim_a_paused_queue_until_it_is_resumed(
    real_plane: Cluster,
) -> None:
    found = asyncio.run(_paused_then_resumed(real_plane))
    assert len(found["caught"]) >= 2
    assert found["untouched"], found
    assert found["ran"] == [found["job"]]


async def _pending(url: str) -> None:
    """Pending jobs of ``drain_q`` (available, scheduled) and one of another queue."""
    client = awa.AsyncClient(pg_url(url))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    try:
        for n in range(3):
            await client.insert({"n": n}, kind="drained", queue="drain_q")
        await client.insert({"n": 3}, kind="drained", queue="drain_q", run_at=later)
        await client.insert({"n": 4}, kind="kept", queue="kept_q")
    finally:
        await client.close()


async def _run_after_drain(url: str, schema: str | None) -> list[int]:
    """A real worker of ``drain_q``: a job enqueued after the drain runs; the ids it ran."""
    client = awa.AsyncClient(pg_url(url))
    ran: list[int] = []
    done = asyncio.Event()

    async def handler(job: Any) -> None:
        ran.append(job.id)
        if job.args.get("after"):
            done.set()

    client.task(dict, kind="drained", queue="drain_q")(handler)
    await client.start(
        [("drain_q", 1)],
        poll_interval_ms=50,
        promote_interval_ms=600_000,
        queue_storage_schema=schema,
    )
    try:
        await client.insert({"after": True}, kind="drained", queue="drain_q")
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await client.shutdown()
        await client.close()
    return ran


def test_drain_queue_cancels_what_awa_pg_cancels_and_a_worker_never_runs_it(
    sides: tuple[Twin, Twin],
) -> None:
    pg_side, sa_side = sides
    for side in sides:
        asyncio.run(_pending(side.url))
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    got_pg = pg_call(pg_side.url, lambda c: c.drain_queue("drain_q"))
    with sa_side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('drained')"))
        got_sa = awa_sa.drain_queue(conn, "drain_q")
    assert got_pg == got_sa == 4
    pg_change = change(before[0], snapshot(pg_side.engine))
    sa_change = change(before[1], snapshot(sa_side.engine))
    # awa-pg moves the lane's claim cursor past the cancelled head after its commit; awa-sa
    # leaves it to the claim (docs/contract.md#cancel). Nothing else differs.
    pg_change.pop("sequences", None)
    assert "sequences" not in sa_change
    assert sa_change == pg_change
    with sa_side.engine.begin() as conn:
        assert awa_sa.drain_queue(conn, "drain_q") == 0  # nothing pending is left
    with sa_side.engine.connect() as conn:
        schema = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
    ran = asyncio.run(_run_after_drain(sa_side.url, schema))
    assert len(ran) == 1
    assert ran[0] > 5  # the job enqueued after the drain, and none of the drained
