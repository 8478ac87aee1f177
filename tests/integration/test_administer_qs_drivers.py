"""The queue-storage administering statements through psycopg2 and pg8000, as through psycopg 3.

The verbs' queue-storage statements were compared with awa-pg's own writes on psycopg 3 and
asyncpg (test_administer_callbacks.py, test_administer_queue_storage.py); this runs them
through the other two sync drivers: the array binds, the schema translation and the rows read
back. One ``awa migrate`` clone, auto-finalized to queue storage in schema ``awa`` by the
testing kit's first claim; no runtime. For each driver, on a queue and kinds of its own, the
kit claims jobs (``queue_storage_attempt``) and ends them: two parked on a callback, their
receipts materialised into ``waiting_external`` leases by hand (the rows ``register_callback``
and ``WaitForCallback`` leave, but for ``attempt_state``); failed ones, settled by awa-sa as
the runtime fails them; and one failed whose lease then waits too (the state awa-pg's bulk
retry resumes); two more failed ones for the dead-letter queue. Then ``cancel_job`` and
``retry_job`` of the waits, ``retry_failed`` and ``discard_failed``, then the DLQ's bulk move,
``retry_from_dlq`` (scheduled for later) and ``bulk_retry_from_dlq``, last a ``drain_queue``
(its savepoint), in one caller's transaction per driver: the results and the rows read back
equal psycopg 3's, but for ids, clocks and the driver's names.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import cloned

import awa_sa
from awa_sa import Fail, JobRow, RetriedFailed, RunningAttempt
from awa_sa.testing import queue_storage_attempt
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
DRIVERS = ("psycopg2", "pg8000")
"""Beside psycopg 3, the reference."""
PARK = """
INSERT INTO awa.leases (lease_slot, lease_generation, ready_slot, ready_generation, job_id,
    queue, state, priority, attempt, run_lease, max_attempts, lane_seq, enqueue_shard,
    heartbeat_at, deadline_at, attempted_at, callback_id, callback_timeout_at)
SELECT ring.current_slot, ring.generation, c.ready_slot, c.ready_generation, c.job_id,
    c.queue, 'waiting_external', c.priority, c.attempt, c.run_lease, c.max_attempts,
    c.lane_seq, c.enqueue_shard, clock_timestamp(), NULL, c.claimed_at, gen_random_uuid(),
    clock_timestamp() + interval '1 hour'
FROM awa.lease_claims c, awa.lease_ring_state ring
WHERE c.job_id = :job_id AND c.run_lease = :run_lease AND ring.singleton;
UPDATE awa.lease_claims SET materialized_at = clock_timestamp()
WHERE job_id = :job_id AND run_lease = :run_lease
"""
READ_BACK = """
SELECT 'ready' AS at, kind, attempt, lane_seq FROM awa.ready_entries WHERE queue = :q
UNION ALL SELECT 'done ' || state::text, kind, attempt, NULL FROM awa.done_entries
    WHERE queue = :q
UNION ALL SELECT 'lease ' || state::text, NULL, attempt, NULL FROM awa.leases WHERE queue = :q
UNION ALL SELECT 'deferred ' || state::text, kind, attempt, NULL FROM awa.deferred_jobs
    WHERE queue = :q
