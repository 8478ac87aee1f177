"""The runtime's rescues against receipts awa-sa settles, every order forced with held locks.

On a real v040 cluster (``awa migrate``, then the real ``awa storage`` commands to ``active``
on ``awa_qs``), queue-storage attempts are seeded as a claim leaves them, and the runtime's own
rescue statements (tests/rescues.py, copied from awa-pg 0.6.9) are run against them beside
awa-sa's settle:

* **settle first, rescue's snapshot older.** A side transaction holds the claim slot's
  ``claim_ring_slots`` row, which each rescue statement locks ``FOR UPDATE`` after its snapshot
  is taken; the rescue is seen waiting on it (``pg_stat_activity``); awa-sa settles and
  commits meanwhile; then the slot is let go. The rescue reads every receipt with a snapshot
  from before the settle, and meets the settled receipts only in the row it locks. It closes
  none of awa-sa's (``closed_at``, set by every settle of a ``lease_claims`` receipt, is what
  its re-check reads), and closes the control: an attempt settled the same way but left as
  the runtime's own compact completion leaves it (``closed_at`` NULL), which is the hole of
  issue 40.
* **settle in flight.** awa-sa's transaction holds the receipt's advisory lock and row while a
  rescue runs: the rescue skips the receipt, and after the commit a second pass finds it closed.
* **rescue first.** The rescue's transaction is held open after it closed the receipt; awa-sa's
  settle is seen waiting for the receipt's advisory lock; the rescue commits; awa-sa answers
  ``Stale`` and writes nothing.

For each of the two rescues that can meet a receipt: the deadline rescue (``lease_claims``
receipts only: a compact receipt has no deadline) and the receipt heartbeat rescue (both
shapes). A compact receipt has no row the heartbeat rescue re-reads, so its older snapshot
still sees it open: awa-sa refuses to settle one (``CompactReceipt``, every row as it was),
and the last test pins the window with ``cancel_job``, which closes a running compact attempt
as awa-pg's cancel does and shares it (docs/contract.md#compact-receipts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import every_row
from racing import DEFAULT_TIMEOUT, HeldTransaction, in_thread, wait_until_blocked
from rescues import DEADLINE_RESCUE, RECEIPT_HEARTBEAT_RESCUE, statement
from runtimes import rows

import awa_sa
from awa_sa import RunningAttempt, Stale
from awa_sa.testing import queue_storage_attempt

QS = "awa_qs"


@dataclass(frozen=True)
class Rescue:
    text: str
    outcome: str
    """The closure outcome it writes."""

    stale_before: bool = False
    """Its ``$2`` is the heartbeat cut-off: now an hour on, so that every receipt is stale."""


DEADLINE = Rescue(DEADLINE_RESCUE, "deadline_expired")
HEARTBEAT = Rescue(RECEIPT_HEARTBEAT_RESCUE, "rescued", stale_before=True)
RESCUES = {"deadline": DEADLINE, "heartbeat": HEARTBEAT}

RESULTS: dict[str, tuple[awa_sa.Result, list[str]]] = {
    "complete-bare": (awa_sa.Complete(), []),  # the compact completion: no closure row
    "complete-tagged": (awa_sa.Complete(), ["t"]),
    "cancel": (awa_sa.Cancel("raced"), []),
    "retry-after": (awa_sa.RetryAfter(60), []),
}


@pytest.fixture
def active(cluster_real: Cluster) -> sa.Engine:
    cluster_real.set_phase("active", QS)
    return cluster_real.engine


@pytest.fixture
def cluster_real(
    pg: Any, clone_database: Callable[[str], str], real_template: str
) -> Iterator[Cluster]:
    url = clone_database(real_template)
    engine = sa.create_engine(url)
    try:
        yield Cluster("real", pg, url, engine)
    finally:
        engine.dispose()


def seed(engine: sa.Engine, *, tags: list[str], deadline: bool = True) -> RunningAttempt:
    """A claimed attempt whose deadline (or heartbeat) has passed: every rescue's candidate."""
    with engine.begin() as conn:
        attempt = queue_storage_attempt(
            conn,
            schema=QS,
            kind="raced",
            queue="q",
            tags=tags,
            deadline_secs=300 if deadline else 0,
        )
        conn.execute(
            sa.text(
                f"UPDATE {QS}.lease_claims"
                " SET deadline_at = clock_timestamp() - interval '1 second'"
                " WHERE job_id = :job AND run_lease = :lease"
            ),
            {"job": attempt.job_id, "lease": attempt.run_lease},
        )
    return attempt


