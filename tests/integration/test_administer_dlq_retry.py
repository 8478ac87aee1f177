"""Retrying jobs out of the dead-letter queue: awa-sa writes and answers what awa-pg 0.6.9 does.

Twin clusters built by ``awa migrate``, each auto-finalized to queue storage in schema ``awa``
by its first real awa-pg runtime, which then fails the same jobs in the same order (one attempt
each); awa-pg's own ``move_failed_to_dlq`` then files every one in the DLQ on both twins, in id
order, and a maintenance-leader lock is held so nothing prunes behind the comparison. Each
retry is done by awa-pg's ``AsyncClient`` on one twin and by awa-sa in a caller's transaction
that also commits a business row on the other: every table of schema ``awa`` and every
sequence compared, clocks masked, the NOTIFYs too, and the answers. Last, a real awa-pg worker
runs every revived job that is due, each once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import Counter
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import (
    Twin,
    change,
    pair_twins,
    pg_call,
    same_job,
    snapshot,
    twin_pair,
    until_failed,
)
from runtimes import pg_url, rows, until_idle
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import UniqueConflict, ValidationError
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

BY_ARGS: dict[str, Any] = {"unique_opts": {"by_args": True}}
FAILING: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    # (kind, queue, priority, options): failed by a real worker (max_attempts 1), ids 1.. in
    # this order, then moved to the DLQ by awa-pg.
    ("revive", "dlq_q", 2, {**BY_ARGS, "tags": ["a"], "metadata": {"m": 1}}),  # 1: as it was
    ("revive", "dlq_q", 2, {"metadata": {"m": 2}}),  # 2: onto another queue and priority
    ("revive", "dlq_q", 2, {**BY_ARGS, "tags": ["later"]}),  # 3: due later: scheduled
    ("revive", "dlq_q", 2, {}),  # 4: a run_at already past: due now
    ("bulk_kind", "dlq_q", 2, {}),  # 5, 6: by kind, two lanes
    ("bulk_kind", "other_q", 3, {"metadata": {"k": 6}}),
    ("bulk_q", "bulk_q", 2, {}),  # 7, 8: by queue, one lane
    ("bulk_q", "bulk_q", 2, BY_ARGS),
    ("tagged", "dlq_q", 2, {"tags": ["t"]}),  # 9: by tag
    ("held", "dlq_q", 2, BY_ARGS),  # 10: its key taken meanwhile
    ("rolled", "dlq_q", 2, {}),  # 11: rolled back, then the async twins
)
QUEUES = ("dlq_q", "other_q", "bulk_q", "moved_q")
CHANNELS = (*(f"awa:{q}" for q in QUEUES), "awa:cancel")
LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
EARLIER = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
STATE = "SELECT state::text AS s FROM awa.jobs WHERE id = :i"
REVIVED = {"awa.dlq_entries", "awa.ready_entries", "awa.ready_segments", "sequences"}
"""What a revive due now changes: the DLQ row gone, the new ready row and its segment, the
lane's enqueue sequence (and, for a keyed job, its claim)."""


async def _fail_then_file(side: Twin) -> None:
    client = awa.AsyncClient(pg_url(side.url))

    async def fails(job: Any) -> Any:
        raise RuntimeError(f"boom {job.id}")

    for kind, queue, _, _ in FAILING:
        client.task(dict, kind=kind, queue=queue)(fails)
    served = sorted({(q, 1) for _, q, _, _ in FAILING})
    await client.start(served, promote_interval_ms=600_000)
    try:
        for n, (kind, queue, priority, options) in enumerate(FAILING, 1):
            await client.insert(
                {"n": n}, kind=kind, queue=queue, priority=priority, max_attempts=1, **options
            )
            await until_failed(side.engine, n)
    finally:
        await client.shutdown()
    try:
        for n in range(1, len(FAILING) + 1):
            assert await client.move_failed_to_dlq(n, "poison") is not None
    finally:
        await client.close()


