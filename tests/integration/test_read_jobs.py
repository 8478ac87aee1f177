"""get_job and jobs_view: the answer awa-pg 0.6.9's get_job gives, read in the caller's snapshot.

The comparisons run on ``awa migrate`` clusters in each phase a real runtime serves (canonical,
mixed_transition, active), over jobs a real awa-pg runtime put in every state
(:mod:`reading`), some still held by their handlers. A read writes nothing, so awa-pg's
``Client.get_job`` and awa-sa's read the same cluster at the same moment: the same rows, the
same clocks. The snapshot and plan tests seed with the testing kit on the fixture (queue
storage in ``awa``) and the canonical tables, and read the plans PostgreSQL chose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import QUIESCED_FLIP, run_awa
from reading import Seeded, populated
from runtimes import STILL_RINGS, hold_leadership, pg_url
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio
import awa_sa.read.api
from awa_sa.core.compiled import compiled
from awa_sa.read.statements.lookups import read_job
from awa_sa.testing import queue_storage_attempt
from awa_sa.testing.server import EmbeddedPostgres

LATER = datetime.now(UTC) + timedelta(days=1)
AWA_PG_FIELDS = ("id", "kind", "queue", "priority", "attempt", "max_attempts", "tags", "args")
AWA_PG_JSON = ("metadata", "errors", "progress")
AWA_PG_CLOCKS = {"run_at": "run_at", "deadline": "deadline_at", "created_at": "created_at"}
AWA_PG_CLOCKS["finalized_at"] = "finalized_at"


def same_as_awa_pg(mine: awa_sa.JobRow | None, theirs: Any) -> None:
    """awa-sa's row says what awa-pg's ``Job`` says, every field it has."""
    assert mine is not None, theirs.id
    for name in AWA_PG_FIELDS + AWA_PG_JSON:
        assert getattr(mine, name) == getattr(theirs, name), (theirs.id, name)
    assert mine.state == str(theirs.state).rsplit(".", 1)[-1].lower(), theirs.id
    for pg_name, name in AWA_PG_CLOCKS.items():
        ours = getattr(mine, name)
        assert (None if ours is None else ours.isoformat()) == _rfc3339(getattr(theirs, pg_name))


def _rfc3339(text: str | None) -> str | None:
    """awa-pg's clock text as Python's isoformat writes the same instant."""
    if text is None:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).isoformat()


LISTINGS: list[dict[str, Any]] = [
    {},
    *({"state": state} for state in sorted(awa_sa.read.api.JOB_STATES)),
    {"kind": "complete_rich"},
    {"queue": "run_q"},
    {"queue": "run_q", "state": "completed", "kind": "complete_bare"},
    {"queue": "idle_q"},
    {"limit": 3},
    {"limit": 1, "state": "failed"},
    {"limit": 0},
]
"""The listings compared: every filter awa-pg's ``list_jobs`` takes, alone and together, and
limits (0 is clamped to 1 on queue storage, not on the canonical plane)."""


async def _awa_pg_reads(url: str, ids: list[int]) -> tuple[dict[int, Any], list[Any], list[Any]]:
    """awa-pg's ``get_job`` of each id, its ``list_jobs`` of each listing, its ``queue_stats``."""
    client = awa.AsyncClient(pg_url(url))
    try:
        found: dict[int, Any] = {}
        for job_id in ids:
            try:
                found[job_id] = await client.get_job(job_id)
            except awa.AwaError as exc:
                found[job_id] = None
                missing = str(exc)
                assert "job not found" in missing
        listed = [await client.list_jobs(**listing) for listing in LISTINGS]
        return found, listed, await client.queue_stats()
    finally:
        await client.close()


