"""Input judged without the database is refused before a connection is even checked out.

The engine points at a port nothing listens on, so a connection attempt would fail with a
driver error, not the ``ValidationError`` each case expects; the suite's recorder, listening for
checkouts, BEGINs and statements, says so too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from recording import recording
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import awa_sa.asyncio as awa_async
from awa_sa import (
    RetryAfter,
    RetryBackoff,
    Snooze,
    ValidationError,
    cancel_by_unique_key,
    reschedule_canonical_attempt,
)

NOWHERE = "postgresql+psycopg://nobody@127.0.0.1:1/nothing"


@pytest.fixture
def untouched() -> Iterator[sa.Engine]:
    """An engine with no server behind it, failing the test if a connection is checked out."""
    engine = sa.create_engine(NOWHERE)
    with recording(engine, events=("checkout", "begin")) as seen:
        yield engine
    engine.dispose()
    assert seen == []


NON_FINITE = [math.nan, math.inf, -math.inf]
NOT_A_NUMBER: list[Any] = [True, "30", None, 10**400]


@pytest.mark.parametrize("make", [Snooze, RetryAfter])
def test_kinds_refuse_bad_delays_when_built(make: Any) -> None:
    for delay in NON_FINITE + NOT_A_NUMBER:
        with pytest.raises(ValidationError):
            make(delay)


def _smuggled(delay: float) -> Snooze:
    """A Snooze whose delay bypassed the constructor check."""
    kind = Snooze(1.0)
    object.__setattr__(kind, "delay_secs", delay)
    return kind


def _circular() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


BAD_JSON: list[Any] = [
    object(),
    {1, 2},
    math.nan,
    {"a": [math.inf]},
    "\ud800",  # a lone surrogate: not UTF-8
    "a\x00b",  # jsonb cannot store U+0000
    {"k\x00": 1},
    _circular(),
    b"bytes",
]


def test_refused_before_the_database(untouched: sa.Engine) -> None:
    engine = untouched
    job = 1
    for delay in NON_FINITE:
        with pytest.raises(ValidationError, match="finite"):
            reschedule_canonical_attempt(engine, job, 1, _smuggled(delay))
    # Finite but beyond what run_at (and interval) can hold: refused, not left to overflow.
    for delay in (1e300, 1e12):
        with pytest.raises(ValidationError, match="run_at"):
            reschedule_canonical_attempt(engine, job, 1, Snooze(delay))
    # Negative: Awa's worker never sends one (its delays are durations).
    for delay in (-1e-9, -1.0, -1e12, -1e300):
        with pytest.raises(ValidationError, match="negative"):
            reschedule_canonical_attempt(engine, job, 1, _smuggled(delay))
    for value in BAD_JSON:
        with pytest.raises(ValidationError, match="error"):
            reschedule_canonical_attempt(engine, job, 1, RetryBackoff(), error=value)
        with pytest.raises(ValidationError, match="progress"):
            reschedule_canonical_attempt(engine, job, 1, RetryBackoff(), progress=value)
    # Below, wrong types on purpose (hence each `type: ignore[arg-type]`): a caller without a
    # type checker can pass them, and the call must refuse them before touching the database.
    for bad_int in (True, 1.0, "1", None, 2**63, -(2**63) - 1):
        with pytest.raises(ValidationError, match="job_id"):
            reschedule_canonical_attempt(engine, bad_int, 1, RetryBackoff())  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="run_lease"):
            reschedule_canonical_attempt(engine, job, bad_int, RetryBackoff())  # type: ignore[arg-type]
    for kind in ("snooze", Snooze, None, 30.0):
        with pytest.raises(ValidationError, match="kind"):
            reschedule_canonical_attempt(engine, job, 1, kind)  # type: ignore[arg-type]
    # A raw driver connection needs a server: tests/integration/test_drivers.py refuses those.
    for bind, name in ((str(engine.url), "str"), (None, "NoneType"), (engine.pool, "QueuePool")):
        with pytest.raises(ValidationError, match=f"bind must be .*, got {name}$"):
            reschedule_canonical_attempt(bind, job, 1, RetryBackoff())  # type: ignore[arg-type]


def test_cancel_by_unique_key_refuses_before_the_database(untouched: sa.Engine) -> None:
    # Wrong types on purpose (hence each `type: ignore[arg-type]`), as above.
    for bad in (None, 1, b"kind", "a\x00b"):
        with pytest.raises(ValidationError, match="kind"):
            cancel_by_unique_key(untouched, bad)  # type: ignore[arg-type]
        if bad is not None:
            with pytest.raises(ValidationError, match="queue"):
                cancel_by_unique_key(untouched, "k", queue=bad)  # type: ignore[arg-type]
    for bucket in (True, 1.0, "1", 2**63, -(2**63) - 1):
        with pytest.raises(ValidationError, match="period_bucket"):
            cancel_by_unique_key(untouched, "k", period_bucket=bucket)  # type: ignore[arg-type]
    for value in BAD_JSON:
        with pytest.raises(ValidationError, match="args"):
            cancel_by_unique_key(untouched, "k", args=value)


async def test_async_refuses_before_the_database(untouched: sa.Engine) -> None:
    # A sync bind to the async face and the reverse: wrong types on purpose (hence the ignores).
    with pytest.raises(ValidationError, match="bind"):
        await awa_async.reschedule_canonical_attempt(untouched, 1, 1, RetryBackoff())  # type: ignore[arg-type]
    async_engine = create_async_engine(untouched.url)
    try:
        with pytest.raises(ValidationError, match="bind"):
            reschedule_canonical_attempt(async_engine, 1, 1, RetryBackoff())  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="finite"):
            await awa_async.reschedule_canonical_attempt(async_engine, 1, 1, _smuggled(math.nan))
        with pytest.raises(ValidationError, match="error"):
            await awa_async.reschedule_canonical_attempt(
                async_engine, 1, 1, RetryBackoff(), error=object()
            )
    finally:
        await async_engine.dispose()


async def test_a_bind_of_the_wrong_face_is_pointed_to_the_right_module(
    untouched: sa.Engine,
) -> None:
    async_engine = create_async_engine(untouched.url)
    try:
        async with AsyncSession(async_engine) as async_session:
            with pytest.raises(ValidationError, match=r"got AsyncSession \(use awa_sa.asyncio"):
                reschedule_canonical_attempt(async_session, 1, 1, RetryBackoff())  # type: ignore[arg-type]
        with Session(untouched) as session:
            with pytest.raises(ValidationError, match=r"got Session \(use the awa_sa functions"):
                await awa_async.reschedule_canonical_attempt(session, 1, 1, RetryBackoff())  # type: ignore[arg-type]
            # A sync Session is a bind: only the input is refused, before its autobegin.
            with pytest.raises(ValidationError, match="finite"):
                reschedule_canonical_attempt(session, 1, 1, _smuggled(math.nan))
            assert not session.in_transaction()
        with Session() as unbound, pytest.raises(ValidationError, match="has no engine to run on"):
            reschedule_canonical_attempt(unbound, 1, 1, RetryBackoff())
        async with AsyncSession() as unbound_async:
            with pytest.raises(ValidationError, match="has no engine to run on"):
                await awa_async.reschedule_canonical_attempt(unbound_async, 1, 1, RetryBackoff())
    finally:
        await async_engine.dispose()
    with pytest.raises(ValidationError, match=r"Engine, Connection or Session, got str\Z"):
        reschedule_canonical_attempt("postgresql://", 1, 1, RetryBackoff())  # type: ignore[arg-type]