@pytest.fixture(scope="module")
def sides(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[tuple[Twin, Twin]]:
    yield from twin_pair(pg, awa_databases, real_template, _fail_then_file)


def _both(sides: tuple[Twin, Twin], on_pg: Any, on_sa: Any) -> tuple[Any, Any, dict[str, Any], Any]:
    return pair_twins(sides, on_pg, on_sa, schemas=("awa",), channels=CHANNELS)


def _ready(engine: sa.Engine, job_id: int) -> dict[str, Any]:
    """The job's newest ready row (a claim leaves the one it took in place)."""
    return rows(
        engine,
        "SELECT queue, priority, enqueue_shard, lane_seq, attempt, payload"
        " FROM awa.ready_entries WHERE job_id = :i ORDER BY ready_generation DESC,"
        " lane_seq DESC LIMIT 1",
        i=job_id,
    )[0]


def test_retry_from_dlq_writes_and_answers_what_awa_pg_does(sides: tuple[Twin, Twin]) -> None:
    # As it was: its lane, its claim taken again, its payload kept.
    got_pg, got_sa, changed, notes = _both(
        sides, lambda c: c.retry_from_dlq(1), lambda conn: awa_sa.retry_from_dlq(conn, 1)
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.attempt, got_sa.storage) == ("available", 0, "awa")
    assert set(changed) == REVIVED | {"awa.job_unique_claims"}, sorted(changed)
    assert notes == [("awa:dlq_q", "")]
    # Onto another queue and priority: a new lane, its NOTIFY.
    got_pg, got_sa, changed, notes = _both(
        sides,
        lambda c: c.retry_from_dlq(2, queue="moved_q", priority=3),
        lambda conn: awa_sa.retry_from_dlq(conn, 2, queue="moved_q", priority=3),
    )
    same_job(got_sa, got_pg)
    assert (got_sa.queue, got_sa.priority, got_sa.metadata) == ("moved_q", 3, {"m": 2})
    assert {"awa.queue_lanes", "awa.queue_enqueue_heads", "awa.queue_claim_heads"} <= set(changed)
    assert notes == [("awa:moved_q", "")]
    # Due later: a scheduled row, its claim, no lane and no NOTIFY.
    got_pg, got_sa, changed, notes = _both(
        sides,
        lambda c: c.retry_from_dlq(3, run_at=LATER, priority=1),
        lambda conn: awa_sa.retry_from_dlq(conn, 3, run_at=LATER, priority=1),
    )
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.run_at, got_sa.finalized_at) == ("scheduled", LATER, None)
    assert set(changed) == {"awa.dlq_entries", "awa.deferred_jobs", "awa.job_unique_claims"}
    assert notes == []
    # A run_at already past: due now.
    got_pg, got_sa, changed, notes = _both(
        sides,
        lambda c: c.retry_from_dlq(4, run_at=EARLIER),
        lambda conn: awa_sa.retry_from_dlq(conn, 4, run_at=EARLIER),
    )
    same_job(got_sa, got_pg)
    assert got_sa.state == "available"
    assert set(changed) == REVIVED
    # Nothing in the DLQ under that id (any more): None from both, nothing written.
    for job_id in (1, 99):
        got_pg, got_sa, changed, notes = _both(
            sides,
            lambda c, i=job_id: c.retry_from_dlq(i),
            lambda conn, i=job_id: awa_sa.retry_from_dlq(conn, i),
        )
        assert (got_pg, got_sa, changed, notes) == (None, None, {}, [])
    row = _ready(sides[1].engine, 1)
    assert (row["enqueue_shard"], row["attempt"]) == (0, 0)
    assert sorted(row["payload"]) == ["errors", "metadata", "tags"]  # the progress dropped
    assert (row["payload"]["tags"], row["payload"]["metadata"]) == (["a"], {"m": 1})


def test_bulk_retry_from_dlq_by_kind_queue_and_tag_counts_what_awa_pg_counts(
    sides: tuple[Twin, Twin],
) -> None:
    for by, count, channels in (
        ({"kind": "bulk_kind"}, 2, ["awa:dlq_q", "awa:other_q"]),
        ({"queue": "bulk_q"}, 2, ["awa:bulk_q"]),
        ({"tag": "t"}, 1, ["awa:dlq_q"]),
        ({"kind": "no_such_kind"}, 0, []),
    ):
        got_pg, got_sa, changed, notes = _both(
            sides,
            lambda c, b=by: c.bulk_retry_from_dlq(**b),
            lambda conn, b=by: awa_sa.bulk_retry_from_dlq(conn, **b),
        )
        assert got_pg == got_sa == count, by
        assert [channel for channel, _ in notes] == channels, by
        assert (set(changed) >= REVIVED) if count else (changed == {}), by
    lanes = [_ready(sides[1].engine, n)["lane_seq"] for n in (7, 8)]
    # One lane, numbered as awa-pg's DELETE returns the rows: by the queue's index, newest
    # move first (both twins alike, above).
    assert lanes[0] == lanes[1] + 1
    with pytest.raises(ValidationError, match="allow_all"):
        awa_sa.bulk_retry_from_dlq(sides[1].engine)


