"""The round trips docs/enqueue.md#duplicates states, counted as the driver sends them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import awa_sa


@pytest.fixture
def engine(real_db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(real_db_url, poolclass=sa.NullPool)
    yield engine
    engine.dispose()


def _sent(engine: sa.Engine) -> list[str]:
    sent: list[str] = []

    def record(*args: object) -> None:
        sent.append(str(args[2]).split()[0])

    sa.event.listen(engine, "before_cursor_execute", record)
    return sent


def test_round_trips_of_the_connection_form(engine: sa.Engine) -> None:
    sent = _sent(engine)
    with engine.connect() as conn:
        awa_sa.enqueue(conn, {"n": 1}, kind="plain")
        assert sent == ["SELECT"]
        sent.clear()
        awa_sa.enqueue(conn, {"n": 1}, kind="once", unique_opts={})
        assert sent == ["SAVEPOINT", "SELECT", "RELEASE"]
        sent.clear()
        with pytest.raises(awa_sa.DuplicateJob):
            awa_sa.enqueue(conn, {"n": 1}, kind="once", unique_opts={})
        assert sent == ["SAVEPOINT", "SELECT", "ROLLBACK", "SELECT"]
        sent.clear()
        batch = [
            awa_sa.NewJob({"n": 2}, kind="plain"),
            awa_sa.NewJob({"n": 1}, kind="once", unique_opts={}),
        ]
        awa_sa.enqueue_many(conn, batch, on_duplicate="skip")
        assert sent == [
            "SELECT",  # the routing read: canonical, so straight into the tables
            *["SAVEPOINT", "WITH", "ROLLBACK"],  # the batch meets the conflict
            "SAVEPOINT",  # the batch again, one job at a time
            "SELECT",  # the plain job
            *["SAVEPOINT", "SELECT", "ROLLBACK", "SELECT"],  # the duplicate, and its holder
            "RELEASE",
        ]
        conn.commit()


def test_round_trips_of_the_engine_form(engine: sa.Engine) -> None:
    sent = _sent(engine)
    awa_sa.enqueue(engine, {"n": 1}, kind="once", unique_opts={})
    assert sent == ["SELECT"]  # inside BEGIN and COMMIT, which the driver sends itself
    sent.clear()
    with pytest.raises(awa_sa.DuplicateJob):
        awa_sa.enqueue(engine, {"n": 1}, kind="once", unique_opts={})
    assert sent == ["SELECT", "SAVEPOINT", "SELECT", "ROLLBACK", "SELECT"]
