"""Which queue-storage receipts are running: every kind of closure evidence, one at a time.

The real runtimes (test_attempt_planes.py) show completion and retry closing receipts; here
each piece of evidence Awa's runtime honours is written alone, with SQL, beside an open receipt
of each shape (row-local in ``lease_claims``, compact in ``lease_claim_batches``), on the
fixture in ``mixed_transition``, and the listing must drop exactly the receipt it names. The
filters, the limit and the two lookup errors are checked across both planes on the same rows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import insert_job
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa_schema
from awa_sa import (
    CANONICAL,
    AmbiguousAttempt,
    AttemptNotFound,
    RunningAttempt,
    attempt_of,
    running_attempts,
)
from awa_sa.core.compiled import compile_statement, run
from awa_sa.settle.statements.job_receipts import OPEN_CLAIMS, claim_of_job, open_claims
from awa_sa.settle.statements.listings import Filters, filter_binds, queue_storage_attempts
from awa_sa.settle.statements.receipt_settles import SETTLE_RECEIPT, ReceiptItem, settle_receipt
from awa_sa.settle.statements.receipt_targets import SettleShape

QS = "awa_qs"


def ready(conn: sa.Connection, job_id: int, lane_seq: int, **values: Any) -> dt.datetime:
    """A job as enqueued (lane slot 0, generation 0); returns its created_at."""
    row = {"kind": "mail", "queue": "mail", "args": '{"n": 1}', "priority": 2, **values}
    created: dt.datetime = conn.execute(
        sa.text(
            f"INSERT INTO {QS}.ready_entries (ready_slot, ready_generation, job_id, kind, queue,"
            " args, priority, lane_seq) VALUES (0, 0, :job_id, :kind, :queue,"
            " CAST(:args AS jsonb), :priority, :lane_seq) RETURNING created_at"
        ),
        {"job_id": job_id, "lane_seq": lane_seq, **row},
    ).scalar_one()
    return created


def row_receipt(conn: sa.Connection, job_id: int, lane_seq: int, queue: str = "mail") -> int:
    """What a claim on a queue with a deadline writes; returns the receipt id."""
    return int(
        conn.execute(
            sa.text(
                f"INSERT INTO {QS}.lease_claims (claim_slot, job_id, run_lease, ready_slot,"
                " ready_generation, queue, priority, attempt, max_attempts, lane_seq,"
                " deadline_at) VALUES (0, :job_id, 1, 0, 0, :queue, 2, 1, 25, :lane_seq,"
                " now() + interval '5 minutes') RETURNING receipt_id"
            ),
            {"job_id": job_id, "lane_seq": lane_seq, "queue": queue},
        ).scalar_one()
    )


def compact_receipts(conn: sa.Connection, jobs: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """What a claim on a queue without a deadline writes; returns batch id and receipt ids."""
    receipts = [
        int(
            conn.execute(sa.text(f"SELECT nextval('{QS}.lease_claim_receipt_id_seq')")).scalar_one()
        )
        for _ in jobs
    ]
    batch = conn.execute(
        sa.text(
            f"INSERT INTO {QS}.lease_claim_batches (claim_slot, ready_slot, ready_generation,"
            " queue, priority, claimed_count, job_ids, run_leases, receipt_ids, receipt_ranges,"
            " lane_seqs, attempts, max_attempts) VALUES (0, 0, 0, 'mail', 2, :n, :jobs,"
            " :leases, :receipts, (SELECT range_agg(int8range(r, r + 1)) FROM unnest("
            " CAST(:receipts AS bigint[])) AS r), :lanes, CAST(:attempts AS smallint[]),"
            " CAST(:max AS smallint[])) RETURNING batch_id"
        ),
        {
            "n": len(jobs),
            "jobs": [j for j, _ in jobs],
            "leases": [1] * len(jobs),
            "receipts": receipts,
            "lanes": [lane for _, lane in jobs],
            "attempts": [1] * len(jobs),
            "max": [25] * len(jobs),
        },
    ).scalar_one()
    return int(batch), receipts


EVIDENCE: dict[str, str] = {
    "closure": f"INSERT INTO {QS}.lease_claim_closures (claim_slot, job_id, run_lease, outcome)"
    " VALUES (0, :job_id, 1, 'completed')",
    "closure batch": f"INSERT INTO {QS}.lease_claim_closure_batches (claim_slot, outcome,"
    " closed_count, receipt_ids, receipt_ranges) VALUES (0, 'completed', 1,"
    " ARRAY[CAST(:receipt AS bigint)], int8multirange(int8range(:receipt, :receipt + 1)))",
    "done entry": f"INSERT INTO {QS}.done_entries (ready_slot, ready_generation, job_id, kind,"
    " queue, priority, lane_seq) VALUES (0, 0, :job_id, 'mail', 'mail', 2, :lane_seq)",
    "deferred job": f"INSERT INTO {QS}.deferred_jobs (job_id, kind, queue, state, priority,"
    " attempt, run_lease, run_at) VALUES (:job_id, 'mail', 'mail', 'retryable', 2, 1, 1,"
    " now() + interval '1 minute')",
    "dlq entry": f"INSERT INTO {QS}.dlq_entries (job_id, kind, queue, priority, dlq_reason,"
    " original_run_lease) VALUES (:job_id, 'mail', 'mail', 2, 'operator', 1)",
    "lease waiting for its callback": f"INSERT INTO {QS}.leases (lease_slot, lease_generation,"
    " ready_slot, ready_generation, job_id, queue, state, priority, lane_seq)"
    " VALUES (0, 0, 0, 0, :job_id, 'mail', 'waiting_external', 2, :lane_seq)",
}


@pytest.fixture
def mixed(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", QS)
    return engine


def listed(engine: sa.Engine, **filters: Any) -> list[tuple[str, int]]:
    return [(a.storage, a.job_id) for a in running_attempts(engine, **filters)]


def without_clock(attempt: RunningAttempt) -> tuple[Any, ...]:
    """Every field but ``running_for``, which moves with the query's ``now()``."""
    return tuple(
        getattr(attempt, f) for f in RunningAttempt.__dataclass_fields__ if f != "running_for"
    )