def _compare(
    url: str, engine: sa.Engine, schema: str | None, before: list[int]
) -> Callable[[Seeded], None]:
    def compare(made: Seeded) -> None:
        ids = sorted({*made.ids.values(), *before, 1, 2**40})
        theirs, their_lists, their_stats = asyncio.run(_awa_pg_reads(url, ids))
        with engine.begin() as conn:
            mine = {job_id: awa_sa.get_job(conn, job_id) for job_id in ids}
            my_lists = [awa_sa.list_jobs(conn, **listing) for listing in LISTINGS]
            my_stats = awa_sa.queue_stats(conn)
            listed_all = awa_sa.list_jobs(conn, limit=1000)
            by_tag = awa_sa.list_jobs(conn, tag="x")
            paged = awa_sa.list_jobs(conn, before_id=listed_all[2].id, limit=3)
            conn.execute(sa.text("CREATE TEMP TABLE orders (id serial, job_id bigint)"))
            conn.execute(sa.text("INSERT INTO orders (job_id) SELECT unnest(:ids)"), {"ids": ids})
            orders = sa.table("orders", sa.column("id"), sa.column("job_id"))
            job = awa_sa.jobs_view(schema).subquery("job")
            joined = conn.execute(
                sa.select(orders.c.job_id, *job.c).join(job, job.c.id == orders.c.job_id)
            ).all()
        for job_id in ids:
            if theirs[job_id] is None:
                assert mine[job_id] is None, job_id
            else:
                same_as_awa_pg(mine[job_id], theirs[job_id])
        by_view = {row.job_id: awa_sa.JobRow(**_fields(row)) for row in joined}
        assert by_view == {job_id: row for job_id, row in mine.items() if row is not None}
        states = {row.state for row in mine.values() if row is not None}
        assert {"available", "scheduled", "running", "waiting_external", "retryable"} <= states
        assert {"completed", "failed", "cancelled"} <= states
        assert all(getattr(mine[held], "state", None) != "available" for held in made.held)
        for listing, ours, listed in zip(LISTINGS, my_lists, their_lists, strict=True):
            assert [j.id for j in ours] == [j.id for j in listed], listing
            for row, job in zip(ours, listed, strict=True):
                same_as_awa_pg(row, job)
        assert any(my_lists), "every listing came back empty"
        for job_id in before:  # canonical; in mixed_transition still draining, and hidden
            assert (theirs[job_id] is None) == (schema is not None), job_id
            assert job_id not in {j.id for j in listed_all} or schema is None, job_id
        assert by_tag == [j for j in listed_all if "x" in j.tags][:100]
        assert paged == [j for j in listed_all if j.id < listed_all[2].id][:3]
        assert len(my_stats) == len(their_stats) > 0
        for stat, their in zip(my_stats, their_stats, strict=True):
            for name in QUEUE_STAT_FIELDS:
                assert getattr(stat, name) == getattr(their, name), (stat.queue, name)
            if their.lag_seconds is None:
                assert stat.lag_seconds is None, stat.queue
            else:  # measured against the clock, a moment apart
                assert abs((stat.lag_seconds or 0) - their.lag_seconds) < 30, stat.queue

    return compare


QUEUE_STAT_FIELDS: tuple[str, ...] = ("queue", "total_queued", "scheduled", "available")
QUEUE_STAT_FIELDS += ("retryable", "running", "failed", "waiting_external")
QUEUE_STAT_FIELDS += ("completed_last_hour", "paused")


def _fields(row: Any) -> dict[str, Any]:
    fields = {k: v for k, v in row._mapping.items() if k != "job_id"}
    fields["errors"] = list(fields["errors"] or [])
    fields["tags"] = list(fields["tags"] or [])
    fields["unique_key"] = None if fields["unique_key"] is None else bytes(fields["unique_key"])
    return fields


