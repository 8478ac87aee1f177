"""awa-sa's enqueue writes the rows and NOTIFYs awa-pg 0.6.9's ``Client.insert`` writes.

Twin clones of the ``awa migrate`` template, in the same storage phase: awa-pg enqueues the
jobs on one, awa-sa on the other, in the same order, one transaction each as awa-pg's client
does. Every row of every table of Awa's schemas must then be the same (timestamps masked, the
given ``run_at`` compared apart), and the listeners must have heard the same notifications.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from enqueuing import CHANNELS, FUTURE, JOBS, Twins, listening, marks_as_sets, snapshot, twins
from runtimes import pg_url

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres

PHASES = ["canonical", "prepared", "mixed_transition", "active"]


@pytest.fixture(params=PHASES)
def pair(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
    real_template: str,
) -> Iterator[Twins]:
    yield from twins(pg, clone_database, real_template, request.param)


@pytest.fixture(params=["canonical", "prepared"])
def unrouted(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
    real_template: str,
) -> Iterator[Twins]:
    """Twins where routing is canonical: a batch goes to the producer function. Once routing
    points at queue storage a batch is written as ``enqueue_many_copy`` writes it
    (test_enqueue_bulk_twins.py)."""
    yield from twins(pg, clone_database, real_template, request.param)


def _awa_pg_insert(url: str) -> list[tuple[int, str, str]]:
    client = awa.Client(pg_url(url))
    try:
        out = []
        for args, options in JOBS:
            job = client.insert(args, **options)
            out.append((job.id, str(job.state), job.run_at))
        return out
    finally:
        client.close()


def _as_utc(stamp: str | datetime) -> datetime:
    value = datetime.fromisoformat(stamp) if isinstance(stamp, str) else stamp
    return value


def test_rows_and_notifies_are_awa_pgs(pair: Twins) -> None:
    heard: dict[str, Any] = {}
    with listening(pair.awa_pg.url, CHANNELS) as theirs:
        made = _awa_pg_insert(pair.awa_pg.url)
        heard["awa-pg"] = theirs.drain()
    with listening(pair.awa_sa.url, CHANNELS) as ours:
        rows = [awa_sa.enqueue(pair.awa_sa.engine, args, **options) for args, options in JOBS]
        heard["awa-sa"] = ours.drain()

    assert heard["awa-sa"] == heard["awa-pg"]
    assert snapshot(pair.awa_sa.engine) == snapshot(pair.awa_pg.engine)
    assert [r.id for r in rows] == [job_id for job_id, _, _ in made]
    for row, (_, state, run_at), (args, options) in zip(rows, made, JOBS, strict=True):
        assert row.state == state.lower()
        assert row.args == args
        if "run_at" in options:
            assert row.run_at == options["run_at"] == _as_utc(run_at)


def test_a_batch_writes_what_one_by_one_writes(unrouted: Twins) -> None:
    """One statement for the batch after the routing read, straight into the tables through
    their triggers: the same rows, claims and NOTIFYs as single enqueues (and as awa-pg's),
    the dirty marks once per statement rather than once per job."""
    pair = unrouted
    statements: list[str] = []
    engine = pair.awa_sa.engine
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    jobs = [awa_sa.NewJob(args, **options) for args, options in JOBS]
    with listening(pair.awa_sa.url, CHANNELS) as ours:
        rows = awa_sa.enqueue_many(engine, jobs)
        heard = ours.drain()
    assert len(statements) == 2  # the Engine form: the routing read, no savepoint
    assert "insert_job_compat" not in statements[1]
    with listening(pair.awa_pg.url, CHANNELS) as theirs:
        _awa_pg_insert(pair.awa_pg.url)
        assert theirs.drain() == heard
    assert marks_as_sets(snapshot(engine)) == marks_as_sets(snapshot(pair.awa_pg.engine))
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    _answered_as_stored(engine, rows)


@dataclass
class ShipOrder:
    order: int


BULK: list[tuple[list[Any], dict[str, Any], str]] = [
    ([{"to": f"u{n}@example.com", "n": n} for n in range(3)], {"kind": "send_email"}, "shared"),
    (
        [ShipOrder(n) for n in range(2)],
        {
            "queue": "ship",
            "priority": 1,
            "max_attempts": 3,
            "tags": ["b", "a"],
            "metadata": {"m": 1},
            "run_at": FUTURE,
            "ordering_key": "customer-7",
        },
        "shared",
    ),
    ([{"n": n, "f": 1e-7} for n in range(2)], {"kind": "exponent"}, "objects"),
    ([{"n": n} for n in range(2)], {"kind": "once", "unique_opts": {"by_queue": True}}, "objects"),
]
"""Lists of args under one set of keywords, as awa-pg's ``insert_many_copy`` takes them, and
the batch shape awa-sa sends each as."""


def test_a_batch_of_args_writes_what_insert_many_copy_writes(unrouted: Twins) -> None:
    pair = unrouted
    client = awa.Client(pg_url(pair.awa_pg.url))
    try:
        with listening(pair.awa_pg.url, CHANNELS) as theirs:
            made = [client.insert_many_copy(items, **options) for items, options, _ in BULK]
            heard_theirs = theirs.drain()
    finally:
        client.close()
    statements: list[str] = []
    engine = pair.awa_sa.engine
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with listening(pair.awa_sa.url, CHANNELS) as ours:
        rows = [awa_sa.enqueue_many(engine, items, **options) for items, options, _ in BULK]
        assert ours.drain() == heard_theirs

    assert marks_as_sets(snapshot(engine)) == marks_as_sets(snapshot(pair.awa_pg.engine))
    assert [[r.id for r in batch] for batch in rows] == [[j.id for j in jobs] for jobs in made]
    assert [[r.kind for r in batch] for batch in rows] == [[j.kind for j in jobs] for jobs in made]
    shared = [n for n, (_, _, shape) in enumerate(BULK) if shape == "shared"]
    inserts = statements[1::2]  # each after its routing read
    assert ["jsonb_array_elements" in inserts[n] for n in range(len(BULK))] == [
        n in shared for n in range(len(BULK))
    ]


def _answered_as_stored(engine: sa.Engine, got: list[Any]) -> None:
    """Each answer is its job's row: id, kind, queue, priority, args, ``run_at``, ``created_at``."""
    with engine.connect() as conn:
        stored = {
            row[0]: tuple(row)
            for row in conn.execute(
                sa.text(
                    "SELECT id, kind, queue, priority, args, run_at, created_at FROM awa.jobs"
                    " WHERE id = ANY(:ids)"
                ),
                {"ids": [job.id for job in got]},
            )
        }
    answered = [(j.id, j.kind, j.queue, j.priority, j.args, j.run_at, j.created_at) for j in got]
    assert answered == [stored[job.id] for job in got]
