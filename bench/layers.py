"""Where the Engine form's client CPU goes, each layer of awa-sa timed in its real place.

Part 1 gives the Engine form's time over its pool floor; this part splits that share among
awa-sa's layers. Each variant is a real call on a live attempt (psycopg 3, an engine no one
watches: the direct path), built up from the pool floor one layer at a time: the direct path's
own I/O (checkout, autocommit switch, the statement's text sent and fetched, checkin), then
the validation of the arguments, the statement run as a :class:`~awa_sa.core.compiled.Query` (its
shape, compiled text, binds and answer), the flow's step around it, the form around that, and
the public call. Each layer's cost is its variant's client CPU less the one before.

Measured so, and not each step alone in a loop (:mod:`bench.breakdown`), because a step that
runs once between two round trips costs several times what it costs repeated: the server's
work (and, on one core, its process) has evicted the caches in between, so the first touch of
each function's code and data is what a call pays for. "validation, twice" shows it: the second
validation of the same arguments costs what a loop would say, the first several times that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from awa_sa import reschedule_canonical_attempt
from awa_sa.core.compiled import run as run_query
from awa_sa.core.internals import Direct, autocommit_off, autocommit_on, checkin_idle, checkout
from awa_sa.settle import binds as forms
from awa_sa.settle import flow
from awa_sa.settle.inputs import items, prepare
from awa_sa.settle.statements.canonical import MOVE_IF_CANONICAL
from bench.floor import pool_floor
from bench.measure import interleave
from bench.variants import Variant
from bench.workload import KIND, Jobs, move_values, one_statement_text

Op = Callable[[int, int], Any]

GROUP = "psycopg"
"""The driver whose Engine form is split (the bench's variants are named by their driver)."""

BUILDS_ON = {
    "+ the direct path's I/O": "pool floor",
    "+ validation": "+ the direct path's I/O",
    "+ validation, twice": "+ validation",
    "+ the statement as a Query": "+ validation",
    "+ the flow's step (flow.alone)": "+ the statement as a Query",
    "+ the form (forms.within)": "+ the flow's step (flow.alone)",
    "+ the public call": "+ the form (forms.within)",
}
"""The variant each one adds its layer to ("twice" is an aside: the same layer again)."""
LAYERS = ("pool floor", *BUILDS_ON)
"""Every variant, in order."""


def _layers(engine: sa.Engine) -> dict[str, Op]:
    """The variants, each one layer more than the one before it."""
    one = one_statement_text(engine.dialect)

    def direct(send: Callable[[Direct], Any]) -> Any:
        fairy = checkout(engine)
        conn = Direct(engine, fairy)
        dbapi = autocommit_on(conn)
        try:
            return send(conn)
        finally:
            autocommit_off(conn, dbapi)
            checkin_idle(fairy)

    def io(job_id: int, lease: int) -> Any:
        return direct(lambda conn: conn.send(one.sql, one.params(move_values(job_id, lease))))

    def validated(job_id: int, lease: int) -> Any:
        prepare(job_id, lease, KIND, None, None)
        return io(job_id, lease)

    def validated_twice(job_id: int, lease: int) -> Any:
        prepare(job_id, lease, KIND, None, None)
        return validated(job_id, lease)

    def query(job_id: int, lease: int) -> Any:
        moving = items([prepare(job_id, lease, KIND, None, None)])
        return direct(lambda conn: run_query(conn, MOVE_IF_CANONICAL, moving))

    def step(job_id: int, lease: int) -> Any:
        calls = [prepare(job_id, lease, KIND, None, None)]
        return direct(lambda conn: flow.alone(conn, calls))

    def form(job_id: int, lease: int) -> Any:
        return forms.within(engine, [prepare(job_id, lease, KIND, None, None)])

    def call(job_id: int, lease: int) -> Any:
        return reschedule_canonical_attempt(engine, job_id, lease, KIND)

    ops = (pool_floor(engine, one), io, validated, validated_twice, query, step, form, call)
    return dict(zip(LAYERS, ops, strict=True))


def run(url: str, rounds: int, per_round: int, warmup: int) -> dict[str, float]:
    """Median client CPU per call of each variant, in µs, interleaved as part 1 is."""
    engine = sa.create_engine(url, pool_size=2)
    try:
        variants = [Variant(GROUP, name, op) for name, op in _layers(engine).items()]
        samples = interleave(variants, Jobs(url), rounds=rounds, per_round=per_round, warmup=warmup)
        return {v.form: samples[v.name].summary()["cpu_us"] for v in variants}
    finally:
        engine.dispose()