@pytest.mark.slow  # a real awa-pg runtime and the real CLI
@pytest.mark.parametrize("phase", ["canonical", "mixed_transition", "active"])
def test_every_state_reads_as_awa_pg_reads_it(
    phase: str, pg: EmbeddedPostgres, clone_database: Callable[[str], str], real_template: str
) -> None:
    url = clone_database(real_template)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    dbname = sa.make_url(url).database or ""
    try:
        before = []
        if phase != "active":  # a job first keeps the first runtime from finalizing
            with engine.begin() as conn:  # an id queue storage's own sequence will not reach
                conn.execute(sa.text("SELECT setval('awa.jobs_id_seq', 1000)"))
            before.append(asyncio.run(_enqueue_before(url)))
        schema, role = None, None
        if phase != "canonical":
            details = '{"schema": "awa_qs"}'
            run_awa(
                pg, dbname, "storage", "prepare", "--engine", "queue_storage", "--details", details
            )
            run_awa(pg, dbname, *QUIESCED_FLIP)
            schema, role = "awa_qs", "queue_storage_target"
            if phase == "active":
                run_awa(pg, dbname, "storage", "finalize")
                role = None
        made = asyncio.run(
            populated(url, engine, _compare(url, engine, schema, before), schema=schema, role=role)
        )
        assert (made.dlq_refused is None) == (phase != "canonical")
    finally:
        engine.dispose()


async def _enqueue_before(url: str) -> int:
    """A canonical job: in mixed_transition it is still draining there, hidden by awa-pg."""
    client = awa.AsyncClient(pg_url(url))
    try:
        return (await client.insert({"n": 0}, kind="before", queue="idle_q")).id
    finally:
        await client.close()


@pytest.fixture
def queue_storage(real_engine: sa.Engine) -> sa.Engine:
    """An ``awa migrate`` cluster finalized to queue storage in ``awa`` by the kit's claim."""
    with real_engine.begin() as conn:
        queue_storage_attempt(conn, kind="held", queue="q")
    return real_engine


def test_a_read_sees_its_own_transaction(queue_storage: sa.Engine) -> None:
    with queue_storage.connect() as conn:
        job = awa_sa.enqueue(conn, {"n": 1}, kind="mine", queue="q", run_at=LATER)
        got = awa_sa.get_job(conn, job.id)
        assert got is not None
        assert (got.state, got.kind, got.storage) == (
            "scheduled",
            "mine",
            "awa",
        )
        awa_sa.cancel_job(conn, job.id)
        assert awa_sa.get_job(conn, job.id).state == "cancelled"  # type: ignore[union-attr]
        assert awa_sa.get_job(queue_storage, job.id) is None  # not committed: not seen
        conn.rollback()
    assert awa_sa.get_job(queue_storage, job.id) is None


def test_repeatable_read_answers_from_one_snapshot(queue_storage: sa.Engine) -> None:
    job = awa_sa.enqueue(queue_storage, {"n": 2}, kind="later", queue="q", run_at=LATER)
    reader = queue_storage.connect().execution_options(isolation_level="REPEATABLE READ")
    try:
        with reader.begin():
            assert awa_sa.get_job(reader, job.id).state == "scheduled"  # type: ignore[union-attr]
            awa_sa.cancel_job(queue_storage, job.id)  # committed meanwhile
            assert awa_sa.get_job(reader, job.id).state == "scheduled"  # type: ignore[union-attr]
        assert awa_sa.get_job(reader, job.id).state == "cancelled"  # type: ignore[union-attr]
    finally:
        reader.close()


async def test_the_async_twin_reads_in_its_transaction(queue_storage: sa.Engine) -> None:
    job = awa_sa.enqueue(queue_storage, {"n": 3}, kind="twin", queue="q")
    async_engine = create_async_engine(queue_storage.url, poolclass=sa.NullPool)
    try:
        assert await awa_sa.asyncio.get_job(async_engine, job.id) == awa_sa.get_job(
            queue_storage, job.id
        )
        async with async_engine.connect() as conn:
            assert (await awa_sa.asyncio.get_job(conn, job.id)).state == "available"  # type: ignore[union-attr]
    finally:
        await async_engine.dispose()