def rescue_now(conn: sa.Connection, rescue: Rescue, slot: int) -> set[int]:
    """One pass of *rescue* in *conn*'s transaction: the job ids it closed."""
    params: dict[str, Any] = {"p1": slot, "p2": 100, "p3": 100}
    if rescue.stale_before:
        hour_on = sa.text("SELECT clock_timestamp() + interval '1 hour'")
        params = {"p1": slot, "p2": conn.execute(hour_on).scalar_one(), "p3": 100, "p4": 100}
    found = conn.execute(statement(rescue.text, QS), params).all()
    return {row.job_id for row in found}


@dataclass(frozen=True)
class Ledger:
    closures: list[str]
    """Outcomes of every ``lease_claim_closures`` row and closure batch naming the receipt."""
    closed_at: bool
    written: int
    """``done_entries``, ``deferred_jobs`` and compact-completion rows under the pair."""


def ledger(engine: sa.Engine, a: RunningAttempt) -> Ledger:
    pair = {"job": a.job_id, "lease": a.run_lease, "receipt": a.receipt_id}
    closures = rows(
        engine,
        f"SELECT outcome FROM {QS}.lease_claim_closures WHERE job_id = :job AND run_lease = :lease"
        f" UNION ALL SELECT outcome FROM {QS}.lease_claim_closure_batches"
        " WHERE receipt_ranges @> CAST(:receipt AS bigint)",
        **pair,
    )
    marked = rows(
        engine,
        f"SELECT closed_at IS NOT NULL AS marked FROM {QS}.lease_claims"
        " WHERE job_id = :job AND run_lease = :lease",
        **pair,
    )
    [written] = rows(
        engine,
        f"SELECT (SELECT count(*) FROM {QS}.done_entries"
        " WHERE job_id = :job AND run_lease = :lease)"
        f" + (SELECT count(*) FROM {QS}.deferred_jobs WHERE job_id = :job AND run_lease = :lease)"
        f" + (SELECT count(*) FROM {QS}.receipt_completion_batches AS b,"
        " unnest(b.job_ids, b.run_leases) AS i(job_id, run_lease)"
        " WHERE i.job_id = :job AND i.run_lease = :lease) AS n",
        **pair,
    )
    return Ledger(
        sorted(r["outcome"] for r in closures),
        bool(marked and marked[0]["marked"]),
        int(written["n"]),
    )


CLOSED_AS = {"complete-bare": "completed", "complete-tagged": "completed", "cancel": "cancelled"}


def closed_as(name: str) -> str:
    return CLOSED_AS.get(name, "retryable")


def settle_unsealed(engine: sa.Engine, a: RunningAttempt) -> None:
    """The control: a bare completion left as the runtime's own compact completion leaves a
    ``lease_claims`` receipt, its ``closed_at`` NULL (awa-sa's rows otherwise)."""
    with engine.begin() as conn:
        assert awa_sa.settle(conn, a, awa_sa.Complete()) == awa_sa.Completed(a.job_id)
        conn.execute(
            sa.text(
                f"UPDATE {QS}.lease_claims SET closed_at = NULL"
                " WHERE job_id = :job AND run_lease = :lease"
            ),
            {"job": a.job_id, "lease": a.run_lease},
        )


@pytest.mark.parametrize("which", list(RESCUES))
def test_a_rescue_whose_snapshot_predates_the_settle_closes_none_of_awa_sas(
    active: sa.Engine, which: str
) -> None:
    rescue = RESCUES[which]
    engine = active
    settled = {name: seed(engine, tags=tags) for name, (_, tags) in RESULTS.items()}
    control = seed(engine, tags=[])
    slot = control.claim_slot
    assert slot is not None
    assert {a.claim_slot for a in settled.values()} == {slot}

    with HeldTransaction(engine) as slot_row:
        slot_row.execute(
            f"SELECT 1 FROM {QS}.claim_ring_slots WHERE slot = :slot FOR UPDATE", {"slot": slot}
        )

        def run_rescue() -> set[int]:
            with engine.begin() as conn:
                return rescue_now(conn, rescue, slot)

        rescuing = in_thread(run_rescue, "rescue")
        [waiter] = wait_until_blocked(engine, slot_row.pid, pending=[rescuing])
        assert waiter.row_of == f"{QS}.claim_ring_slots", waiter  # its snapshot is taken
        outcomes = {
            name: awa_sa.settle(engine, settled[name], result)
            for name, (result, _) in RESULTS.items()
        }
        settle_unsealed(engine, control)
        assert rescuing.running()  # still waiting: every settle committed behind its snapshot
        slot_row.commit()
    rescued = rescuing.result(timeout=DEFAULT_TIMEOUT)

    # The rescue re-checked each settled receipt's row: awa-sa's are sealed, the control not.
    assert rescued == {control.job_id}
    for name, a in settled.items():
        assert not isinstance(outcomes[name], Stale), (name, outcomes[name])
        found = ledger(engine, a)
        assert found.closures == [closed_as(name)], (name, found)
        assert found.closed_at, (name, found)
    # The control, settled as the runtime settles it, is closed twice: the double run.
    assert ledger(engine, control).closures == sorted(["completed", rescue.outcome])