def test_a_revive_whose_key_another_job_holds_raises_as_awa_pg_and_writes_nothing(
    sides: tuple[Twin, Twin],
) -> None:
    """A new live job took the key while the job sat in the DLQ (a failed row does not claim
    it): awa-pg raises UniqueConflict and its rollback leaves its lane reservation behind (a
    gap); awa-sa raises before it reserves, and with the caller's rollback nothing is left."""
    for side in sides:
        pg_call(side.url, lambda c: c.insert({"n": 10}, kind="held", queue="dlq_q", **BY_ARGS))
    pg_side, sa_side = sides
    before = snapshot(pg_side.engine), snapshot(sa_side.engine)
    with pytest.raises(awa.UniqueConflict):
        pg_call(pg_side.url, lambda c: c.retry_from_dlq(10))
    with sa_side.engine.connect() as conn, pytest.raises(UniqueConflict):
        awa_sa.retry_from_dlq(conn, 10)
    assert snapshot(sa_side.engine) == before[1]
    assert list(change(before[0], snapshot(pg_side.engine))) == ["sequences"]


def test_a_rolled_back_revive_leaves_the_dlq_as_it_was_and_the_async_twins_agree(
    sides: tuple[Twin, Twin],
) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        assert awa_sa.retry_from_dlq(conn, 11, run_at=LATER) is not None
        conn.rollback()
    assert snapshot(sa_side.engine) == before  # a scheduled row reserves nothing
    with sa_side.engine.connect() as conn:
        assert awa_sa.retry_from_dlq(conn, 11) is not None
        conn.rollback()
    moved = change(before, snapshot(sa_side.engine))
    assert list(moved) == ["sequences"], moved  # the lane's reserved number: a gap

    async def through_async() -> tuple[Any, ...]:
        # asyncpg: the ids travel as its own bigint[], the run_at as its timestamptz.
        engine = create_async_engine(sa.make_url(sa_side.url).set(drivername="postgresql+asyncpg"))
        try:
            async with engine.connect() as conn:
                later = await awa_async.retry_from_dlq(conn, 11, run_at=LATER, queue="x_q")
                none = await awa_async.bulk_retry_from_dlq(conn, kind="rolled")
                await conn.rollback()
            async with engine.begin() as conn:
                one = await awa_async.retry_from_dlq(conn, 11)
            return none, later, one
        finally:
            await engine.dispose()

    none, later, one = asyncio.run(through_async())
    assert later is not None
    assert (later.state, later.queue, later.run_at) == ("scheduled", "x_q", LATER)
    assert none == 0  # already out of the DLQ in that transaction
    assert one is not None
    assert (one.id, one.state, one.queue, one.storage) == (11, "available", "dlq_q", "awa")


async def _run_all(side: Twin, expected: set[int]) -> Counter[int]:
    """A real worker on every queue until it ran every revived job due; how often each ran."""
    client = awa.AsyncClient(pg_url(side.url))
    ran: Counter[int] = Counter()
    done = asyncio.Event()

    async def work(job: Any) -> None:
        ran[job.id] += 1
        if expected <= set(ran):
            done.set()

    for kind, queue in {(k, q) for k, q, _, _ in FAILING} | {("revive", "moved_q")}:
        client.task(dict, kind=kind, queue=queue)(work)
    await client.start([(q, 2) for q in QUEUES], promote_interval_ms=600_000)
    try:
        await asyncio.wait_for(done.wait(), 60)
        await until_idle(client)
    finally:
        await client.shutdown()
        await client.close()
    return ran


def test_a_real_worker_runs_every_revived_job_once(sides: tuple[Twin, Twin]) -> None:
    """Every job revived due now on awa-sa's twin (1, 2, 4 to 9, 11; 3 is scheduled for later,
    10 stayed in the DLQ), and the live job that holds 10's key, run once each."""
    _, sa_side = sides
    expected = {1, 2, 4, 5, 6, 7, 8, 9, 11, len(FAILING) + 1}
    ran = asyncio.run(_run_all(sa_side, expected))
    assert ran == Counter(dict.fromkeys(expected, 1)), ran
    done = rows(
        sa_side.engine,
        "SELECT job_id, state::text AS s FROM awa.done_entries WHERE state = 'completed'",
    )
    assert Counter(r["job_id"] for r in done) == Counter(dict.fromkeys(expected, 1))
    assert pg_call(sa_side.url, lambda c: c.dlq_depth()) == 1


def test_both_retries_are_refused_while_routing_is_canonical(real_engine: sa.Engine) -> None:
    message = "DLQ APIs currently require an active queue_storage backend"
    for call in (
        lambda: awa_sa.retry_from_dlq(real_engine, 1),
        lambda: awa_sa.bulk_retry_from_dlq(real_engine, allow_all=True),
    ):
        with pytest.raises(ValidationError, match=message):
            call()
    for bad in ({"run_at": dt.datetime(2100, 1, 1)}, {"priority": 2**15}, {"queue": 7}):
        with pytest.raises(ValidationError):
            awa_sa.retry_from_dlq(real_engine, 1, **bad)
