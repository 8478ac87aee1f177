"""Each ending of an attempt against its raw-driver floor: the worker's own UPDATE, by psycopg 3.

Per ending (complete, cancel, terminal failure), the floor is the UPDATE that ends a canonical
attempt the way Awa 0.6.9's worker does (docs/contract.md#endings: the state, ``finalized_at``,
the error entry, the progress, guarded by ``(id, 'running', run_lease)``), prepared, alone in
autocommit (one round trip), and inside a transaction the caller has open for the Connection
form, each on the driver connection of the form it is compared with (:mod:`bench.floor`). The
completion is the worker's text; the cancel and the failure carry the same columns and the
error entry the contract gives them. awa-sa's ``settle_canonical_attempt(...)`` sends its one
UPDATE the same way, so what is left between them is SQLAlchemy, awa-sa and the wider statement
(the identity guard, the error entry's CASE, the answer rows).

:data:`ENDINGS` is the seam for more: the queue-storage settles, when they come, add a row with
their own raw statement and awa-sa call, and get their floors and ratios here unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from awa_sa import Cancel, Complete, Fail, settle_canonical_attempt
from awa_sa.settle.results import Result
from bench.floor import Borrowed, Step, directly, set_autocommit
from bench.variants import Variant, Variants

WORKER_COMPLETE = (
    "UPDATE awa.jobs_hot SET state = 'completed', finalized_at = now(), progress = NULL "
    "WHERE id = %s AND state = 'running' AND run_lease = %s"
)
"""The worker's completion of one canonical attempt (its batch falls back to this)."""

_ENTRY = (
    "errors = array_append(errors, jsonb_build_object("
    "'error', %s::text, 'attempt', attempt, 'at', now()){extra}), progress = NULL "
    "WHERE id = %s AND state = 'running' AND run_lease = %s"
)
WORKER_CANCEL = "UPDATE awa.jobs_hot SET state = 'cancelled', finalized_at = now(), " + (
    _ENTRY.format(extra="")
)
"""A cancel as the worker writes it: ``cancelled: <reason>`` appended to the errors."""
WORKER_FAIL = "UPDATE awa.jobs_hot SET state = 'failed', finalized_at = now(), " + _ENTRY.format(
    extra=" || jsonb_build_object('terminal', true)"
)
"""A terminal failure as the worker writes it: the error entry marked terminal."""


@dataclass(frozen=True, slots=True)
class Ending:
    """One way an attempt ends: the worker's raw statement and what awa-sa is given for it."""

    name: str
    sql: str
    values: Callable[[int, int], tuple[Any, ...]]
    result: Result


ENDINGS = (
    Ending("complete", WORKER_COMPLETE, lambda job, lease: (job, lease), Complete()),
    Ending(
        "cancel",
        WORKER_CANCEL,
        lambda job, lease: ("cancelled: bench", job, lease),
        Cancel("bench"),
    ),
    Ending(
        "fail",
        WORKER_FAIL,
        lambda job, lease: ("bench", job, lease),
        Fail("bench", terminal=True),
    ),
)


def build(url: str) -> Variants:
    """Every ending's variants, psycopg 3, against the database at *url*."""
    out = Variants()
    engine = sa.create_engine(url, pool_size=2)
    held = engine.connect()
    out.closers += [engine.dispose, held.close]
    alone = Borrowed(engine, directly, set_autocommit)  # the Engine form's backend

    def held_begin() -> None:
        held.begin()
        held.exec_driver_sql("SELECT 1").all()

    for ending in ENDINGS:
        out.items += _variants(ending, alone, (engine, held), held_begin)
    return out


def _variants(
    ending: Ending, alone: Borrowed, binds: tuple[sa.Engine, sa.Connection], held_begin: Step
) -> list[Variant]:
    """*ending*'s floors (sent by hand on the driver connection of the awa-sa form each is
    compared with: *alone* in autocommit, the held one inside its transaction) and awa-sa's
    forms (*binds*)."""
    engine, held = binds

    def floor(job_id: int, lease: int) -> Any:
        values = ending.values(job_id, lease)
        return alone.conn.execute(ending.sql, values, prepare=True).rowcount

    def floor_in_transaction(job_id: int, lease: int) -> Any:
        conn: Any = held.connection.driver_connection
        return conn.execute(ending.sql, ending.values(job_id, lease), prepare=True).rowcount

    def awa_engine(job_id: int, lease: int) -> Any:
        return settle_canonical_attempt(engine, job_id, lease, ending.result)

    def awa_connection(job_id: int, lease: int) -> Any:
        return settle_canonical_attempt(held, job_id, lease, ending.result)

    g = f"psycopg {ending.name}"
    return [
        Variant(g, "floor", floor, alone.before, alone.after),
        Variant(g, "in-transaction floor", floor_in_transaction, held_begin, held.commit),
        Variant(g, "awa-sa Engine", awa_engine),
        Variant(g, "awa-sa Connection", awa_connection, held_begin, held.commit),
    ]
