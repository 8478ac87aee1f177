"""Part ``reads``: a job read by id, and 100 orders joined with their jobs, on queue storage.

One database of its own with queue storage active (``awa migrate``, flipped by the awa CLI, as
:mod:`bench.enqueue` builds it), holding *size* terminal jobs: enqueued by awa-pg 0.6.9's
``insert_many_copy`` and completed by one real awa-pg worker (its handler returns at once), a
session holding the maintenance-leader lock meanwhile so no ring rotates and nothing is pruned
(a live cluster keeps its finished jobs for a while too: docs/reading.md), then ``ANALYZE``.
A table ``orders`` of 100 rows names 100 of those jobs.

Measured, on ids spread over the whole range:

* awa-sa's ``get_job(engine, id)`` (Engine form: one statement, routing read inside it);
* its statement alone, prepared as psycopg 3 prepares it (the generic plan the server keeps),
  and the join of the 100 orders with ``jobs_view``'s selectable:
  ``EXPLAIN (ANALYZE, BUFFERS)`` for the server's planning and execution time, the buffers
  read, and whether any table of jobs was scanned rather than read by index;
* awa-pg's ``Client.get_job(id)`` (sync client), its statements and their server time
  (``pg_stat_statements``);
* ``SELECT id, state FROM awa.jobs WHERE id = ...``, the view a user would reach for.

Every call's wall time is the median over its calls; ``EXPLAIN`` runs after a warm-up.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import awa
import sqlalchemy as sa

import awa_sa
from awa_sa.core.compiled import compiled
from awa_sa.read.statements.lookups import read_job
from awa_sa.testing.server import EmbeddedPostgres
from bench.enqueue import databases
from bench.workload import server_statements

PLANES = {"canonical": "reads_canonical", "queue storage": "reads"}
SCHEMA = "awa_qs"
KIND = "bench_read"
QUEUE = "bench_reads"
WORKERS = 32
CHUNK = 10_000
"""Jobs per ``insert_many_copy``."""
LEADER_LOCK = 0x4157_415F_4D41_494E
"""Awa's maintenance-leader advisory lock key: held, no ring rotates and nothing is pruned."""
STILL = 3_600_000
JOB_TABLES = (
    "ready_entries",
    "done_entries",
    "deferred_jobs",
    "dlq_entries",
    "leases",
    "lease_claims",
    "lease_claim_batches",
    "receipt_completion_batches",
    "jobs_hot",
    "scheduled_jobs",
)


def run(server: EmbeddedPostgres, cluster: str, size: int, calls: int) -> dict[str, Any]:
    """The part: the database made, then every measurement."""
    if cluster != "awa":
        raise SystemExit("part reads needs the awa CLI (awa migrate) and a real awa-pg worker")
    url = databases(server, cluster, PLANES)["queue storage"]
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:  # the server tracks nothing (bench.server_cost); this does
        for setting in ("track = top", "track_planning = on"):
            conn.execute(
                sa.text(
                    f'ALTER DATABASE "{PLANES["queue storage"]}" SET pg_stat_statements.{setting}'
                )
            )
    admin.dispose()
    ids = asyncio.run(_completed(url, size))
    engine = sa.create_engine(url, pool_size=2)
    try:
        _orders(engine, ids)
        picks = random.Random(7).sample(ids, min(calls, len(ids)))
        few = picks[: max(3, calls // 40)]
        result: dict[str, Any] = {"size": size, "calls": len(picks)}
        reading: Callable[[int], Any] = lambda i: awa_sa.get_job(engine, i)  # noqa: E731
        result["awa_sa_get_job"] = _wall(reading, picks) | _server_cost(engine, reading, picks[0])
        lookup = compiled(read_job(plane="queue_storage"), engine.dialect, SCHEMA).sql
        result["lookup_plan"] = _explained_prepared(engine, lookup, picks)
        result["join_plan"] = _explained(engine, _join_sql(engine), None, picks)
        client = awa.Client(sa.make_url(url).set(drivername="postgresql").render_as_string(False))
        try:
            result["awa_pg_get_job"] = _wall(client.get_job, few)
            result["awa_pg_get_job"] |= _server_cost(engine, client.get_job, few[0])
        finally:
            client.close()
        view = sa.text("SELECT id, state FROM awa.jobs WHERE id = :id")
        result["awa_jobs_view"] = _wall(lambda i: _one(engine, view, i), few[:3])
        result["awa_jobs_plan"] = _explained(
            engine, "SELECT id, state FROM awa.jobs WHERE id = %(id)s", {"id": few[0]}, few[:1]
        )
        return result
    finally:
        engine.dispose()


async def _completed(url: str, size: int) -> list[int]:
    """*size* jobs completed by a real awa-pg worker, the leader lock held throughout."""
    client = awa.AsyncClient(sa.make_url(url).set(drivername="postgresql").render_as_string(False))
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    leader = engine.connect()
    assert leader.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK}).scalar()
    leader.commit()

    async def done(job: Any) -> Any:
        return None

    client.task(dict, kind=KIND, queue=QUEUE)(done)
    ids: list[int] = []
    try:
        await client.start(
            [(QUEUE, WORKERS)],
            queue_storage_schema=SCHEMA,
            queue_storage_queue_rotate_interval_ms=STILL,
            queue_storage_lease_rotate_interval_ms=STILL,
            queue_storage_claim_rotate_interval_ms=STILL,
        )
        for first in range(0, size, CHUNK):
            jobs = [{"n": n} for n in range(first, min(size, first + CHUNK))]
            ids += [j.id for j in await client.insert_many_copy(jobs, kind=KIND, queue=QUEUE)]
        count = sa.text(f"SELECT count(*) FROM {SCHEMA}.done_entries")
        finished = sa.text(
            "SELECT count(*) FROM (SELECT unnest(job_ids)"
            f" FROM {SCHEMA}.receipt_completion_batches) AS item"
        )
        deadline = time.monotonic() + 120 + size / 200
        while True:
            with engine.connect() as conn:
                if conn.execute(count).scalar_one() + conn.execute(finished).scalar_one() >= size:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not complete {size} jobs")
            await asyncio.sleep(0.2)  # the worker's own pace
    finally:
        await client.shutdown()
        await client.close()
        leader.close()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()
    return ids


