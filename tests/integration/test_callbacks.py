"""Ending a callback wait in the caller's transaction: awa-sa writes what awa-pg 0.6.9 writes.

Twin clusters per phase (canonical, mixed_transition, active), their jobs parked on a callback
by a real awa-pg handler (:mod:`callback_waits`). Each call runs by awa-pg's ``AsyncClient``
on one twin and by awa-sa, in a caller's transaction that also commits a business row, on the
other (:mod:`administering`): every row of every table of the phase's schemas and every
sequence changed alike, the same NOTIFYs, the same answer. A call awa-pg answers with
"callback not found" answers None and writes nothing; a rolled back call leaves every row as
it was (a retry's lane reservation alone outlives it, as for the administering retry). Every
call also runs through asyncpg's async face, psycopg2, pg8000 and an ORM Session.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import change, pg_call, same_job, snapshot, twins
from callback_waits import CALLS, CHANNELS, PHASES, SCHEMA, Parked, on_pg, parked_twins
from runtimes import rows
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

JOBS: tuple[dict[str, Any], ...] = (
    # The options of each job, by number (``progress``: flushed before it registers).
    {"unique_opts": {"by_args": True}, "tags": ["t"], "metadata": {"m": 1}},  # 1 complete
    {"progress": True, "tags": ["p"]},  # 2 complete
    {"unique_opts": {"by_args": True}, "metadata": {"m": 3}},  # 3 fail
    {"progress": True},  # 4 fail
    {"unique_opts": {"by_args": True}, "tags": ["r"]},  # 5 retry
    {"progress": True},  # 6 retry
    {},  # 7 rolled back, every call
    {},  # 8 guarded by another run lease: not found
    {},  # 9 the async twins
    {"queue": "cbc_q", "tags": ["c"]},  # 10 complete, a compact receipt where there is one
    {"queue": "cbc_q"},  # 11 fail
    {"queue": "cbc_q", "unique_opts": {"by_args": True}},  # 12 retry
    {},  # 13 completed twice
    {"unique_opts": {"by_args": True}, "metadata": {"m": 14}},  # 14 resume
    {"progress": True},  # 15 resume
    {"tags": ["h"]},  # 16 heartbeat
    {"queue": "cbc_q"},  # 17 resume
    *({"tags": ["d"]} for _ in range(15)),  # 18 to 32: each driver and form, each call
)
FORMS = ("psycopg2", "pg8000", "session")
"""psycopg2's and pg8000's Connections, and an ORM Session on psycopg 3's."""
ROLLED_BACK, GUARDED, ASYNC, TWICE = 7, 8, 9, 13


