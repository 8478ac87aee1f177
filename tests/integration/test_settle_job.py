"""``settle`` given the awa-pg ``Job``: two statements, the rows of the attempt's own settle.

On the fixture cluster routed to queue storage in ``awa`` (and on the canonical plane), a job
settled by its ``Job`` writes what the same settle of the attempt ``attempt_of`` returns writes,
in two statements, the receipt's lock taken by the first; a second settle is ``Stale``, and a
bad result is refused before any statement. The merged lock is raced with a held one: a settle
that commits while the job's settle waits in its lookup leaves it ``Stale``, its rows gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from racing import held, in_thread, wait_until_blocked
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import Complete, Completed, Fail, Stale, ValidationError, attempt_of, settle
from awa_sa.testing import job_of, queue_storage_attempt, running_attempt

ROWS = "CREATE TABLE IF NOT EXISTS svc_rows (job_id bigint)"


@contextmanager
def sent(engine: sa.Engine) -> Iterator[list[str]]:
    texts: list[str] = []

    def seen(*args: Any) -> None:
        texts.append(args[2])

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield texts
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)


def receipt_rows(conn: sa.Connection, job_id: int) -> dict[str, Any]:
    """What a settle writes for *job_id*, its own clock and ids left out."""
    return {
        "closures": conn.execute(
            sa.text("SELECT outcome FROM awa.lease_claim_closures WHERE job_id = :j"), {"j": job_id}
        ).all(),
        "closure batches": conn.execute(
            sa.text(
                "SELECT outcome, closed_count FROM awa.lease_claim_closure_batches "
                "WHERE :r = ANY(receipt_ids)"
            ),
            {"r": receipt_id(conn, job_id)},
        ).all(),
        "completions": conn.execute(
            sa.text(
                "SELECT completed_count, attempts FROM awa.receipt_completion_batches "
                "WHERE :j = ANY(job_ids)"
            ),
            {"j": job_id},
        ).all(),
        "done": conn.execute(
            sa.text("SELECT state FROM awa.done_entries WHERE job_id = :j"), {"j": job_id}
        ).all(),
        "open": conn.execute(
            sa.text("SELECT closed_at IS NULL FROM awa.lease_claims WHERE job_id = :j"),
            {"j": job_id},
        ).all(),
        "attempt state": conn.execute(
            sa.text("SELECT 1 FROM awa.attempt_state WHERE job_id = :j"), {"j": job_id}
        ).all(),
    }


def receipt_id(conn: sa.Connection, job_id: int) -> int:
    return int(
        conn.execute(
            sa.text("SELECT receipt_id FROM awa.lease_claims WHERE job_id = :j"), {"j": job_id}
        ).scalar_one()
    )


def test_a_job_settles_as_its_attempt_does_in_two_statements(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(ROWS))
        by_attempt = queue_storage_attempt(conn, kind="k")
        by_job = queue_storage_attempt(conn, kind="k")
    with engine.begin() as conn:
        assert settle(conn, attempt_of(conn, job_of(by_attempt)), Complete()) == Completed(
            by_attempt.job_id
        )
    with sent(engine) as texts, engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO svc_rows VALUES (:j)"), {"j": by_job.job_id})
        texts.clear()
        assert settle(conn, job_of(by_job), Complete()) == Completed(by_job.job_id)
        settled = list(texts)
        mode = conn.execute(sa.text("SELECT current_setting('plan_cache_mode')")).scalar_one()
    assert len(settled) == 2
    assert "pg_advisory_xact_lock" in settled[0]
    assert mode == "auto"  # the settle put the caller's plan mode back
    with engine.connect() as conn:
        assert receipt_rows(conn, by_job.job_id) == receipt_rows(conn, by_attempt.job_id)
    assert settle(engine, job_of(by_job), Complete()) == Stale()  # nothing running any more


def test_a_bad_result_is_refused_before_any_statement(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        mine = queue_storage_attempt(conn)
    with sent(engine) as texts, pytest.raises(ValidationError):
        settle(engine, job_of(mine), "complete")  # type: ignore[arg-type]
    assert texts == []
    with pytest.raises(ValidationError):
        settle(engine, object(), Complete())  # type: ignore[arg-type]


def test_a_canonical_job_ends_named_in_two_statements(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        job_id, _ = running_attempt(conn, kind="k")
    (mine,) = awa_sa.running_attempts(engine, job_id=job_id)
    with sent(engine) as texts:
        assert settle(engine, job_of(mine), Fail("no", terminal=True)) == awa_sa.Failed(
            job_id, terminal=True
        )
    assert len(texts) == 2
    with engine.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state::text FROM awa.jobs_hot WHERE id = :j"), {"j": job_id}
        ).scalar_one()
    assert state == "failed"


def test_a_settle_committed_while_the_lookup_waits_leaves_the_job_stale(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(ROWS))
        mine = queue_storage_attempt(conn, kind="k")
    job = job_of(mine)
    with held(engine) as other:
        # The other settle takes the receipt's lock first (the runtime's, or another receiver's).
        assert settle(other.conn, mine, Complete()) == Completed(mine.job_id)

        def service() -> object:
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO svc_rows VALUES (:j)"), {"j": -mine.job_id})
                outcome = settle(conn, job, Complete())
                if outcome == Stale():
                    raise LookupError("stale")  # rolls the service's row back
                return outcome

        pending = in_thread(service)
        wait_until_blocked(engine, other.pid, pending=[pending])  # in the lookup, on the lock
        other.commit()
        with pytest.raises(LookupError):
            pending.result(timeout=60)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM svc_rows")).scalar_one() == 0
        assert receipt_rows(conn, mine.job_id)["completions"] == [(1, [1])]


def test_the_async_face_settles_a_job(db_url: str, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        mine = queue_storage_attempt(conn)

    async def run() -> object:
        async_engine = create_async_engine(db_url)
        try:
            async with async_engine.begin() as conn:
                return await awa_async.settle(conn, job_of(mine), Complete())
        finally:
            await async_engine.dispose()

    assert asyncio.run(run()) == Completed(mine.job_id)
