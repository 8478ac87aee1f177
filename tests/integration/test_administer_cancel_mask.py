"""Cancelling a queue-storage job whose unique mask claims ``cancelled`` but not its own state.

awa-pg 0.6.9's cancel moves the job's claim as its ``sync_unique_claim`` does before it files
the cancelled row: taken for the cancelled row, or, when another job holds the key, its
``UniqueConflict`` and nothing written. awa-sa writes the same in the caller's transaction.

Twin clusters per phase: active (auto-finalized by the first real runtime) and
mixed_transition (flipped by the real CLI to ``awa_qs``). On each, the same jobs in the same
order: a real worker makes a retryable job and three callback waits (one at a time, so the
receipts are in step), then jobs no worker serves, available (behind a lane's head) and
scheduled, with the masks ``00000010`` (cancelled only; ``states`` bit 6) and ``00010110``
(completed, failed, cancelled). Each cancel, by id and by key, and a drain of the three
shapes, run by awa-pg's ``AsyncClient`` on one twin and by awa-sa in a caller's transaction
that also commits a business row on the other: every table and sequence compared (the drain:
but the claim cursor awa-pg moves past a cancelled head after its commit,
docs/contract.md#cancel). Last, the conflicts: a cancel and a drain that would take a key
another job holds raise on both twins, nothing written.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import (
    PHASES,
    Phase,
    Twin,
    business,
    change,
    heard,
    pair_twins,
    pg_call,
    sa_call,
    same_job,
    snapshot,
    twin_pair,
    until_routed,
)
from runtimes import pg_url, rows

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes and the real CLI

ONLY = 0b0100_0000
"""Claims in ``cancelled`` alone: the text mask ``00000010``."""
ENDS = 0b0110_1000
"""Claims in completed, failed and cancelled: ``00010110``."""
LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
WORKED: tuple[tuple[str, str, dict[str, Any], int, str], ...] = (
    # (kind, queue, args, mask, the state a real worker leaves it in), ids 1.. in this order.
    ("flaky", "work_q", {"n": 1}, ONLY, "retryable"),  # 1: by id
    ("waits", "work_q", {"n": 2}, ONLY, "waiting_external"),  # 2: by id
    ("waits", "work_q", {"n": 3}, ENDS, "waiting_external"),  # 3: by key
    ("waits", "drain_q", {"n": 4}, ONLY, "waiting_external"),  # 4: drained
)
JOBS: tuple[tuple[str, str, dict[str, Any], int | None, bool], ...] = (
    # (kind, queue, args, mask, scheduled), ids 5.. in this order, no worker serving them.
    ("plain", "mask_q", {"n": 5}, None, False),  # 5: the lane's head, left alone
    ("masked", "mask_q", {"n": 6}, ONLY, False),  # 6: available, by id
    ("masked", "mask_q", {"n": 7}, ENDS, False),  # 7: available, by key
    ("masked", "mask_q", {"n": 8}, ONLY, True),  # 8: scheduled, by id
    ("masked", "mask_q", {"n": 9}, ENDS, True),  # 9: scheduled, by key
    ("masked", "mask_q", {"dup": 1}, ONLY, True),  # 10: takes the key, by id
    ("masked", "mask_q", {"dup": 1}, ONLY, True),  # 11: then finds it held
    ("masked", "drain_q", {"n": 12}, ONLY, False),  # 12: drained, available (its lane's head)
    ("masked", "drain_q", {"n": 13}, ENDS, True),  # 13: drained, scheduled
    ("masked", "held_q", {"dup": 2}, ONLY, True),  # 14, 15: a drain that finds its key held
    ("masked", "held_q", {"dup": 2}, ONLY, True),
)
KEYS = {3: ("waits", {"n": 3}), 7: ("masked", {"n": 7}), 9: ("masked", {"n": 9})}
"""Cancelled by unique key; the others of CANCELLED by id."""
CANCELLED = (1, 2, 3, 6, 7, 8, 9, 10)
CHANNELS = ("awa:cancel", "awa:mask_q", "awa:drain_q", "awa:work_q", "awa:held_q")


async def _flaky(job: Any) -> Any:
    raise RuntimeError("again later")


async def _parks(job: Any) -> Any:
    return awa.WaitForCallback(await job.register_callback(timeout_seconds=3600))


def _state(side: Twin, schema: str, job_id: int) -> str | None:
    found = rows(
        side.engine,
        f"SELECT state::text AS s FROM {schema}.deferred_jobs WHERE job_id = :i"
        f" UNION ALL SELECT state::text FROM {schema}.leases WHERE job_id = :i",
        i=job_id,
    )
    return str(found[0]["s"]) if found else None


def _prepare(phase: Phase) -> Any:
    async def prepare(side: Twin) -> None:
        client = awa.AsyncClient(pg_url(side.url))
        client.task(dict, kind="flaky", queue="work_q")(_flaky)
        for queue in ("work_q", "drain_q"):
            client.task(dict, kind="waits", queue=queue)(_parks)
        queues = [("work_q", 1), ("drain_q", 1)]
        await client.start(queues, promote_interval_ms=600_000, **phase.start)
        try:
            await until_routed(side, phase)
            for n, (kind, queue, args, mask, state) in enumerate(WORKED, 1):
                unique = {"states": mask}
                job = await client.insert(
                    args, kind=kind, queue=queue, max_attempts=3, unique_opts=unique
                )
                assert job.id == n
                for _ in range(1200):  # one at a time: the twins' receipts in step
                    if _state(side, phase.schema, n) == state:
                        break
                    await asyncio.sleep(0.05)  # the worker's own pace
                else:
                    raise AssertionError(f"job {n} was not {state} within 60 s")
        finally:
            await client.shutdown()
        try:
            for n, (kind, queue, args, states, scheduled) in enumerate(JOBS, len(WORKED) + 1):
                job = await client.insert(
                    args,
                    kind=kind,
                    queue=queue,
                    run_at=LATER if scheduled else None,
                    unique_opts=None if states is None else {"states": states},
                )
                assert job.id == n
        finally:
            await client.close()

    return prepare


@pytest.fixture(scope="module", params=sorted(PHASES))
def sides(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[tuple[Phase, Twin, Twin]]:
    phase = PHASES[request.param]
    for pair in twin_pair(pg, awa_databases, real_template, _prepare(phase), phase):
        yield phase, *pair


def _cancel(job_id: int) -> tuple[Any, Any]:
    if job_id in KEYS:
        kind, args = KEYS[job_id]
        return (
            lambda c: c.cancel_by_unique_key(kind, args=args),
            lambda conn: awa_sa.cancel_by_unique_key(conn, kind, args=args),
        )
    return (lambda c: c.cancel(job_id), lambda conn: awa_sa.cancel_job(conn, job_id))


def _claims(side: Twin) -> set[int]:
    return {r["job_id"] for r in rows(side.engine, "SELECT job_id FROM awa.job_unique_claims")}


def _refused_alike(phase: Phase, pg_side: Twin, sa_side: Twin, on_pg: Any, on_sa: Any) -> None:
    """awa-pg's call raises its UniqueConflict and writes nothing; so does awa-sa's, in a
    caller's transaction that goes on to commit its business rows."""
    before = snapshot(pg_side.engine, phase.schemas), snapshot(sa_side.engine, phase.schemas)
    paid = business(sa_side.engine)
    with pytest.raises(awa.UniqueConflict):
        pg_call(pg_side.url, on_pg)
    with sa_side.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('before')"))
        with pytest.raises(awa_sa.UniqueConflict, match="held by another job"):
            on_sa(conn)
        conn.execute(sa.text("INSERT INTO public.business VALUES ('after')"))
    assert snapshot(pg_side.engine, phase.schemas) == before[0]
    assert snapshot(sa_side.engine, phase.schemas) == before[1]
    assert business(sa_side.engine) == paid + 2