ORDER BY 1, 2, 3, 4
"""


@pytest.fixture(scope="module")
def url(pg: EmbeddedPostgres, awa_databases: Databases, real_template: str) -> Iterator[str]:
    with cloned(pg, awa_databases, real_template) as found:
        yield found


def _seed(url: str, tag: str) -> dict[str, int]:
    """The jobs of *tag* (see the module's docstring), by role."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:

            def claimed(kind: str) -> RunningAttempt:
                return queue_storage_attempt(
                    conn, kind=f"{tag}_{kind}", queue=f"q_{tag}", tags=["t"], metadata={"m": 1}
                )

            def park(attempt: RunningAttempt) -> int:
                lease = {"job_id": attempt.job_id, "run_lease": attempt.run_lease}
                for sql in PARK.split(";"):
                    conn.execute(sa.text(sql), lease)
                return int(attempt.job_id)

            def fail(attempt: RunningAttempt) -> int:
                awa_sa.settle(conn, attempt, Fail("boom", terminal=True))
                return int(attempt.job_id)

            jobs = {"cancel": park(claimed("wait")), "retry": park(claimed("wait"))}
            jobs |= {"failed": fail(claimed("fail")), "failed2": fail(claimed("fail"))}
            resumed = claimed("fail")
            fail(resumed)
            jobs["resumed"] = park(resumed)
            jobs |= {"discard": fail(claimed("gone")), "discard2": fail(claimed("gone"))}
            jobs |= {"dead": fail(claimed("dead")), "dead2": fail(claimed("dead"))}
            return jobs
    finally:
        engine.dispose()


def _comparable(result: Any, tag: str) -> Any:
    """*result* without ids, clocks, error entries' clocks and the driver's tag."""
    if isinstance(result, RetriedFailed):
        return (
            [_comparable(j, tag) for j in result.jobs],
            result.matched,
            result.pruned_failed_count,
        )
    if isinstance(result, JobRow):
        return (
            result.kind.replace(tag, "T"),
            result.queue.replace(tag, "T"),
            result.state,
            result.attempt,
            result.priority,
            result.args,
            result.tags,
            result.metadata,
            [e["error"] for e in result.errors],
            result.storage,
        )
    return result


def _administered(url: str, driver: str, tag: str) -> tuple[list[Any], list[Any]]:
    """The four verbs through *driver* on *tag*'s jobs, in one caller's transaction; their
    results and the rows of *tag*'s queue read back through psycopg 3."""
    jobs = _seed(url, tag)
    own = sa.create_engine(sa.make_url(url).set(drivername=f"postgresql+{driver}"))
    try:
        with own.begin() as conn:
            got = [
                awa_sa.cancel_job(conn, jobs["cancel"]),
                awa_sa.retry_job(conn, jobs["retry"]),
                awa_sa.retry_failed(conn, kind=f"{tag}_fail"),
                awa_sa.discard_failed(conn, f"{tag}_gone"),
                awa_sa.bulk_move_failed_to_dlq(conn, kind=f"{tag}_dead"),
                awa_sa.retry_from_dlq(conn, jobs["dead"], run_at=LATER),
                awa_sa.bulk_retry_from_dlq(conn, kind=f"{tag}_dead"),
                awa_sa.drain_queue(conn, f"q_{tag}"),  # under a savepoint of its own
            ]
    finally:
        own.dispose()
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = [
                (at, None if kind is None else kind.replace(tag, "T"), attempt, seq)
                for at, kind, attempt, seq in conn.execute(sa.text(READ_BACK), {"q": f"q_{tag}"})
            ]
    finally:
        engine.dispose()
    return [_comparable(r, tag) for r in got], rows


@pytest.fixture(scope="module")
def reference(url: str) -> tuple[list[Any], list[Any]]:
    return _administered(url, "psycopg", "psycopg")


@pytest.mark.parametrize("driver", DRIVERS)
def test_queue_storage_verbs_through_the_driver_as_through_psycopg_3(
    url: str, reference: tuple[list[Any], list[Any]], driver: str
) -> None:
    got, rows = _administered(url, driver, driver)
    assert (got, rows) == reference
    cancelled, retried, bulk, discarded, dead, later, revived, drained = got
    assert (cancelled[2], retried[2], discarded) == ("cancelled", "available", 2)
    assert (len(bulk[0]), bulk[1]) == (3, 3)  # the two failed and the resumed wait
    assert ("lease waiting_external", None, 1, None) not in rows  # every wait ended
    assert ("done failed", "T_fail", 1, None) in rows  # the resumed job's failed row stays
    assert (dead, later[2], revived) == (2, "scheduled", 1)
    assert drained == 6  # the 4 retried, the 1 revived, the 1 scheduled
    assert ("done cancelled", "T_dead", 0, None) in rows  # the scheduled one, drained
    assert not [r for r in rows if r[0].startswith("deferred")]
