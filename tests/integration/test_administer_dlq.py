"""The dead-letter queue: awa-sa moves, reads and purges what awa-pg 0.6.9's own Client does.

Twin clusters built by ``awa migrate``, each auto-finalized to queue storage in schema ``awa``
by its first real awa-pg runtime, which then fails the same jobs in the same order (each with
one attempt: a failed ``done_entries`` row, its receipt, its terminal count), a maintenance
leader lock held so nothing prunes or rolls up behind the comparison. Each verb is done by
awa-pg's ``AsyncClient`` on one twin and by awa-sa in a caller's transaction that also commits
a business row on the other: every table of schema ``awa`` and every sequence compared, clocks
masked, the NOTIFYs too, and the answers. On a canonical cluster every DLQ call is refused as
awa-pg refuses it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import Twin, snapshot, twin_pair, twins, until_failed
from runtimes import pg_url
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import DlqEntry, ValidationError
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

FAILING: tuple[tuple[str, str, dict[str, Any]], ...] = (
    # (kind, queue, options): failed by a real worker (max_attempts 1), jobs 1.. in this order.
    ("dead_one", "dlq_q", {"unique_opts": {"by_args": True}, "tags": ["a"], "metadata": {"m": 1}}),
    ("dead_kind", "dlq_q", {"tags": ["t"]}),
    ("dead_kind", "dlq_q", {}),
    ("dead_q", "other_q", {"tags": ["t"]}),
    ("dead_q", "other_q", {}),
    ("dead_async", "dlq_q", {}),
)
CHANNELS = ("awa:dlq_q", "awa:other_q", "awa:cancel")


async def _fail_all(side: Twin) -> None:
    client = awa.AsyncClient(pg_url(side.url))

    async def fails(job: Any) -> Any:
        raise RuntimeError(f"boom {job.id}")

    for kind in {k for k, _, _ in FAILING}:
        for queue in ("dlq_q", "other_q"):
            client.task(dict, kind=kind, queue=queue)(fails)
    await client.start([("dlq_q", 1), ("other_q", 1)], promote_interval_ms=600_000)
    try:
        for n, (kind, queue, options) in enumerate(FAILING, 1):
            await client.insert({"n": n}, kind=kind, queue=queue, max_attempts=1, **options)
            await until_failed(side.engine, n)
    finally:
        await client.shutdown()
        await client.close()


@pytest.fixture(scope="module")
def sides(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[tuple[Twin, Twin]]:
    yield from twin_pair(pg, awa_databases, real_template, _fail_all)


def _same_entry(got_sa: DlqEntry | None, got_pg: Any) -> None:
    assert got_sa is not None
    assert got_pg is not None
    job = got_sa.job
    assert (got_sa.reason, got_sa.original_run_lease) == (got_pg.reason, got_pg.original_run_lease)
    pg_job = got_pg.job
    assert (job.id, job.kind, job.queue, job.args, job.attempt, job.tags, job.metadata) == (
        pg_job.id,
        pg_job.kind,
        pg_job.queue,
        pg_job.args,
        pg_job.attempt,
        pg_job.tags,
        pg_job.metadata,
    )
    assert job.state == str(pg_job.state).rsplit(".", 1)[-1].lower() == "failed"
    assert len(job.errors) == len(pg_job.errors or [])


def _both(sides: tuple[Twin, Twin], on_pg: Any, on_sa: Any) -> tuple[Any, Any, dict[str, Any]]:
    urls, engines = (sides[0].url, sides[1].url), (sides[0].engine, sides[1].engine)
    got_pg, got_sa, changed, notes = twins(
        urls, engines, on_pg, on_sa, schemas=("awa",), channels=CHANNELS
    )
    assert notes == []
    return got_pg, got_sa, changed


def test_moves_reads_and_purges_write_and_answer_what_awa_pg_does(
    sides: tuple[Twin, Twin],
) -> None:
    got_pg, got_sa, changed = _both(
        sides,
        lambda c: c.move_failed_to_dlq(1, "poison"),
        lambda conn: awa_sa.move_failed_to_dlq(conn, 1, "poison"),
    )
    _same_entry(got_sa, got_pg)
    assert {"awa.done_entries", "awa.dlq_entries", "awa.queue_terminal_count_deltas"} <= set(
        changed
    )
    # No failed row left to move: None from both, nothing written.
    got_pg, got_sa, changed = _both(
        sides,
        lambda c: c.move_failed_to_dlq(1, "again"),
        lambda conn: awa_sa.move_failed_to_dlq(conn, 1, "again"),
    )
    assert (got_pg, got_sa, changed) == (None, None, {})
    got_pg, got_sa, changed = _both(
        sides,
        lambda c: c.bulk_move_failed_to_dlq(kind="dead_kind", reason="batch"),
        lambda conn: awa_sa.bulk_move_failed_to_dlq(conn, kind="dead_kind", reason="batch"),
    )
    assert got_pg == got_sa == 2
    got_pg, got_sa, _ = _both(
        sides,
        lambda c: c.bulk_move_failed_to_dlq(queue="other_q"),
        lambda conn: awa_sa.bulk_move_failed_to_dlq(conn, queue="other_q"),
    )
    assert got_pg == got_sa == 2
    for filters in ({}, {"kind": "dead_kind"}, {"queue": "other_q"}, {"tag": "t"}, {"limit": 2}):
        got_pg, got_sa, changed = _both(
            sides,
            lambda c, f=filters: c.list_dlq(**f),
            lambda conn, f=filters: awa_sa.list_dlq(conn, **f),
        )
        assert changed == {}
        assert [e.job.id for e in got_sa] == [e.job.id for e in got_pg], filters
        for entry_sa, entry_pg in zip(got_sa, got_pg, strict=True):
            _same_entry(entry_sa, entry_pg)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)  # the twins' clocks differ
    for cursor in ({"before_id": 4}, {"before_id": 4, "before_dlq_at": later}):
        got_pg, got_sa, _ = _both(
            sides,
            lambda c, k=cursor: c.list_dlq(**k),
            lambda conn, k=cursor: awa_sa.list_dlq(conn, **k),
        )
        assert [e.job.id for e in got_sa] == [e.job.id for e in got_pg]
        assert got_sa
    for job_id in (1, 2, 6, 99):
        got_pg, got_sa, _ = _both(
            sides,
            lambda c, i=job_id: c.get_dlq_job(i),
            lambda conn, i=job_id: awa_sa.get_dlq_job(conn, i),
        )
        if got_pg is None:
            assert got_sa is None
        else:
            _same_entry(got_sa, got_pg)
    for queue in (None, "dlq_q", "none_q"):
        got_pg, got_sa, _ = _both(
            sides,
            lambda c, q=queue: c.dlq_depth(queue=q),
            lambda conn, q=queue: awa_sa.dlq_depth(conn, queue=q),
        )
        assert got_pg == got_sa
    for job_id in (2, 2):
        got_pg, got_sa, _ = _both(
            sides,
            lambda c, i=job_id: c.purge_dlq_job(i),
            lambda conn, i=job_id: awa_sa.purge_dlq_job(conn, i),
        )
        assert got_pg == got_sa
    got_pg, got_sa, _ = _both(
        sides,
        lambda c: c.purge_dlq(tag="t"),
        lambda conn: awa_sa.purge_dlq(conn, tag="t"),
    )
    assert got_pg == got_sa == 1


def test_a_rolled_back_move_leaves_nothing_and_the_async_twins_agree(
    sides: tuple[Twin, Twin],
) -> None:
    _, sa_side = sides
    before = snapshot(sa_side.engine)
    with sa_side.engine.connect() as conn:
        assert awa_sa.move_failed_to_dlq(conn, 6, "rolled back") is not None
        assert awa_sa.purge_dlq(conn, allow_all=True) >= 1
        conn.rollback()
    assert snapshot(sa_side.engine) == before

    async def through_async() -> tuple[Any, ...]:
        engine = create_async_engine(sa_side.url)
        try:
            async with engine.connect() as conn:
                moved = await awa_async.move_failed_to_dlq(conn, 6, "async")
                depth = await awa_async.dlq_depth(conn)
                listed = await awa_async.list_dlq(conn, kind="dead_async")
                got = await awa_async.get_dlq_job(conn, 6)
                gone = await awa_async.purge_dlq_job(conn, 6)
                bulk = await awa_async.bulk_move_failed_to_dlq(conn, kind="dead_async")
                purged = await awa_async.purge_dlq(conn, kind="dead_async")
                await conn.rollback()
            return moved, depth, listed, got, gone, bulk, purged
        finally:
            await engine.dispose()

    moved, depth, listed, got, gone, bulk, purged = asyncio.run(through_async())
    assert moved is not None
    assert moved.reason == "async"
    assert [e.job.id for e in listed] == [6]
    assert got == moved
    assert (gone, bulk, purged) == (True, 0, 0)
    assert depth >= 1
    assert snapshot(sa_side.engine) == before
    with pytest.raises(ValidationError, match="allow_all"):
        awa_sa.bulk_move_failed_to_dlq(sa_side.engine)
    with pytest.raises(ValidationError, match="allow_all"):
        awa_sa.purge_dlq(sa_side.engine)


def test_every_dlq_call_is_refused_while_routing_is_canonical(
    real_engine: sa.Engine, real_db_url: str
) -> None:
    async def on_pg() -> str:
        client = awa.AsyncClient(pg_url(real_db_url))
        try:
            await client.dlq_depth()
        except Exception as exc:  # awa-pg's own refusal
            return str(exc)
        finally:
            await client.close()
        raise AssertionError("awa-pg answered a DLQ call on a canonical cluster")

    refused = asyncio.run(on_pg())
    for call in (
        lambda: awa_sa.dlq_depth(real_engine),
        lambda: awa_sa.list_dlq(real_engine),
        lambda: awa_sa.move_failed_to_dlq(real_engine, 1, "x"),
        lambda: awa_sa.purge_dlq_job(real_engine, 1),
    ):
        with pytest.raises(ValidationError) as caught:
            call()
        assert str(caught.value) in refused
