"""A batch locks the canonical rows it takes lowest id first, whatever plan PostgreSQL picks.

Another session holds the middle of three rows. A batch over the high, the middle and the low
row then blocks on the middle one, and what it holds while it waits shows the order it locks
in: ascending ids mean it holds the low row and has not touched the high one. A third session
reads that with ``SKIP LOCKED``. The batch runs with the planner's own choice and with a plan
forced to visit rows in physical order, where the low row comes last, on both branches, and
with rows the batch's own statement leaves to a later one (a callback-wired row, which the
canonical move takes after the queue-storage take; rows sharing a unique key, which go one at
a time): those are locked in the same order, by the same statement.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from jobs import insert_job
from racing import held, in_thread, wait_until_blocked

import awa_sa_schema
from awa_sa import Attempt, Migrated, Outcome, Rescheduled, Snooze, reschedule_canonical_attempts

PLANS = {
    "planner's choice": (),
    "physical order": (
        "enable_indexscan = off",
        "enable_bitmapscan = off",
        "enable_hashjoin = off",
        "enable_mergejoin = off",
    ),
}
ROWS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (every row, the low row)
    "distinct rows": ({}, {}),
    "low row callback-wired": ({}, {"callbacks": ["callback_on_fail"]}),
    "shared unique key": ({"unique_key": b"k", "unique_states": "00000000"}, {}),
}


def _unlocked(engine: sa.Engine, ids: list[int]) -> set[int]:
    """Which of *ids* no other transaction holds a row lock on (probed, then released)."""
    with engine.connect() as conn, conn.begin() as probe:
        found = conn.execute(
            sa.text("SELECT id FROM awa.jobs_hot WHERE id = ANY(:ids) FOR UPDATE SKIP LOCKED"),
            {"ids": ids},
        ).scalars()
        unlocked = set(found)
        probe.rollback()
    return unlocked


def _batch(engine: sa.Engine, plan: tuple[str, ...], attempts: list[Attempt]) -> list[Outcome]:
    with engine.connect() as conn, conn.begin():
        for setting in plan:
            conn.execute(sa.text(f"SET LOCAL {setting}"))
        return reschedule_canonical_attempts(conn, attempts)


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("rows", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_batch_locks_rows_in_ascending_id_order(
    engine: sa.Engine,
    phase: str,
    rows: tuple[dict[str, Any], dict[str, Any]],
    plan: tuple[str, ...],
) -> None:
    every, low_only = rows
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, phase, "awa_qs")
        low = insert_job(conn, **every, **low_only)
        middle, high = insert_job(conn, **every), insert_job(conn, **every)
        # A new version of the low row lands after the others: physical order middle, high, low.
        conn.execute(sa.text("UPDATE awa.jobs_hot SET priority = 3 WHERE id = :id"), {"id": low})
    attempts = [Attempt(job, 1, Snooze(1)) for job in (high, middle, low)]
    with held(engine) as holder:
        holder.execute("SELECT 1 FROM awa.jobs_hot WHERE id = :id FOR UPDATE", {"id": middle})
        batch = in_thread(lambda: _batch(engine, plan, attempts))
        (waiter,) = wait_until_blocked(engine, holder.pid, pending=[batch])
        with engine.connect() as conn:
            wait_type = conn.execute(
                sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": waiter.pid},
            ).scalar_one()
        assert wait_type == "Lock"
        assert _unlocked(engine, [low, high]) == {high}  # the low row is held, the high one free
        holder.rollback()
    outcomes = batch.result(timeout=30)
    migrated = Rescheduled if phase == "canonical" else Migrated
    expected = [migrated, migrated, Rescheduled if low_only else migrated]
    assert [type(outcome) for outcome in outcomes] == expected
