"""Administering jobs through every bind form and driver, and what is refused (issue 37).

Each sync driver (psycopg 3, psycopg2, pg8000) with an Engine, a Connection and a Session, and
each async one (psycopg 3, asyncpg) with an AsyncEngine, AsyncConnection and AsyncSession,
cancels a job (by id and by unique key), retries it, retries and discards failed jobs, on one
clone of the Alembic fixture: the rows read back, and the typed results equal psycopg 3's
Engine form's but for the ids and clocks. What awa-pg's real Client writes is
test_administer_canonical.py; here, the forms, the refusals (queue-storage routing on both
kinds of cluster, AUTOCOMMIT, bad input) and that nothing is written when refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster, cloned
from jobs import insert_holder, insert_job, snapshot
from racing import held, in_thread, wait_until_blocked
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import JobRow, QueueStorageJobs, RetriedFailed, UniqueConflict, ValidationError
from awa_sa.core.unique_keys import Unique, to_json, unique_key
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

SYNC = ("psycopg", "psycopg2", "pg8000")
ASYNC = ("psycopg_async", "asyncpg")
FORMS = [(d, f) for d in SYNC for f in ("engine", "connection", "session")]
FORMS += [(d, f) for d in ASYNC for f in ("engine", "connection", "session")]
CLOCKS = (
    "id",
    "run_at",
    "created_at",
    "finalized_at",
    "heartbeat_at",
    "deadline_at",
    "attempted_at",
)


@pytest.fixture(scope="module")
def url(pg: EmbeddedPostgres, awa_databases: Databases, fixture_template: str) -> Iterator[str]:
    with cloned(pg, awa_databases, fixture_template) as found:
        yield found


def _key(tag: str) -> bytes:
    """awa-pg's key of kind *tag* with args ``{"n": 2}`` (``by_args``, the default)."""
    return unique_key(tag, "", to_json({"n": 2}), Unique())


def _seed(engine: sa.Engine, tag: str) -> dict[str, int]:
    """An available job and two failed ones of kind *tag*, shaped alike for every form."""
    with engine.begin() as conn:
        shape: dict[str, Any] = {
            "kind": tag,
            "queue": f"q_{tag}",
            "args": '{"n": 1, "big": 1e400}',
            "tags": ["t1", "t2"],
            "metadata": '{"tenant": "acme"}',
            "errors": ['{"error": "boom", "attempt": 1}'],
            "unique_key": b"\x00key-" + tag.encode(),
            "unique_states": "11111000",
        }
        return {
            "available": insert_job(conn, state="available", attempt=0, run_lease=0, **shape),
            "failed": insert_job(conn, state="failed", **{**shape, "unique_key": None}),
            "failed2": insert_job(conn, state="failed", **{**shape, "unique_key": None}),
            "junk": insert_job(conn, state="failed", **{**shape, "kind": f"{tag}_junk"}),
            "keyed": insert_job(
                conn,
                state="available",
                attempt=0,
                run_lease=0,
                **{**shape, "args": '{"n": 2}', "unique_key": _key(tag)},
            ),
        }


def _walk(verb: Callable[..., Any], jobs: dict[str, int], tag: str) -> list[Any]:
    """The same verbs in the same order, through *verb* (a form's caller)."""
    return [
        verb(awa_sa.cancel_job, awa_async.cancel_job, jobs["available"]),
        verb(awa_sa.cancel_job, awa_async.cancel_job, jobs["available"]),
        verb(awa_sa.retry_job, awa_async.retry_job, jobs["available"]),
        verb(awa_sa.retry_failed, awa_async.retry_failed, kind=tag),
        verb(awa_sa.cancel_job, awa_async.cancel_job, jobs["failed"]),
        verb(awa_sa.discard_failed, awa_async.discard_failed, f"{tag}_junk"),
        verb(awa_sa.cancel_by_unique_key, awa_async.cancel_by_unique_key, tag, args={"n": 2}),
        verb(awa_sa.cancel_by_unique_key, awa_async.cancel_by_unique_key, tag, args={"n": 2}),
    ]


def _sync_verb(engine: sa.Engine, form: str) -> Callable[..., Any]:
    def verb(call: Callable[..., Any], _: object, *args: Any, **kw: Any) -> Any:
        if form == "engine":
            return call(engine, *args, **kw)
        if form == "connection":
            with engine.begin() as conn:
                return call(conn, *args, **kw)
        with Session(engine) as session, session.begin():
            return call(session, *args, **kw)

    return verb


