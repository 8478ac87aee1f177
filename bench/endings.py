"""Completion against its raw-driver floor: the worker's own UPDATE, sent by psycopg 3.

The floor is the statement Awa 0.6.9's worker sends to complete a canonical attempt, prepared,
alone in autocommit (one round trip), and inside a transaction the caller has open for the
Connection form. awa-sa's ``settle_canonical_attempt(..., Complete())`` sends its one UPDATE
the same way, so what is left between them is SQLAlchemy, awa-sa and the wider statement (the
identity guard, the error entry's CASE, the answer rows).
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa

from awa_sa import Complete, settle_canonical_attempt
from bench.variants import Variant, Variants

WORKER_COMPLETE = (
    "UPDATE awa.jobs_hot SET state = 'completed', finalized_at = now(), progress = NULL "
    "WHERE id = %s AND state = 'running' AND run_lease = %s"
)
"""The worker's completion of one canonical attempt (its batch falls back to this)."""


def build(url: str) -> Variants:
    """The completion variants of psycopg 3 against the database at *url*."""
    out = Variants()
    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    alone = psycopg.connect(dsn, autocommit=True)
    inside = psycopg.connect(dsn)
    engine = sa.create_engine(url, pool_size=2)
    held = engine.connect()
    out.closers += [alone.close, inside.close, engine.dispose, held.close]

    def floor(job_id: int, lease: int) -> Any:
        return alone.execute(WORKER_COMPLETE, (job_id, lease), prepare=True).rowcount

    def floor_in_transaction(job_id: int, lease: int) -> Any:
        return inside.execute(WORKER_COMPLETE, (job_id, lease), prepare=True).rowcount

    def begin() -> None:
        inside.execute("SELECT 1", prepare=True).fetchall()

    def held_begin() -> None:
        held.begin()
        held.exec_driver_sql("SELECT 1").all()

    def awa_engine(job_id: int, lease: int) -> Any:
        return settle_canonical_attempt(engine, job_id, lease, Complete())

    def awa_connection(job_id: int, lease: int) -> Any:
        return settle_canonical_attempt(held, job_id, lease, Complete())

    g = "psycopg complete"
    out.items += [
        Variant(g, "floor", floor),
        Variant(g, "in-transaction floor", floor_in_transaction, begin, inside.commit),
        Variant(g, "awa-sa Engine", awa_engine),
        Variant(g, "awa-sa Connection", awa_connection, held_begin, held.commit),
    ]
    return out