async def test_listings_and_counts_read_in_the_callers_transaction(
    queue_storage: sa.Engine,
) -> None:
    """list_jobs and queue_stats see the transaction's own enqueue, on both faces."""
    async_engine = create_async_engine(queue_storage.url, poolclass=sa.NullPool)
    try:
        async with async_engine.connect() as conn:
            job = await awa_sa.asyncio.enqueue(conn, {"n": 4}, kind="listed", queue="lq")
            mine = await awa_sa.asyncio.list_jobs(conn, kind="listed")
            assert [(j.id, j.state, j.storage) for j in mine] == [(job.id, "available", "awa")]
            stats = {s.queue: s for s in await awa_sa.asyncio.queue_stats(conn)}
            assert (stats["lq"].available, stats["lq"].total_queued) == (1, 1)
            assert await awa_sa.asyncio.list_jobs(async_engine, kind="listed") == []
            await conn.rollback()
        with queue_storage.connect() as sync:
            assert awa_sa.list_jobs(sync, kind="listed") == []
            assert "lq" not in {s.queue for s in awa_sa.queue_stats(sync)}
    finally:
        await async_engine.dispose()


def test_a_listing_refuses_what_awa_pg_refuses(queue_storage: sa.Engine) -> None:
    with pytest.raises(awa_sa.ValidationError, match="unknown job state: done"):
        awa_sa.list_jobs(queue_storage, state="done")
    with pytest.raises(awa_sa.ValidationError, match="limit must be an int"):
        awa_sa.list_jobs(queue_storage, limit="5")  # type: ignore[arg-type]