def _async_verb(url: str, form: str) -> Callable[..., Any]:
    def verb(_: object, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        async def run() -> Any:
            engine = create_async_engine(url)
            try:
                if form == "engine":
                    return await call(engine, *args, **kw)
                if form == "connection":
                    async with engine.begin() as conn:
                        return await call(conn, *args, **kw)
                async with AsyncSession(engine) as session, session.begin():
                    return await call(session, *args, **kw)
            finally:
                await engine.dispose()

        return asyncio.run(run())

    return verb


def _comparable(result: Any) -> Any:
    """*result* without what no two jobs share (ids, clocks)."""
    if isinstance(result, JobRow):
        return {k: v for k, v in dataclasses.asdict(result).items() if k not in CLOCKS}
    if isinstance(result, RetriedFailed):
        return ([_comparable(j) for j in result.jobs], result.matched, result.pruned_failed_count)
    return result


def _driver_url(url: str, driver: str) -> str:
    return sa.make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(False)


@pytest.fixture(scope="module")
def reference(url: str) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        tag = "reference"
        return [
            _comparable(r) for r in _walk(_sync_verb(engine, "engine"), _seed(engine, tag), tag)
        ]
    finally:
        engine.dispose()


@pytest.mark.parametrize(("driver", "form"), FORMS, ids=[f"{d}-{f}" for d, f in FORMS])
def test_every_form_and_driver_administers_alike(
    url: str, reference: list[Any], driver: str, form: str
) -> None:
    engine = sa.create_engine(url)
    try:
        tag = f"{driver}_{form}"
        jobs = _seed(engine, tag)
        if driver in ASYNC:
            name = "psycopg" if driver == "psycopg_async" else driver
            got = [
                _comparable(r) for r in _walk(_async_verb(_driver_url(url, name), form), jobs, tag)
            ]
        else:
            own = sa.create_engine(_driver_url(url, driver))
            try:
                got = [_comparable(r) for r in _walk(_sync_verb(own, form), jobs, tag)]
            finally:
                own.dispose()
        # The kind and queue carry the form's tag; everything else is the reference's.
        for results in (got, reference):
            for item in results:
                for row in item[0] if isinstance(item, tuple) else [item]:
                    if isinstance(row, dict):
                        row.update(kind="k", queue="q", unique_key=None)
        assert got == reference
        with engine.connect() as conn:
            found: dict[int, str] = dict(
                conn.execute(
                    sa.text("SELECT id, state::text FROM awa.jobs_hot WHERE kind = :k"), {"k": tag}
                ).all()
            )
        assert found == {
            jobs["available"]: "available",
            jobs["failed"]: "cancelled",
            jobs["failed2"]: "available",
            jobs["keyed"]: "cancelled",
        }
    finally:
        engine.dispose()


@pytest.mark.parametrize("phase", ["mixed_transition", "active"])
def test_queue_storage_leaves_a_canonical_job_alone(cluster: Cluster, phase: str) -> None:
    with cluster.engine.begin() as conn:
        job_id = insert_job(conn, state="failed", kind="left")
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.connect() as conn:
        before = snapshot(conn)
    with cluster.engine.begin() as conn, pytest.raises(QueueStorageJobs, match="awa_qs"):
        awa_sa.cancel_job(conn, job_id)
    # The canonical failed job is not in the routing schema, where awa-pg looks too.
    with cluster.engine.begin() as conn:
        assert awa_sa.retry_job(conn, job_id) is None
        assert awa_sa.retry_failed(conn, kind="left") == RetriedFailed([], 0, None)
        assert awa_sa.discard_failed(conn, "left") == 0
    with cluster.engine.connect() as conn:
        assert snapshot(conn) == before


def test_autocommit_and_bad_input_are_refused_before_any_write(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        jobs = _seed(engine, "refused")
        with engine.connect() as conn:
            before = snapshot(conn)
        auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        with auto.connect() as conn, pytest.raises(ValidationError, match="AUTOCOMMIT"):
            awa_sa.cancel_job(conn, jobs["available"])
        refusals: list[tuple[Callable[[], object], str]] = [
            (lambda: awa_sa.cancel_job(engine, True), "job_id must be an int"),
            (lambda: awa_sa.retry_job(engine, 0), "positive bigint"),
            (lambda: awa_sa.retry_failed(engine), "exactly one of kind or queue"),
            (lambda: awa_sa.retry_failed(engine, kind="a", queue="b"), "exactly one"),
            (lambda: awa_sa.discard_failed(engine, 3), "kind must be a str"),  # type: ignore[arg-type]
            (lambda: awa_sa.cancel_job(object(), 1), "bind must be"),  # type: ignore[arg-type]
        ]
        for call, message in refusals:
            with pytest.raises(ValidationError, match=message):
                call()
        with engine.connect() as conn:
            assert snapshot(conn) == before
    finally:
        engine.dispose()


COMPLETE = (
    "UPDATE awa.jobs_hot SET state = 'completed', finalized_at = now(), progress = NULL "
    "WHERE id = :id AND state = 'running' AND run_lease = :lease"
)
"""The completion an awa-pg 0.6.9 worker sends when its handler returns."""


def _state(engine: sa.Engine, job_id: int) -> str:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT state::text FROM awa.jobs_hot WHERE id = :id"), {"id": job_id}
        )
        return str(found.scalar_one())


def test_a_completion_that_locked_first_wins_and_the_cancel_finds_nothing(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            job_id = insert_job(conn, kind="race_a")
        with held(engine) as worker:
            assert worker.execute(COMPLETE, {"id": job_id, "lease": 1}).rowcount == 1
            cancel = in_thread(lambda: awa_sa.cancel_job(engine, job_id))
            (waiter,) = wait_until_blocked(engine, worker.pid, pending=[cancel])
            assert waiter.row_of == "awa.jobs_hot"  # the job's row, not routing
            worker.commit()
        assert cancel.result(timeout=20) is None
        assert _state(engine, job_id) == "completed"
    finally:
        engine.dispose()


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_cancel_that_locked_first_leaves_the_later_completion_nothing(
    url: str, ending: str
) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            job_id = insert_job(conn, kind=f"race_b_{ending}")
        with held(engine) as admin:
            assert awa_sa.cancel_job(admin.conn, job_id) is not None
            completion = in_thread(lambda: _complete(engine, job_id))
            wait_until_blocked(engine, admin.pid, pending=[completion])
            if ending == "commit":
                admin.commit()
            else:
                admin.rollback()
        # Committed, the cancel's new row is not the row the completion waited for: it
        # updates nothing. Rolled back, the running row is back and the completion ends it.
        assert completion.result(timeout=20) == (0 if ending == "commit" else 1)
        assert _state(engine, job_id) == ("cancelled" if ending == "commit" else "completed")
    finally:
        engine.dispose()


def _complete(engine: sa.Engine, job_id: int) -> int:
    with engine.begin() as conn:
        return conn.execute(sa.text(COMPLETE), {"id": job_id, "lease": 1}).rowcount


def test_two_retries_of_one_job_retry_it_once(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            job_id = insert_job(conn, state="failed", kind="race_c")
        with held(engine) as first:
            assert awa_sa.retry_job(first.conn, job_id) is not None
            second = in_thread(lambda: awa_sa.retry_job(engine, job_id))
            wait_until_blocked(engine, first.pid, pending=[second])
            first.commit()
        assert second.result(timeout=20) is None
        assert _state(engine, job_id) == "available"
    finally:
        engine.dispose()


def test_a_retry_whose_key_another_job_holds_is_a_unique_conflict(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        key = b"retry-conflict"
        with engine.begin() as conn:
            # failed is not in the mask: the key is free for the holder, then taken by it.
            job_id = insert_job(
                conn, state="failed", kind="conflict", unique_key=key, unique_states="11111000"
            )
            holder = insert_holder(conn, key)
        with engine.connect() as conn:
            before = snapshot(conn)
        with engine.begin() as conn, pytest.raises(UniqueConflict):
            awa_sa.retry_job(conn, job_id)
        with engine.connect() as conn:
            assert snapshot(conn) == before
            claimed = conn.execute(
                sa.text("SELECT job_id FROM awa.job_unique_claims WHERE unique_key = :k"),
                {"k": key},
            ).scalar_one()
        assert claimed == holder
    finally:
        engine.dispose()