@pytest.fixture(scope="module", params=PHASES)
def parked(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[Parked]:
    with parked_twins(pg, awa_databases, real_template, request.param, JOBS) as made:
        yield made


STATE = {
    "complete": "completed",
    "fail": "failed",
    "retry": "available",
    "resume": "running",
    "heartbeat": "waiting_external",
}


def twin_call(parked: Parked, verb: str, n: int) -> tuple[Any, Any, dict[str, Any], Any]:
    """*verb* on the *n*-th job's callback: awa-pg on one twin, awa-sa on the other."""
    ids = parked.callback_id(0, n), parked.callback_id(1, n)
    by_pg, by_sa = CALLS[verb]
    return twins(
        parked.urls,
        parked.engines,
        on_pg(lambda c: by_pg(c, ids[0])),
        lambda conn: by_sa(conn, ids[1]),
        schemas=parked.schemas,
        channels=CHANNELS,
    )


PARKED = {
    "complete-keyed": ("complete", 1),
    "complete-progress": ("complete", 2),
    "fail-keyed": ("fail", 3),
    "fail-progress": ("fail", 4),
    "retry-keyed": ("retry", 5),
    "retry-progress": ("retry", 6),
    "complete-compact": ("complete", 10),
    "fail-compact": ("fail", 11),
    "retry-compact": ("retry", 12),
    "resume-keyed": ("resume", 14),
    "resume-progress": ("resume", 15),
    "heartbeat": ("heartbeat", 16),
    "resume-compact": ("resume", 17),
}
"""Each call on a wait of its own: with a unique key, with a flushed progress, and claimed
under a compact receipt (queue storage in active and mixed_transition)."""


def timeout_left(parked: Parked, side: int, n: int) -> bool:
    """Whether the *n*-th job's callback times out 120.5 s from now, as its heartbeat asked."""
    schema = SCHEMA[parked.phase]
    table = "awa.jobs_hot WHERE id" if schema is None else f"{schema}.leases WHERE job_id"
    sql = f"SELECT callback_timeout_at - clock_timestamp() AS left FROM {table} = :i"
    (row,) = rows(parked.engines[side], sql, i=parked.job(n))
    left: dt.timedelta = row["left"]
    return dt.timedelta(seconds=100) < left <= dt.timedelta(seconds=120.5)


@pytest.mark.parametrize(("verb", "n"), PARKED.values(), ids=PARKED.keys())
def test_a_call_on_a_parked_wait_writes_what_awa_pg_writes(
    parked: Parked, verb: str, n: int
) -> None:
    got_pg, got_sa, changed, notes = twin_call(parked, verb, n)
    assert got_pg is not None
    assert got_sa is not None
    same_job(got_sa, got_pg)
    assert (got_sa.state, got_sa.run_lease) == (STATE[verb], 1)
    if verb == "resume":  # where the handler's wait_for_callback finds it
        assert got_sa.metadata["_awa_callback_result"] == {"ok": [1, "two"]}
        assert got_sa.callback_id is None
    if verb == "heartbeat":  # the timeout, a masked clock, moved alike on both twins
        assert got_sa.callback_id is not None
        assert [timeout_left(parked, side, n) for side in (0, 1)] == [True, True]
    assert got_sa.storage == (parked.schemas[-1] if parked.phase != "canonical" else "canonical")
    assert got_sa.errors == [] if verb != "fail" else len(got_sa.errors) == 1
    if verb == "fail":
        (entry,) = got_sa.errors
        assert (entry["error"], entry["attempt"]) == ("card declined", 1)
        assert entry.get("terminal", True) is True
    assert changed or verb == "heartbeat", "nothing changed"
    queue = "cbc_q" if n in (10, 11, 12, 17) else "cb_q"
    if verb == "retry":
        assert [channel for channel, _ in notes] == [f"awa:{queue}"]
    else:
        assert notes == []
    if parked.phase != "canonical" and verb != "heartbeat":
        plane = parked.schemas[-1]
        assert f"{plane}.leases" in changed
        if n in (2, 4, 6, 15):  # the flushed progress left (or, resumed, kept) attempt_state
            assert f"{plane}.attempt_state" in changed


def test_a_second_call_finds_no_callback_as_in_awa_pg(parked: Parked) -> None:
    """The callback of a completed wait is gone: awa-pg raises "callback not found" and
    awa-sa answers None; neither writes anything."""
    ids = parked.callback_id(0, TWICE), parked.callback_id(1, TWICE)
    twin_call(parked, "complete", TWICE)
    for verb, (by_pg, by_sa) in CALLS.items():

        def pg_side(c: awa.AsyncClient, by_pg: Any = by_pg) -> Any:
            return by_pg(c, ids[0])

        def sa_side(conn: sa.Connection, by_sa: Any = by_sa) -> Any:
            return by_sa(conn, ids[1])

        got_pg, got_sa, changed, notes = twins(
            parked.urls,
            parked.engines,
            on_pg(pg_side),
            sa_side,
            schemas=parked.schemas,
            channels=CHANNELS,
        )
        assert (got_pg, got_sa, changed, notes) == (None, None, {}, []), verb


def test_a_call_guarded_by_another_run_lease_finds_no_callback(parked: Parked) -> None:
    engine = parked.engines[1]
    callback = parked.callback_id(1, GUARDED)
    assert callback is not None
    before = snapshot(engine, parked.schemas)
    with engine.begin() as conn:
        assert awa_sa.complete_external(conn, callback, run_lease=2) is None
        assert awa_sa.fail_external(conn, callback, "x", run_lease=2) is None
    assert snapshot(engine, parked.schemas) == before
    with engine.begin() as conn:
        got = awa_sa.complete_external(conn, callback, run_lease=1)
    assert got is not None
    assert got.state == "completed"


def test_a_rolled_back_call_leaves_the_wait_as_it_was(parked: Parked) -> None:
    engine = parked.engines[1]
    callback = parked.callback_id(1, ROLLED_BACK)
    before = snapshot(engine, parked.schemas)
    for verb, (_, by_sa) in CALLS.items():
        with engine.connect() as conn:
            got = by_sa(conn, callback)
            assert got is not None, verb
            assert got.state == STATE[verb], verb
            conn.rollback()
        assert set(change(before, snapshot(engine, parked.schemas))) <= {"sequences"}, verb


def test_the_async_twins_end_a_wait_with_asyncpg(parked: Parked) -> None:
    """On one twin only: a retry rolled back, then a failure committed, through asyncpg."""
    url = sa.make_url(parked.urls[1]).set(drivername="postgresql+asyncpg")
    callback = parked.callback_id(1, ASYNC)
    assert callback is not None

    async def calls() -> tuple[Any, Any]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                retried = await awa_async.retry_external(conn, callback)
                await conn.rollback()
            async with engine.begin() as conn:
                failed = await awa_async.fail_external(conn, callback, "async")
            return retried, failed
        finally:
            await engine.dispose()

    retried, failed = asyncio.run(calls())
    assert (retried.id, retried.state, retried.attempt) == (parked.job(ASYNC), "available", 0)
    assert (failed.id, failed.state) == (parked.job(ASYNC), "failed")
    assert pg_call(parked.urls[1], on_pg(lambda c: c.complete_external(callback))) is None


@pytest.mark.parametrize("form", FORMS)
def test_every_call_through_every_driver_and_form(parked: Parked, form: str) -> None:
    """On one twin, each call on a wait of its own, through psycopg2, pg8000 or a Session:
    the answer and the job's state read back as through psycopg 3."""
    first = 18 + FORMS.index(form) * len(CALLS)
    driver = "psycopg" if form == "session" else form
    url = sa.make_url(parked.urls[1]).set(drivername=f"postgresql+{driver}")
    engine = sa.create_engine(url)
    try:
        for offset, (verb, (_, by_sa)) in enumerate(CALLS.items()):
            n = first + offset
            callback = parked.callback_id(1, n)
            if form == "session":
                with Session(engine) as session, session.begin():
                    got = by_sa(session, callback)
            else:
                with engine.begin() as conn:
                    got = by_sa(conn, callback)
            assert got is not None, verb
            assert (got.id, got.state) == (parked.job(n), STATE[verb]), verb
            assert state_of(parked, n) == STATE[verb], verb
    finally:
        engine.dispose()


def state_of(parked: Parked, n: int) -> str:
    """The *n*-th job's state on the awa-sa twin, read back from the plane that holds it."""
    schema = SCHEMA[parked.phase]
    job_id = parked.job(n)
    if schema is None:
        sql = "SELECT state::text AS s FROM awa.jobs_hot WHERE id = :i"
    else:
        sql = (  # a retried job: its ready row enqueued again beside the first one
            f"SELECT coalesce((SELECT state::text FROM {schema}.leases WHERE job_id = :i),"
            f" (SELECT state::text FROM {schema}.done_entries WHERE job_id = :i),"
            f" (SELECT 'available' FROM {schema}.ready_entries WHERE job_id = :i"
            "   HAVING count(*) = 2)) AS s"
        )
    (row,) = rows(parked.engines[1], sql, i=job_id)
    return str(row["s"])