@pytest.mark.parametrize("which", list(RESCUES))
def test_a_rescue_beside_a_settle_in_flight_skips_the_receipt(
    active: sa.Engine, which: str
) -> None:
    rescue = RESCUES[which]
    engine = active
    settled = {name: seed(engine, tags=tags) for name, (_, tags) in RESULTS.items()}
    slot = next(iter(settled.values())).claim_slot
    assert slot is not None
    with engine.connect() as conn, conn.begin():
        for name, (result, _) in RESULTS.items():
            awa_sa.settle(conn, settled[name], result)
        # Uncommitted: the rescue finds each receipt's advisory lock and row taken.
        with engine.begin() as other:
            assert rescue_now(other, rescue, slot) == set()
    with engine.begin() as other:
        assert rescue_now(other, rescue, slot) == set()  # committed: closed
    for name, a in settled.items():
        assert ledger(engine, a).closures == [closed_as(name)], name


@pytest.mark.parametrize("which", list(RESCUES))
@pytest.mark.parametrize("name", list(RESULTS))
def test_a_rescue_that_commits_first_makes_the_settle_stale(
    active: sa.Engine, which: str, name: str
) -> None:
    rescue = RESCUES[which]
    engine = active
    result, tags = RESULTS[name]
    a = seed(engine, tags=tags)
    assert a.claim_slot is not None
    with HeldTransaction(engine) as rescuing:
        assert rescue_now(rescuing.conn, rescue, a.claim_slot) == {a.job_id}

        def settle() -> awa_sa.Ending:
            return awa_sa.settle(engine, a, result)

        settling = in_thread(settle, "awa-sa")
        [waiter] = wait_until_blocked(engine, rescuing.pid, pending=[settling])
        assert waiter.wait_event == "advisory", waiter  # the receipt's lock
        rescuing.commit()
    assert settling.result(timeout=DEFAULT_TIMEOUT) == Stale()
    found = ledger(engine, a)
    assert found == Ledger([rescue.outcome], True, 0), found


def test_a_compact_receipt_is_refused_and_its_window_is_the_runtimes(active: sa.Engine) -> None:
    """awa-sa refuses to settle a compact receipt before any statement: every row reads as
    before, the caller's transaction goes on (every entry point: test_receipt_settles.py).

    The window that makes it refuse (docs/contract.md#compact-receipts): a compact receipt is a
    position of an append-only batch row, so a heartbeat rescue whose snapshot predates a
    closure's commit, and which reaches the receipt after it, closes it again. ``cancel_job``
    of the running attempt, which writes what awa-pg's cancel writes, is closed twice so; the
    other compact receipt is rescued as the runtime rescues any."""
    engine = active
    a = seed(engine, tags=[], deadline=False)
    late = seed(engine, tags=[], deadline=False)
    assert a.claim_batch_id is not None
    assert a.claim_slot is not None
    before = every_row(engine)
    with engine.connect() as conn, conn.begin():
        with pytest.raises(awa_sa.CompactReceipt) as alone:
            awa_sa.settle(conn, a, awa_sa.Complete())
        assert (alone.value.job_id, alone.value.run_lease, alone.value.queue) == (
            a.job_id,
            a.run_lease,
            "q",
        )
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1  # the transaction goes on
    assert every_row(engine) == before

    with HeldTransaction(engine) as slot_row:
        slot_row.execute(
            f"SELECT 1 FROM {QS}.claim_ring_slots WHERE slot = :slot FOR UPDATE",
            {"slot": a.claim_slot},
        )

        def run_rescue() -> set[int]:
            with engine.begin() as conn:
                return rescue_now(conn, HEARTBEAT, a.claim_slot or 0)

        rescuing = in_thread(run_rescue, "rescue")
        wait_until_blocked(engine, slot_row.pid, pending=[rescuing])
        cancelled = awa_sa.cancel_job(engine, a.job_id)
        assert cancelled is not None
        assert cancelled.state == "cancelled"
        slot_row.commit()
    assert rescuing.result(timeout=DEFAULT_TIMEOUT) == {a.job_id, late.job_id}
    assert ledger(engine, a).closures == ["cancelled", "rescued"]
    assert ledger(engine, late).closures == ["rescued"]