def _orders(engine: sa.Engine, ids: list[int]) -> None:
    chosen = random.Random(11).sample(ids, 100)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id serial PRIMARY KEY, job_id bigint)"))
        conn.execute(sa.text("INSERT INTO orders (job_id) SELECT unnest(:ids)"), {"ids": chosen})
        conn.execute(sa.text("ANALYZE orders"))


def _join_sql(engine: sa.Engine) -> str:
    job = awa_sa.jobs_view(SCHEMA).subquery("job")
    orders = sa.table("orders", sa.column("id"), sa.column("job_id"))
    join = sa.select(orders.c.id, job.c.state).join(job, job.c.id == orders.c.job_id)
    return str(join.compile(engine, compile_kwargs={"literal_binds": True}))


def _one(engine: sa.Engine, query: sa.TextClause, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(query, {"id": job_id}).one()


def _wall(call: Callable[[int], Any], ids: list[int]) -> dict[str, Any]:
    call(ids[0])  # the connection opened, the statement compiled: outside the clock
    took = []
    for job_id in ids:
        start = time.perf_counter()
        call(job_id)
        took.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(took) * 1000, "calls": len(ids)}


def _server_cost(engine: sa.Engine, call: Callable[[int], Any], job_id: int) -> dict[str, Any]:
    """The statements one call sent (transaction control left out) and the server's planning
    and execution time of them."""
    admin = sa.create_engine(engine.url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        server_statements(admin, reset=True)
        call(job_id)
        with admin.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT coalesce(sum(calls), 0),"
                    " coalesce(sum(total_exec_time + total_plan_time), 0)"
                    " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                    " AND query NOT LIKE '%pg_stat_statements%'"
                    " AND upper(query) NOT IN ('BEGIN', 'COMMIT', 'ROLLBACK')"
                )
            ).one()
        return {"statements": int(row[0]), "server_ms": float(row[1])}
    finally:
        admin.dispose()