def test_each_shape_takes_the_cancelled_claim_as_awa_pg(
    sides: tuple[Phase, Twin, Twin],
) -> None:
    """Retryable, waiting, available and scheduled jobs, each mask, by id and by key; then a
    cancel, by id and by key, of a job whose key the cancelled job 10 now holds."""
    phase, pg_side, sa_side = sides
    masks = rows(
        sa_side.engine,
        f"SELECT unique_states FROM {phase.schema}.ready_entries"
        " WHERE job_id IN (6, 7) ORDER BY job_id",
    )
    assert [r["unique_states"] for r in masks] == ["00000010", "00010110"]  # bit 6: cancelled
    for job_id in CANCELLED:
        on_pg, on_sa = _cancel(job_id)
        got_pg, got_sa, changed, notes = pair_twins(
            (pg_side, sa_side), on_pg, on_sa, schemas=phase.schemas, channels=CHANNELS
        )
        same_job(got_sa, got_pg)
        assert (got_sa.id, got_sa.state, got_sa.storage) == (job_id, "cancelled", phase.schema)
        assert "awa.job_unique_claims" in changed, (job_id, sorted(changed))
        assert job_id in _claims(sa_side), job_id
        assert bool(notes) == (job_id in (2, 3)), (job_id, notes)  # a wait's handler told
    _refused_alike(
        phase, pg_side, sa_side, lambda c: c.cancel(11), lambda conn: awa_sa.cancel_job(conn, 11)
    )
    _refused_alike(
        phase,
        pg_side,
        sa_side,
        lambda c: c.cancel_by_unique_key("masked", args={"dup": 1}),
        lambda conn: awa_sa.cancel_by_unique_key(conn, "masked", args={"dup": 1}),
    )


def test_a_drain_takes_each_claim_or_writes_nothing_as_awa_pg(
    sides: tuple[Phase, Twin, Twin],
) -> None:
    """A wait, an available head and a scheduled job drained; then a drain whose second job
    finds the key its first took: rolled back whole by both."""
    phase, pg_side, sa_side = sides
    before = snapshot(pg_side.engine, phase.schemas), snapshot(sa_side.engine, phase.schemas)
    got_pg, pg_heard = heard(
        pg_side.url, CHANNELS, lambda: pg_call(pg_side.url, lambda c: c.drain_queue("drain_q"))
    )
    got_sa, sa_heard = heard(
        sa_side.url,
        CHANNELS,
        lambda: sa_call(sa_side.engine, lambda conn: awa_sa.drain_queue(conn, "drain_q")),
    )
    pg_change = change(before[0], snapshot(pg_side.engine, phase.schemas))
    sa_change = change(before[1], snapshot(sa_side.engine, phase.schemas))
    # awa-pg moves the lane's claim cursor past the cancelled head after its commit; awa-sa
    # leaves it to the claim (docs/contract.md#cancel): that sequence alone differs.
    moved = pg_change.pop("sequences")
    assert "sequences" not in sa_change
    assert len(moved[1]) == 1, moved
    assert sa_change == pg_change
    assert got_sa == got_pg == 3
    assert sa_heard == pg_heard == [("awa:cancel", '{"job_id":4,"run_lease":1}')]
    assert {4, 12, 13} <= _claims(sa_side)
    _refused_alike(
        phase,
        pg_side,
        sa_side,
        lambda c: c.drain_queue("held_q"),
        lambda conn: awa_sa.drain_queue(conn, "held_q"),
    )