def read_by_job(engine: sa.Engine, jobs: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """The attempts the full listing returns, read job by job: the statement that reads only
    the job's receipts must find exactly those."""
    everything = [without_clock(a) for a in running_attempts(engine)]
    by_job = [without_clock(a) for job_id in jobs for a in running_attempts(engine, job_id=job_id)]
    assert by_job == everything
    return by_job


def claimed(engine: sa.Engine, jobs: tuple[int, ...]) -> list[int]:
    """The jobs whose pair ``(job, 1)`` the bare-pair check finds open, asked one at a time and
    all at once (its two shapes), with no canonical row under any of them."""
    pairs = [SimpleNamespace(job_id=job_id, run_lease=1) for job_id in jobs]
    with engine.connect() as conn:
        alone = [run(conn, OPEN_CLAIMS, [pair], QS) for pair in pairs]
        together = run(conn, OPEN_CLAIMS, [*pairs, *pairs], QS)
    assert {k: v for found in alone for k, v in found.items()} == together
    assert not any(together.values())
    return sorted(job_id for job_id, _ in together)


@pytest.mark.parametrize("shape", ["row", "compact"])
@pytest.mark.parametrize("evidence", sorted(EVIDENCE))
def test_each_kind_of_closure_evidence_ends_exactly_its_receipt(
    mixed: sa.Engine, shape: str, evidence: str
) -> None:
    with mixed.begin() as conn:
        for job_id in (1, 2):
            ready(conn, job_id, lane_seq=job_id)
        if shape == "row":
            receipt = {job_id: row_receipt(conn, job_id, job_id) for job_id in (1, 2)}
        else:
            _, ids = compact_receipts(conn, [(1, 1), (2, 2)])
            receipt = dict(zip((1, 2), ids, strict=True))
    assert listed(mixed) == [(QS, 1), (QS, 2)]
    assert len(read_by_job(mixed, (1, 2))) == 2
    assert claimed(mixed, (1, 2, 3)) == [1, 2]
    with mixed.begin() as conn:
        conn.execute(
            sa.text(EVIDENCE[evidence]), {"job_id": 1, "lane_seq": 1, "receipt": receipt[1]}
        )
    assert listed(mixed) == [(QS, 2)]
    assert len(read_by_job(mixed, (1, 2))) == 1
    assert claimed(mixed, (1, 2, 3)) == [2]


def test_a_closed_at_ends_a_row_receipt(mixed: sa.Engine) -> None:
    with mixed.begin() as conn:
        ready(conn, 1, 1)
        row_receipt(conn, 1, 1)
        conn.execute(sa.text(f"UPDATE {QS}.lease_claims SET closed_at = now()"))
    assert listed(mixed) == []
    assert claimed(mixed, (1,)) == []


def test_a_running_lease_is_listed_once_with_its_receipt(mixed: sa.Engine) -> None:
    """``register_callback`` materialises the claim: listed from ``leases``, not twice."""
    with mixed.begin() as conn:
        ready(conn, 1, 1)
        receipt = row_receipt(conn, 1, 1)
        conn.execute(
            sa.text(
                f"INSERT INTO {QS}.leases (lease_slot, lease_generation, ready_slot,"
                " ready_generation, job_id, queue, state, priority, lane_seq, attempted_at,"
                " heartbeat_at, deadline_at, callback_id) VALUES (0, 0, 0, 0, 1, 'mail',"
                " 'running', 2, 1, now() - interval '1 minute', now(),"
                " now() + interval '4 minutes', gen_random_uuid())"
            )
        )
        conn.execute(sa.text(f"UPDATE {QS}.lease_claims SET materialized_at = now()"))
    [attempt] = running_attempts(mixed)
    assert (attempt.storage, attempt.job_id, attempt.receipt_id) == (QS, 1, receipt)
    assert attempt.running_for >= dt.timedelta(minutes=1)
    assert read_by_job(mixed, (1,)) == [without_clock(attempt)]
    assert claimed(mixed, (1,)) == [1]


def test_a_heartbeat_in_attempt_state_is_the_receipts_heartbeat(mixed: sa.Engine) -> None:
    with mixed.begin() as conn:
        ready(conn, 1, 1)
        row_receipt(conn, 1, 1)
        beat = conn.execute(
            sa.text(
                f"INSERT INTO {QS}.attempt_state (job_id, run_lease, heartbeat_at)"
                " VALUES (1, 1, now() + interval '1 second') RETURNING heartbeat_at"
            )
        ).scalar_one()
    [attempt] = running_attempts(mixed)
    assert attempt.heartbeat_at == beat != attempt.attempted_at
    assert read_by_job(mixed, (1,)) == [without_clock(attempt)]


@pytest.fixture
def both(mixed: sa.Engine) -> dict[str, Any]:
    """Canonical job 1 and queue-storage job 1, both attempt 1 lease 1, plus one of each more."""
    with mixed.begin() as conn:
        insert_job(conn, kind="mail", queue="mail")  # canonical id 1
        insert_job(conn, kind="report", queue="batch")  # canonical id 2
        created = ready(conn, 1, 1)
        row_receipt(conn, 1, 1)
        ready(conn, 7, 1, kind="report", queue="batch")
        row_receipt(conn, 7, 1, queue="batch")
        hot = conn.execute(sa.text("SELECT created_at FROM awa.jobs_hot WHERE id = 1")).scalar()
    return {"engine": mixed, "qs_created": created, "hot_created": hot}


def test_filters_apply_to_both_planes(both: dict[str, Any]) -> None:
    engine: sa.Engine = both["engine"]
    assert sorted(listed(engine)) == sorted([(CANONICAL, 1), (CANONICAL, 2), (QS, 1), (QS, 7)])
    assert sorted(listed(engine, job_id=1, attempt=1)) == sorted([(CANONICAL, 1), (QS, 1)])
    assert sorted(listed(engine, queue="batch")) == sorted([(CANONICAL, 2), (QS, 7)])
    assert sorted(listed(engine, kind="report")) == sorted([(CANONICAL, 2), (QS, 7)])
    assert listed(engine, attempt=2) == []
    assert listed(engine, running_for=dt.timedelta(hours=1)) == []
    every = running_attempts(engine)
    assert [(a.attempted_at, a.job_id) for a in every] == sorted(
        (a.attempted_at, a.job_id) for a in every
    )
    assert [(a.storage, a.job_id) for a in running_attempts(engine, limit=3)] == [
        (a.storage, a.job_id) for a in every[:3]
    ]


def _job(attempt: RunningAttempt, created_at: Any) -> SimpleNamespace:
    """A handler's job as awa-pg hands it over: what ``attempt_of`` reads."""
    return SimpleNamespace(
        id=attempt.job_id,
        attempt=attempt.attempt,
        kind=attempt.kind,
        queue=attempt.queue,
        created_at=created_at,
    )


def test_attempt_of_tells_the_colliding_jobs_apart_by_created_at(both: dict[str, Any]) -> None:
    engine: sa.Engine = both["engine"]
    canonical, queued = sorted(
        running_attempts(engine, job_id=1, attempt=1), key=lambda a: a.on_queue_storage
    )
    for created_at in (both["hot_created"], both["hot_created"].isoformat()):
        found = attempt_of(engine, _job(canonical, created_at))
        assert (found.storage, found.job_id, found.created_at) == (
            CANONICAL,
            1,
            both["hot_created"],
        )
    found = attempt_of(engine, _job(queued, both["qs_created"].isoformat()))
    assert (found.storage, found.job_id, found.created_at) == (QS, 1, both["qs_created"])
    later = both["qs_created"] + dt.timedelta(microseconds=1)
    with pytest.raises(AttemptNotFound) as missing:
        attempt_of(engine, _job(queued, later))
    assert (missing.value.job_id, missing.value.attempt) == (1, 1)


def test_two_planes_matching_on_everything_are_ambiguous(mixed: sa.Engine) -> None:
    with mixed.begin() as conn:
        insert_job(conn, kind="mail", queue="mail")
        created = conn.execute(sa.text("SELECT created_at FROM awa.jobs_hot")).scalar_one()
        ready(conn, 1, 1)
        conn.execute(sa.text(f"UPDATE {QS}.ready_entries SET created_at = :c"), {"c": created})
        row_receipt(conn, 1, 1)
    job = SimpleNamespace(id=1, attempt=1, kind="mail", queue="mail", created_at=created)
    with pytest.raises(AmbiguousAttempt) as ambiguous:
        attempt_of(mixed, job)
    candidates = ambiguous.value.candidates
    assert {a.storage for a in candidates if isinstance(a, RunningAttempt)} == {CANONICAL, QS}


@pytest.mark.parametrize(("phase", "round_trips"), [("canonical", 1), ("mixed_transition", 3)])
def test_round_trips(engine: sa.Engine, phase: str, round_trips: int) -> None:
    """One statement while routing is canonical (no receipt can exist), two once it is not,
    and the Engine's unfiltered listing turns JIT off in its own transaction first."""
    statements: list[str] = []
    with engine.begin() as conn:
        insert_job(conn)
        awa_sa_schema.set_phase(conn, phase, QS)
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    [attempt] = running_attempts(engine)
    assert attempt.storage == CANONICAL
    assert len(statements) == round_trips, statements
    assert ("lease_claims" in statements[-1]) is (round_trips == 3)
    assert ("SET LOCAL jit = off" in statements) is (round_trips == 3)


@pytest.mark.parametrize("driver", ["psycopg2", "pg8000", "asyncpg", "psycopg-async"])
def test_both_planes_on_every_driver(both: dict[str, Any], driver: str) -> None:
    """The same listing and lookup on every supported driver, async ones through run_sync."""
    engine: sa.Engine = both["engine"]
    queued = _job(
        next(a for a in running_attempts(engine, job_id=1) if a.on_queue_storage),
        both["qs_created"],
    )
    name = driver.removesuffix("-async")
    url = engine.url.set(drivername=f"postgresql+{name}")

    def read(conn: sa.Connection) -> tuple[list[tuple[str, int]], RunningAttempt]:
        found = running_attempts(conn, job_id=1, attempt=1)
        return sorted((a.storage, a.job_id) for a in found), attempt_of(conn, queued)

    if name in ("asyncpg", "psycopg"):

        async def run() -> tuple[list[tuple[str, int]], RunningAttempt]:
            async_engine = create_async_engine(url, poolclass=sa.NullPool)
            try:
                async with async_engine.connect() as conn:
                    return await conn.run_sync(read)
            finally:
                await async_engine.dispose()

        listed_pairs, found = asyncio.run(run())
    else:
        sync_engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with sync_engine.connect() as conn:
                listed_pairs, found = read(conn)
        finally:
            sync_engine.dispose()
    assert listed_pairs == sorted([(CANONICAL, 1), (QS, 1)])
    assert (found.storage, found.job_id, found.created_at) == (QS, 1, both["qs_created"])


def test_one_jobs_reads_are_estimated_under_the_jit_threshold(mixed: sa.Engine) -> None:
    """On a new cluster (empty tables, never analysed: the planner's default guesses), the
    bare-pair check, alone and in a batch, and ``attempt_of``'s read cost less than
    PostgreSQL's default ``jit_above_cost`` by its estimate, so a server with JIT on (also the
    default) does not compile them. A batch that read every receipt was estimated at some
    219,000 on an ``awa migrate`` cluster and spent 60-115 ms compiling. The listing of every
    receipt is over the threshold here, which shows the guesses are the ones that make JIT
    happen (that listing turns JIT off in its Engine form)."""
    by_job = queue_storage_attempts(by_job=True)
    shapes: dict[str, tuple[Any, dict[str, Any]]] = {
        "one pair": (open_claims(batch=False), {"guard_id": 1, "guard_lease": 1}),
        "pairs": (open_claims(batch=True), {"guard_id": [1, 2], "guard_lease": [1, 1]}),
        "attempt_of": (by_job, filter_binds(Filters(job_id=1))),
        "every receipt": (queue_storage_attempts(by_job=False), filter_binds(Filters())),
    }
    threshold = 100_000  # jit_above_cost's default
    with mixed.connect() as conn:
        costs = {}
        for name, (statement, binds) in shapes.items():
            text = compile_statement(statement, conn.dialect, QS)
            [[plan]] = conn.exec_driver_sql(
                f"EXPLAIN (FORMAT JSON) {text.sql}", {**text.defaults, **binds}
            ).all()
            costs[name] = plan[0]["Plan"]["Total Cost"]
    assert max(costs[n] for n in ("one pair", "pairs", "attempt_of")) < threshold, costs
    assert costs["every receipt"] > threshold, costs


def _lookup_plan(conn: sa.Connection, job: SimpleNamespace) -> dict[str, Any]:
    """``attempt_of``'s lookup as PostgreSQL runs it, generic plan (what a pooled connection
    keeps), for *job*: its root node."""
    text = compile_statement(claim_of_job(), conn.dialect, QS)
    binds = {
        "b_job_id": job.id,
        "b_attempt": job.attempt,
        "b_queue": job.queue,
        "b_kind": job.kind,
        "b_created_at": job.created_at,
    }
    conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
    [[plan]] = conn.exec_driver_sql(
        f"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) {text.sql}", binds
    ).all()
    root: dict[str, Any] = plan[0]["Plan"]
    return root


def _scanned(node: dict[str, Any]) -> list[tuple[str, int]]:
    """Every relation a plan node (and its children) reads, with the rows its scans filtered
    out, counting only the nodes that ran."""
    found = []
    if "Relation Name" in node and node.get("Actual Loops", 0) > 0:
        found.append((node["Relation Name"], int(node.get("Rows Removed by Filter", 0))))
    for child in node.get("Plans", []):
        found += _scanned(child)
    return found


def test_attempt_of_reads_only_its_receipts_partitions_flat_with_history(mixed: sa.Engine) -> None:
    """``attempt_of``'s lookup on queue storage (``claim_of_job``) reads one partition of each
    evidence table and of ``ready_entries`` (the receipt's slots, pruned as it runs) and no row
    of another job's, however many finished receipts the schema holds."""
    with mixed.begin() as conn:
        created = ready(conn, 1, 1)
        row_receipt(conn, 1, 1)
    job = SimpleNamespace(id=1, attempt=1, kind="mail", queue="mail", created_at=created)
    found = attempt_of(mixed, job)
    assert (found.storage, found.job_id, found._ready_slot) == (QS, 1, 0)
    [listed_] = running_attempts(mixed, job_id=1)
    clock = dt.timedelta(0)
    assert replace(found, running_for=clock) == replace(listed_, running_for=clock)
    plans = []
    for history in (0, 300):
        with mixed.begin() as conn:
            for job_id in range(2 + history - 300 * (history > 0), 2 + history):
                ready(conn, job_id, job_id)
                receipt = row_receipt(conn, job_id, job_id)
                conn.execute(
                    sa.text(EVIDENCE["closure"] if job_id % 2 else EVIDENCE["closure batch"]),
                    {"job_id": job_id, "lane_seq": job_id, "receipt": receipt},
                )
            conn.exec_driver_sql(f"ANALYZE {QS}.lease_claims")
        with mixed.begin() as conn:
            plans.append(_scanned(_lookup_plan(conn, job)))
        assert attempt_of(mixed, job).receipt_id == found.receipt_id
    before, after = plans
    assert sorted(name for name, _ in before) == sorted(name for name, _ in after)
    assert all(removed == 0 for _, removed in after), after
    # the job's claims in each claim slot, and one partition each of the rest
    read = [name for name, _ in after]
    assert len([n for n in read if not n.startswith("lease_claims_")]) <= 4, read
    assert {n.rstrip("0123456789").rstrip("_") for n in read} <= {
        "lease_claims",
        "ready_entries",
        "lease_claim_closures",
        "lease_claim_closure_batches",
        "attempt_state",
    }, read


def _relations(node: dict[str, Any]) -> list[str]:
    found = [node["Relation Name"]] if "Relation Name" in node else []
    for child in node.get("Plans", []):
        found += _relations(child)
    return found


@pytest.mark.parametrize("shape", ["row", "row_in_slot"])
def test_the_settle_reads_only_the_asked_slots(mixed: sa.Engine, shape: SettleShape) -> None:
    """The settle of a ``lease_claims`` receipt names its claim slot (and, as ``attempt_of``
    found it, its ready slot) as parameters PostgreSQL prunes by: of each table partitioned by
    the claim slot only that slot's partition is planned, ``leases`` is probed once, and with
    the ready slot known so is each table partitioned by it."""
    item = ReceiptItem(
        1,
        1,
        3,
        1,
        None,
        None,
        "complete",
        None,
        None,
        None,
        None,
        "mail",
        "mail",
        1,
        5 if shape == "row_in_slot" else None,
    )
    text = compile_statement(settle_receipt(shape=shape), mixed.dialect, QS)
    with mixed.begin() as conn:
        [[plan]] = conn.exec_driver_sql(
            f"EXPLAIN (FORMAT JSON) {text.sql}", text.params(SETTLE_RECEIPT.binds(item))
        ).all()
    # partitions only: an INSERT names its partitioned parent, and routes each row itself
    read = [n for n in _relations(plan[0]["Plan"]) if n[-1].isdigit()]
    by_claim = [n for n in read if n.startswith(("lease_claims_", "lease_claim_closure"))]
    assert by_claim, read
    assert all(n.endswith("_3") for n in by_claim), read
    assert len([n for n in read if n.startswith("leases_")]) == 8, read  # once
    assert not any(n.startswith("lease_claim_batches") for n in read), read
    by_ready = [n for n in read if n.startswith(("ready_entries_", "done_entries_", "ready_claim"))]
    if shape == "row_in_slot":
        assert by_ready, read
        assert all(n.endswith("_5") for n in by_ready), read
    else:
        assert len(by_ready) > 16, read
