"""Retries onto queues with several enqueue shards: awa-sa picks each shard as awa-pg 0.6.9 does.

awa-pg's administering call builds a queue store of its own, whose shard rotor starts at 0: a
call that enqueues one job again (``retry``, ``retry_external``, ``retry_from_dlq``) puts it on
shard 0, and one that enqueues several moves the rotor once per job (``retry_failed``, job by
job in id order) or per lane (``bulk_retry_from_dlq``, one insert), skipping queues with one
shard. awa-sa counts the same picks, so its rows are awa-pg's, shard and lane numbers included.

Twin clusters built by ``awa migrate``, in two phases: active (each auto-finalized to queue
storage in schema ``awa`` by its first real awa-pg runtime) and mixed_transition (flipped by
the real CLI to ``awa_qs``, its worker of the ``queue_storage_target`` role), with
``awa.queue_meta.enqueue_shards`` 4 for ``shard_q`` and 3 for ``tri_q`` once its first real
awa-pg runtime has failed the same jobs in the same order, parked two on a callback and
awa-pg's move has filed some in the DLQ (awa-pg's producer picks a shard by a rotor its
process keeps across clients, which would give the twins different starting rows). Each retry
is done by awa-pg's ``AsyncClient`` on one twin and by awa-sa in a caller's transaction that
also commits a business row on the other: every table of the phase's schemas, every sequence
and NOTIFY compared. Last, a real worker runs every retried job once, whatever its shard.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import awa
import pytest
import sqlalchemy as sa
from administering import PHASES, Phase, Twin, pair_twins, same_job, twin_pair, until_routed
from runtimes import pg_url, rows, until_idle

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

SHARDS = {"shard_q": 4, "tri_q": 3}
FAILING: tuple[tuple[str, str, int], ...] = (
    # (kind, queue, priority): failed by a real worker (max_attempts 1), ids 1.. in this order.
    ("one", "shard_q", 2),  # 1: retry_job
    ("mixed", "plain_q", 2),  # 2..6: retry_failed by kind, picks skip plain_q
    ("mixed", "shard_q", 2),
    ("mixed", "shard_q", 2),
    ("mixed", "plain_q", 2),
    ("mixed", "shard_q", 2),
    ("by_q", "tri_q", 2),  # 7..10: retry_failed by queue: shards 0, 1, 2, then 0 again
    ("by_q", "tri_q", 2),
    ("by_q", "tri_q", 3),
    ("by_q", "tri_q", 2),
    ("dead", "shard_q", 2),  # 11: retry_from_dlq
    ("dead_bulk", "shard_q", 2),  # 12..15: bulk_retry_from_dlq, three lanes, one per pick
    ("dead_bulk", "shard_q", 3),
    ("dead_bulk", "tri_q", 2),
    ("dead_bulk", "shard_q", 2),
)
DEAD = (11, 12, 13, 14, 15)
WAITS = (16, 17)
"""Parked on a callback on ``shard_q``: one retried by ``retry_external``, one by ``retry_job``."""
QUEUES = ("shard_q", "tri_q", "plain_q")
CHANNELS = (*(f"awa:{q}" for q in QUEUES), "awa:cancel")


async def _fails(job: Any) -> Any:
    raise RuntimeError(f"boom {job.id}")


async def _parks(job: Any) -> Any:
    return awa.WaitForCallback(await job.register_callback(timeout_seconds=3600))


async def _until(side: Twin, schema: str, job_id: int, state: str) -> None:
    for _ in range(1200):
        found = rows(
            side.engine,
            f"SELECT state::text AS s FROM {schema}.done_entries WHERE job_id = :i"
            f" UNION ALL SELECT state::text FROM {schema}.leases WHERE job_id = :i",
            i=job_id,
        )
        if found and found[0]["s"] == state:
            return
        await asyncio.sleep(0.05)  # the worker's own pace
    raise AssertionError(f"job {job_id} was not {state} within 60 s")


def _prepare(phase: Phase) -> Any:
    async def prepare(side: Twin) -> None:
        await _prepared(side, phase)

    return prepare


async def _prepared(side: Twin, phase: Phase) -> None:
    client = awa.AsyncClient(pg_url(side.url))
    for kind, queue, _ in FAILING:
        client.task(dict, kind=kind, queue=queue)(_fails)
    client.task(dict, kind="waits", queue="shard_q")(_parks)
    await client.start([(q, 1) for q in QUEUES], promote_interval_ms=600_000, **phase.start)
    try:
        await until_routed(side, phase)
        for n, (kind, queue, priority) in enumerate(FAILING, 1):
            await client.insert({"n": n}, kind=kind, queue=queue, priority=priority, max_attempts=1)
            await _until(side, phase.schema, n, "failed")
        for n in WAITS:
            await client.insert({"n": n}, kind="waits", queue="shard_q")
            await _until(side, phase.schema, n, "waiting_external")
    finally:
        await client.shutdown()
    try:
        for n in DEAD:
            assert await client.move_failed_to_dlq(n, "poison") is not None
    finally:
        await client.close()
    # Sharded only now: awa-pg's producer picks by a rotor its process keeps across clients,
    # which would put the twins' first rows on different shards.
    with side.engine.begin() as conn:
        for queue, shards in SHARDS.items():
            conn.execute(
                sa.text("INSERT INTO awa.queue_meta (queue, enqueue_shards) VALUES (:q, :n)"),
                {"q": queue, "n": shards},
            )


class Sides(NamedTuple):
    phase: Phase
    twins: tuple[Twin, Twin]


@pytest.fixture(scope="module", params=sorted(PHASES))
def sides(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[Sides]:
    phase = PHASES[request.param]
    for pair in twin_pair(pg, awa_databases, real_template, _prepare(phase), phase):
        yield Sides(phase, pair)


def _both(sides: Sides, on_pg: Any, on_sa: Any) -> tuple[Any, Any, dict[str, Any], Any]:
    return pair_twins(sides.twins, on_pg, on_sa, schemas=sides.phase.schemas, channels=CHANNELS)


def _placed(sides: Sides, ids: tuple[int, ...]) -> dict[int, int]:
    """Each job's newest ready row's enqueue shard (awa-sa's twin): the retry's, due after
    the first."""
    found = rows(
        sides.twins[1].engine,
        f"SELECT DISTINCT ON (job_id) job_id, enqueue_shard FROM {sides.phase.schema}"
        ".ready_entries WHERE job_id = ANY(:ids) ORDER BY job_id, run_at DESC",
        ids=list(ids),
    )
    return {r["job_id"]: r["enqueue_shard"] for r in found}


def _callback_id(side: Twin, schema: str, job_id: int) -> str:
    found = rows(
        side.engine,
        f"SELECT callback_id::text AS c FROM {schema}.leases WHERE job_id = :i",
        i=job_id,
    )
    return str(found[0]["c"])


def test_one_job_retried_lands_on_shard_0_as_awa_pgs(sides: Sides) -> None:
    """retry_job of a failed job and of a wait, retry_external, retry_from_dlq: one pick each."""
    pg_side, sa_side = sides.twins
    schema = sides.phase.schema
    waits = {side: _callback_id(side, schema, WAITS[0]) for side in sides.twins}
    for on_pg, on_sa, job_id in (
        (lambda c: c.retry(1), lambda conn: awa_sa.retry_job(conn, 1), 1),
        (lambda c: c.retry(WAITS[1]), lambda conn: awa_sa.retry_job(conn, WAITS[1]), WAITS[1]),
        (
            lambda c: c.retry_external(waits[pg_side]),
            lambda conn: awa_sa.retry_external(conn, waits[sa_side]),
            WAITS[0],
        ),
        (lambda c: c.retry_from_dlq(11), lambda conn: awa_sa.retry_from_dlq(conn, 11), 11),
    ):
        got_pg, got_sa, changed, notes = _both(sides, on_pg, on_sa)
        same_job(got_sa, got_pg)
        assert (got_sa.state, got_sa.attempt) == ("available", 0), job_id
        assert {f"{schema}.ready_entries", "sequences"} <= set(changed), (job_id, sorted(changed))
        assert notes == [("awa:shard_q", "")], job_id
        assert _placed(sides, (job_id,)) == {job_id: 0}


def test_a_bulk_retry_spreads_its_picks_as_awa_pgs(sides: Sides) -> None:
    """retry_failed moves the rotor once per job of a sharded queue, in id order;
    bulk_retry_from_dlq once per lane, in lane order: the lanes of other shards ensured as
    awa-pg ensures them (their lock, head rows and sequences)."""
    for by, placed in (
        ({"kind": "mixed"}, {2: 0, 3: 0, 4: 1, 5: 0, 6: 2}),
        ({"queue": "tri_q"}, {7: 0, 8: 1, 9: 2, 10: 0}),
    ):
        got_pg, got_sa, changed, notes = _both(
            sides,
            lambda c, b=by: c.retry_failed(**b),
            lambda conn, b=by: awa_sa.retry_failed(conn, **b),
        )
        assert (got_sa.matched, got_sa.pruned_failed_count) == (
            got_pg.matched,
            got_pg.pruned_failed_count,
        ), by
        for sa_job, pg_job in zip(
            got_sa.jobs, sorted(got_pg.jobs, key=lambda j: j.id), strict=True
        ):
            same_job(sa_job, pg_job)
        assert _placed(sides, tuple(placed)) == placed, by
        heads = {f"{sides.phase.schema}.queue_{t}_heads" for t in ("enqueue", "claim")}
        assert heads <= set(changed), by
        assert notes, by
    got_pg, got_sa, changed, notes = _both(
        sides,
        lambda c: c.bulk_retry_from_dlq(kind="dead_bulk"),
        lambda conn: awa_sa.bulk_retry_from_dlq(conn, kind="dead_bulk"),
    )
    assert got_pg == got_sa == 4
    # Lanes in order (shard_q, 2), (shard_q, 3), (tri_q, 2): picks 0, 1, 2.
    assert _placed(sides, DEAD[1:]) == {12: 0, 13: 1, 14: 2, 15: 0}
    assert [channel for channel, _ in notes] == ["awa:shard_q", "awa:tri_q"]


async def _run_all(side: Twin, phase: Phase, expected: set[int]) -> Counter[int]:
    """A real worker on every queue until it ran every retried job; how often each ran."""
    client = awa.AsyncClient(pg_url(side.url))
    ran: Counter[int] = Counter()
    done = asyncio.Event()

    async def work(job: Any) -> None:
        ran[job.id] += 1
        if expected <= set(ran):
            done.set()

    for kind, queue in {(k, q) for k, q, _ in FAILING} | {("waits", "shard_q")}:
        client.task(dict, kind=kind, queue=queue)(work)
    await client.start([(q, 2) for q in QUEUES], promote_interval_ms=600_000, **phase.start)
    try:
        await asyncio.wait_for(done.wait(), 60)
        await until_idle(client)
    finally:
        await client.shutdown()
        await client.close()
    return ran


def test_a_real_worker_runs_every_retried_job_once_whatever_its_shard(sides: Sides) -> None:
    _, sa_side = sides.twins
    expected = set(range(1, len(FAILING) + 1)) | set(WAITS)
    ran = asyncio.run(_run_all(sa_side, sides.phase, expected))
    assert ran == Counter(dict.fromkeys(expected, 1)), ran
    done = rows(
        sa_side.engine,
        f"SELECT job_id FROM {sides.phase.schema}.done_entries WHERE state = 'completed'",
    )
    assert Counter(r["job_id"] for r in done) == Counter(dict.fromkeys(expected, 1))
