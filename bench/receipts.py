"""The settle of a queue-storage attempt against its raw-driver floor, by psycopg 3.

There is no worker statement to compare with from outside: the runtime settles a receipt in
Rust, over several statements of its own. The floor is therefore awa-sa's own two statements
(the receipt's advisory lock, then the settle) sent raw by psycopg, prepared, in a transaction
of their own (BEGIN, lock, settle, COMMIT: what the Engine form sends) and inside one the
caller has open (the Connection form's), each on the driver connection of the form it is
compared with (:mod:`bench.floor`). What is left between the floor and awa-sa's
``settle(...)`` is SQLAlchemy and awa-sa's Python. A completion of a job with tags takes the
ready-backed path (closure, ``done_entries``, terminal delta), the one most endings take.

Attempts are seeded in bulk as a claim on a queue with a deadline leaves them: a ready row and
a ``lease_claims`` receipt each, in the fixture database routed to ``awa_qs``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from awa_sa import Complete, RunningAttempt, settle
from awa_sa.core.compiled import compiled
from awa_sa.settle.inputs import prepare_receipt
from awa_sa.settle.statements.receipt_settles import (
    RECEIPT_LOCKS,
    SETTLE_RECEIPT,
    receipt_lock,
    settle_receipt,
)
from bench.floor import Borrowed, directly
from bench.variants import Variant, Variants

QS = "awa_qs"
RESULT = Complete()

_SEED = f"""
WITH ready AS (
    INSERT INTO {QS}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,
        priority, attempt, run_lease, max_attempts, lane_seq, enqueue_shard, payload)
    SELECT 0, 0, nextval('{QS}.job_id_seq'), 'bench', 'bench', '{{}}', 2, 0, 0, 25,
        g + coalesce((SELECT max(lane_seq) FROM {QS}.ready_entries), 0), 0,
        '{{"tags": ["bench"], "errors": [], "metadata": {{}}, "progress": null}}'
    FROM generate_series(1, :n) AS g
    RETURNING job_id, lane_seq, created_at
)
INSERT INTO {QS}.lease_claims (claim_slot, job_id, run_lease, ready_slot, ready_generation,
    queue, priority, attempt, max_attempts, lane_seq, deadline_at)
SELECT 0, job_id, 1, 0, 0, 'bench', 2, 1, 25, lane_seq, now() + interval '1 hour' FROM ready
RETURNING job_id, receipt_id, claimed_at,
    (SELECT created_at FROM ready WHERE ready.job_id = lease_claims.job_id) AS created_at
"""


class Receipts:
    """A supply of running queue-storage attempts, seeded in bulk; ``take`` gives their ids."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.attempts: dict[int, RunningAttempt] = {}
        self._ids: Iterator[tuple[int, int]] = iter(())

    def seed(self, count: int) -> None:
        engine = sa.create_engine(self.url, poolclass=sa.NullPool)
        with engine.begin() as conn:
            rows = conn.execute(sa.text(_SEED), {"n": count}).all()
            conn.execute(sa.text(f"ANALYZE {QS}.lease_claims, {QS}.ready_entries"))
        engine.dispose()
        self.attempts = {r.job_id: _attempt(r) for r in rows}
        self._ids = iter([(r.job_id, 1) for r in rows])

    def take(self, count: int) -> list[tuple[int, int]]:
        return [next(self._ids) for _ in range(count)]


def _attempt(row: Any) -> RunningAttempt:
    return RunningAttempt(
        job_id=row.job_id,
        run_lease=1,
        kind="bench",
        queue="bench",
        attempt=1,
        max_attempts=25,
        attempted_at=row.claimed_at,
        heartbeat_at=row.claimed_at,
        deadline_at=None,
        running_for=dt.timedelta(0),
        storage=QS,
        created_at=row.created_at,
        args={},
        claim_slot=0,
        receipt_id=row.receipt_id,
    )


def build(url: str, receipts: Receipts) -> Variants:
    """The settle's floors and awa-sa forms on the database at *url* (routed to ``awa_qs``)."""
    out = Variants()
    engine = sa.create_engine(url, pool_size=2)
    held = engine.connect()
    out.closers += [engine.dispose, held.close]
    pooled = Borrowed(engine, directly)  # the Engine form's backend, each floor's own too
    lock = compiled(receipt_lock(batch=False), engine.dialect, QS)
    body = compiled(settle_receipt(shape="row"), engine.dialect, QS)

    def values(job_id: int) -> tuple[Any, Any]:
        item = prepare_receipt(receipts.attempts[job_id], RESULT, None, None).item
        return lock.params(RECEIPT_LOCKS.binds([item])), body.params(SETTLE_RECEIPT.binds(item))

    def raw(conn: Any, job_id: int) -> Any:
        locked, settled = values(job_id)
        conn.execute(lock.sql, locked, prepare=True).fetchall()
        return conn.execute(body.sql, settled, prepare=True).fetchall()

    def floor(job_id: int, lease: int) -> Any:
        rows = raw(pooled.conn, job_id)
        pooled.conn.commit()
        return rows

    def inside(job_id: int, lease: int) -> Any:
        return raw(held.connection.driver_connection, job_id)

    def held_begin() -> None:
        held.begin()
        held.exec_driver_sql("SELECT 1").all()

    g = "psycopg queue-storage complete"
    out.items += [
        Variant(g, "floor", floor, pooled.before, pooled.after),
        Variant(g, "in-transaction floor", inside, held_begin, held.commit),
        Variant(g, "awa-sa Engine", lambda j, _: settle(engine, receipts.attempts[j], RESULT)),
        Variant(
            g,
            "awa-sa Connection",
            lambda j, _: settle(held, receipts.attempts[j], RESULT),
            held_begin,
            held.commit,
        ),
    ]
    return out