def _plan(conn: sa.Connection, sql: str, params: dict[str, Any] | None) -> dict[str, Any]:
    explain = f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"
    found = conn.exec_driver_sql(explain, params).scalar_one()
    return dict((json.loads(found) if isinstance(found, str) else found)[0]["Plan"])


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _read_rows_by_index_only(plan: dict[str, Any], *, own: set[str]) -> int:
    """The jobs' rows were read by index: a sequential scan (beside the caller's own table)
    met at most the kit's one claim, never the thousands of jobs; the buffers the plan
    touched."""
    for node in _nodes(plan):
        if node["Node Type"] == "Seq Scan" and node["Relation Name"] not in own:
            met = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            assert met <= node["Actual Loops"], (node["Relation Name"], met)
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_a_lookup_by_id_reads_by_index_and_stays_flat(queue_storage: sa.Engine) -> None:
    """get_job's statement and the join of 100 orders, on queue storage at 1,000 and then
    4,000 jobs: the jobs' tables read by index, and no more buffers at the larger size."""
    text = compiled(read_job(plane="queue_storage"), queue_storage.dialect, "awa").sql
    lookup = text
    job = awa_sa.jobs_view("awa").subquery("job")
    orders = sa.table("orders", sa.column("id"), sa.column("job_id"))
    join = sa.select(orders.c.id, job.c.state).join(job, job.c.id == orders.c.job_id)
    join_sql = str(join.compile(queue_storage, compile_kwargs={"literal_binds": True}))
    touched = []
    with queue_storage.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id serial, job_id bigint)"))
    for size in (1000, 4000):
        with queue_storage.begin() as conn:
            ids = [
                j.id
                for j in awa_sa.enqueue_many(
                    conn, [{"n": n} for n in range(size // 2)], kind="bulk", queue="q"
                )
            ]
            ids += [
                j.id
                for j in awa_sa.enqueue_many(
                    conn, [{"n": n} for n in range(size // 2)], kind="bulk", queue="q2"
                )
            ]
            conn.execute(sa.text("TRUNCATE orders"))
            conn.execute(
                sa.text("INSERT INTO orders (job_id) SELECT unnest(:ids)"), {"ids": ids[:100]}
            )
            conn.execute(sa.text("ANALYZE"))
        with queue_storage.begin() as conn:
            asked = {"b_job_id": ids[10], "b_schema": "awa"}
            one = _read_rows_by_index_only(_plan(conn, lookup, asked), own=set())
            # At these sizes PostgreSQL rightly hashes 100 orders against a seq scan; the
            # join's index path, the one it takes as the tables grow, is read with that off.
            conn.exec_driver_sql("SET LOCAL enable_hashjoin = off")
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            many = _read_rows_by_index_only(_plan(conn, join_sql, None), own={"orders"})
            touched.append((one, many))
    (small_one, small_many), (large_one, large_many) = touched
    assert large_one <= small_one + 4, touched
    assert large_many <= small_many * 1.05, touched  # an index may gain a level meanwhile


async def _worker_completes(url: str, engine: sa.Engine, count: int) -> list[int]:
    """*count* jobs a real awa-pg worker completed (compact completions, as it writes them),
    the leader lock held so nothing rotates or prunes."""
    leader = await asyncio.to_thread(hold_leadership, engine)
    client = awa.AsyncClient(pg_url(url))

    async def done(job: Any) -> Any:
        return None

    client.task(dict, kind="done", queue="done_q")(done)
    try:
        await client.start([("done_q", 8)], poll_interval_ms=20, **STILL_RINGS)  # type: ignore[arg-type]
        jobs = await client.insert_many_copy(
            [{"n": n} for n in range(count)], kind="done", queue="done_q"
        )
        ids = [job.id for job in jobs]
        finished = sa.text(
            "SELECT (SELECT count(*) FROM awa.done_entries) + (SELECT coalesce(sum("
            "completed_count), 0) FROM awa.receipt_completion_batches)"
        )
        for _ in range(12_000):  # the worker's own pace, so polled
            with engine.connect() as conn:
                if conn.execute(finished).scalar_one() >= count:
                    return ids
            await asyncio.sleep(0.01)
        raise AssertionError(f"the worker did not complete {count} jobs")
    finally:
        await client.shutdown()
        await client.close()
        leader.close()


def test_a_completed_job_is_one_generic_index_read(queue_storage: sa.Engine) -> None:
    """On jobs a real worker completed, get_job is one prepared statement whose generic plan
    reads each table by index in the job's own partitions: every other partition of a table
    keyed by the job's ring slot is pruned when it runs; its answer is awa-pg's."""
    url = queue_storage.url.render_as_string(False)
    ids = asyncio.run(_worker_completes(url, queue_storage, 400))
    with queue_storage.begin() as conn:
        conn.execute(sa.text("ANALYZE"))
    text = compiled(read_job(plane="queue_storage"), queue_storage.dialect, "awa").sql
    text = text.replace("%(b_job_id)s", "$1").replace("%(b_schema)s", "$2")
    picks = ids[::20]
    with queue_storage.connect() as conn:
        conn.exec_driver_sql(f"PREPARE one_job (bigint, text) AS {text}")
        for job_id in picks[:10]:
            conn.exec_driver_sql(f"EXECUTE one_job ({job_id}, 'awa')").all()
        explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE one_job ({}, 'awa')"
        found = conn.exec_driver_sql(explain.format(picks[10])).scalar_one()
        plan = (json.loads(found) if isinstance(found, str) else found)[0]
        generic = conn.exec_driver_sql(
            "SELECT generic_plans FROM pg_prepared_statements WHERE name = 'one_job'"
        ).scalar_one()
        conn.rollback()
    assert generic > 0  # the server keeps one plan: no planning over every partition per call
    assert plan["Planning Time"] < 5, plan["Planning Time"]
    batches = 0
    for node in _nodes(plan["Plan"]):
        name = node.get("Relation Name", "")
        if node["Node Type"] == "Seq Scan" and node.get("Actual Loops", 0) > 0:
            met = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            if name.startswith("receipt_completion_batches_"):
                batches += met  # no index by job: the job's slot's batches, each tested
            else:  # a small partition the planner rightly scans (a slot's few closure
                # batches at this size), never a row per job
                assert met < len(ids) // 4, (name, met)
    with queue_storage.connect() as conn:
        in_slot = conn.exec_driver_sql("SELECT count(*) FROM awa.receipt_completion_batches")
        assert 0 < batches <= in_slot.scalar_one()
    theirs, _, _ = asyncio.run(_awa_pg_reads(url, picks))
    for job_id in picks:
        mine = awa_sa.get_job(queue_storage, job_id)
        same_as_awa_pg(mine, theirs[job_id])
        assert getattr(mine, "state", None) == "completed", job_id