def _explained(
    engine: sa.Engine, sql: str, params: dict[str, Any] | None, warm: list[int]
) -> dict[str, Any]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of *sql* after a warm-up: server time, buffers, scans."""
    with engine.connect() as conn:
        for job_id in warm[:5]:
            conn.exec_driver_sql(sql, params and {next(iter(params)): job_id}).all()
        found = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", params
        ).scalar_one()
        conn.rollback()
    plan = (json.loads(found) if isinstance(found, str) else found)[0]
    top = plan["Plan"]
    scanned = _scanned(top)
    return {
        "planning_ms": plan["Planning Time"],
        "execution_ms": plan["Execution Time"],
        "buffers": int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"]),
        "seq_scans_of_jobs": scanned,
        "function_scans": sorted(
            {n.get("Function Name", "") for n in _nodes(top) if n["Node Type"] == "Function Scan"}
        ),
    }


def _explained_prepared(engine: sa.Engine, sql: str, ids: list[int]) -> dict[str, Any]:
    """get_job's statement as its calls run it: prepared (psycopg 3 prepares on the sixth
    execution), its plan the server's generic one once five custom plans cost no less, then
    ``EXPLAIN (ANALYZE, BUFFERS) EXECUTE``, the median of 20 by server time."""
    text = sql.replace("%(b_job_id)s", "$1").replace("%(b_schema)s", "$2")
    with engine.connect() as conn:
        conn.exec_driver_sql(f"PREPARE bench_read_job (bigint, text) AS {text}")
        for job_id in ids[:10]:
            conn.exec_driver_sql(f"EXECUTE bench_read_job ({int(job_id)}, '{SCHEMA}')").all()
        plans = []
        for job_id in ids[10:30]:
            found = conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)"
                f" EXECUTE bench_read_job ({int(job_id)}, '{SCHEMA}')"
            ).scalar_one()
            plans.append((json.loads(found) if isinstance(found, str) else found)[0])
        generic = conn.exec_driver_sql(
            "SELECT generic_plans FROM pg_prepared_statements WHERE name = 'bench_read_job'"
        ).scalar_one()
        conn.rollback()
    plans.sort(key=lambda p: p["Planning Time"] + p["Execution Time"])
    plan = plans[len(plans) // 2]
    top = plan["Plan"]
    return {
        "planning_ms": plan["Planning Time"],
        "execution_ms": plan["Execution Time"],
        "buffers": int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"]),
        "seq_scans_of_jobs": _scanned(top),
        "generic": int(generic) > 0,
    }


def _scanned(top: dict[str, Any]) -> list[str]:
    return sorted(
        {
            f"{node['Relation Name']} ({_met(node)})"
            for node in _nodes(top)
            if node["Node Type"] == "Seq Scan"
            and _is_job_table(node["Relation Name"])
            and _met(node) > 0  # an empty partition's scan reads nothing
        }
    )


def _met(node: dict[str, Any]) -> int:
    return int(node["Actual Rows"]) + int(node.get("Rows Removed by Filter", 0))


def _is_job_table(name: str) -> bool:
    return any(name == t or name.startswith(f"{t}_") for t in JOB_TABLES)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def summary(result: dict[str, Any]) -> str:
    """The part's report: each read's time, and the plans' server time, buffers and scans."""
    lines = [
        f"reads: queue storage, {result['size']} completed jobs, ids spread over all of them"
        f" (wall time: median of the calls)"
    ]
    sa_call, pg_call = result["awa_sa_get_job"], result["awa_pg_get_job"]
    view = result["awa_jobs_view"]
    lines.append(
        f"  awa-sa get_job (Engine)   {sa_call['median_ms']:9.3f} ms wall"
        f"  {sa_call['statements']} statements, {sa_call['server_ms']:.3f} ms server"
        f" (planning and execution)  ({sa_call['calls']} calls)"
    )
    lines.append(
        f"  awa-pg get_job            {pg_call['median_ms']:9.3f} ms wall"
        f"  {pg_call['statements']} statements, {pg_call['server_ms']:.3f} ms server"
        f" (planning and execution)  ({pg_call['calls']} calls)"
    )
    lines.append(
        f"  awa.jobs WHERE id = ...   {view['median_ms']:9.3f} ms wall  ({view['calls']} calls)"
    )
    lines.append(f"  awa-pg / awa-sa get_job   {pg_call['median_ms'] / sa_call['median_ms']:9.1f}x")
    for name, label in (
        ("lookup_plan", "get_job (prepared)"),
        ("join_plan", "100 orders join jobs"),
        ("awa_jobs_plan", "awa.jobs WHERE id"),
    ):
        p = result[name]
        lines.append(
            f"  EXPLAIN {label:21} planning {p['planning_ms']:8.3f} ms  execution"
            f" {p['execution_ms']:9.3f} ms  buffers {p['buffers']:7}  seq scans of jobs:"
            f" {', '.join(p['seq_scans_of_jobs']) or 'none'}"
        )
    return "\n".join(lines)
