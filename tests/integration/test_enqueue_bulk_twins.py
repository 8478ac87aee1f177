"""awa-sa's ``enqueue_many`` on queue storage writes what awa-pg's ``enqueue_many_copy`` writes.

Twin clones of the ``awa migrate`` template in the same routed phase (mixed_transition, where
awa-pg 0.6.9's bulk producer writes too, and active): awa-pg's ``enqueue_many_copy`` sends
each batch to one, awa-sa's ``enqueue_many`` the same jobs to the other. After every batch,
every row of every table of Awa's schemas (timestamps masked), every sequence's position and
the NOTIFYs heard must be the same. The batches cover what ``enqueue_many_copy`` takes: plain
args, scheduled jobs (future and past), several lanes in one batch (per-job queues, their
names in an order where bytes and collation differ), jobs with and without an ordering key in
one lane (awa-pg numbers the keyed ones first), tags, metadata (a null inside it), unique jobs
(claimed as scheduled, as available, or not at all), one job, and :data:`BIG` (10,000;
``AWA_SA_BULK_TWINS_JOBS=100000`` for a batch of 100,000, some minutes); then duplicates
against existing jobs and inside a batch, which both refuse writing nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from enqueuing import FUTURE, PAST, Twins, listening, snapshot, twins
from runtimes import pg_url

import awa_sa
from awa_sa.testing.server import EmbeddedPostgres

BIG = int(os.environ.get("AWA_SA_BULK_TWINS_JOBS", "10000"))
"""The largest batch's size."""
QUEUES = ["default", "a", "b", "B", "é", "z", "big", "once", "later"]
CHANNELS = [f"awa:{queue}" for queue in QUEUES]

Batch = tuple[list[Any], dict[str, Any], list[dict[str, Any]] | None]

BATCHES: list[Batch] = [
    ([{"n": n, "to": f"u{n}@example.com"} for n in range(3)], {"kind": "plain"}, None),
    (
        [{"n": n} for n in range(8)],
        {"kind": "spread", "priority": 3},
        [
            {"queue": "b"},
            {"queue": "a"},
            {"queue": "B", "ordering_key": "k1"},
            {"queue": "é"},
            {"queue": "a", "ordering_key": "k2"},
            {"queue": "b"},
            {"queue": "z"},
            {"queue": "a", "ordering_key": b"\x00\xff"},
        ],
    ),
    ([{"n": n} for n in range(3)], {"kind": "later", "queue": "later", "run_at": FUTURE}, None),
    (
        [{"n": n} for n in range(2)],
        {"kind": "overdue", "run_at": PAST, "unique_opts": {}, "tags": ["p"]},
        None,
    ),
    (
        [{"n": n, "f": 1e-7, "s": "é\n"} for n in range(3)],
        {"kind": "described", "priority": 4, "tags": ["x", "é"], "metadata": {"a": {"b": None}}},
        None,
    ),
    (
        [{"n": n} for n in range(3)],
        {"kind": "once", "queue": "once", "unique_opts": {"by_queue": True, "by_period": 7}},
        None,
    ),
    ([{"n": 1}, {"n": 1}], {"kind": "loose", "unique_opts": {"states": 0b0000_0001}}, None),
    ([{"n": 0}], {"kind": "single", "priority": 1}, None),
    ([{"n": n} for n in range(BIG)], {"kind": "big", "queue": "big"}, None),
]
"""Each batch as ``enqueue_many_copy`` takes it: args, keywords, per-job ``opts``."""


@pytest.fixture(params=["mixed_transition", "active"])
def pair(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    clone_database: Callable[[str], str],
    real_template: str,
) -> Iterator[Twins]:
    yield from twins(pg, clone_database, real_template, request.param)


def sequences(engine: sa.Engine) -> dict[str, int | None]:
    """Every sequence of Awa's schemas and where it stands."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT schemaname || '.' || sequencename, last_value FROM pg_sequences "
                "WHERE schemaname IN ('awa', 'awa_qs')"
            )
        )
        return {str(row[0]): row[1] for row in found}


def ours(engine: sa.Engine, items: list[Any], options: dict[str, Any], opts: Any) -> list[Any]:
    """The batch as awa-sa takes it: a list of args, or a NewJob each where jobs differ."""
    if opts is None:
        return awa_sa.enqueue_many(engine, items, **options)
    jobs = [awa_sa.NewJob(a, **options, **o) for a, o in zip(items, opts, strict=True)]
    return awa_sa.enqueue_many(engine, jobs)


def _copy(client: awa.Client, items: list[Any], options: dict[str, Any], opts: Any) -> None:
    client.enqueue_many_copy(items, **options, **({"opts": opts} if opts else {}))


def _same(pair: Twins) -> None:
    theirs, mine = pair.awa_pg.engine, pair.awa_sa.engine
    assert sequences(mine) == sequences(theirs)
    assert snapshot(mine) == snapshot(theirs)


def test_every_batch_writes_what_enqueue_many_copy_writes(pair: Twins) -> None:
    client = awa.Client(pg_url(pair.awa_pg.url))
    try:
        for items, options, opts in BATCHES:
            with listening(pair.awa_pg.url, CHANNELS) as theirs:
                _copy(client, items, options, opts)
                heard = theirs.drain()
            with listening(pair.awa_sa.url, CHANNELS) as listener:
                got = ours(pair.awa_sa.engine, items, options, opts)
                assert listener.drain() == heard, options["kind"]
            _same(pair)
            assert len(got) == len(items)
            assert [job.args for job in got] == items
            _answered_as_stored(pair.awa_sa.engine, got)
        _mixed_is_two_calls(pair, client)
        _duplicates_are_refused_alike(pair, client)
    finally:
        client.close()
    _answers_are_the_rows(pair.awa_sa.engine)


def _mixed(n: int) -> dict[str, Any]:
    if n % 3 == 0:
        return {"run_at": FUTURE}
    return {"queue": "ab"[n % 2], **({"ordering_key": "k"} if n == 5 else {})}


MIXED = [({"n": n}, _mixed(n)) for n in range(12)]
"""Ready jobs in two lanes, one keyed, between scheduled ones: one batch of ``NewJob``s."""


def _mixed_is_two_calls(pair: Twins, client: awa.Client) -> None:
    """A batch of ready and scheduled jobs: ``enqueue_many_copy`` takes one ``run_at`` per call,
    so its twin is two calls, the ready jobs, then the scheduled ones, in input order (the
    order awa-sa draws a mixed batch's ids in). Same rows, ids, NOTIFYs and answers."""
    ready = [(args, opts) for args, opts in MIXED if "run_at" not in opts]
    later = [args for args, opts in MIXED if "run_at" in opts]
    jobs = [awa_sa.NewJob(args, kind="mixed", **opts) for args, opts in MIXED]
    with listening(pair.awa_pg.url, CHANNELS) as theirs:
        client.enqueue_many_copy([a for a, _ in ready], kind="mixed", opts=[o for _, o in ready])
        client.enqueue_many_copy(later, kind="mixed", run_at=FUTURE)
        heard = theirs.drain()
    with listening(pair.awa_sa.url, CHANNELS) as listener:
        got = awa_sa.enqueue_many(pair.awa_sa.engine, jobs)
        assert listener.drain() == heard
    _same(pair)
    assert [job.args for job in got] == [args for args, _ in MIXED]
    assert [job.state for job in got] == [
        "scheduled" if "run_at" in o else "available" for _, o in MIXED
    ]
    _answered_as_stored(pair.awa_sa.engine, got)


def _answered_as_stored(engine: sa.Engine, got: list[Any]) -> None:
    """Each answer is its job's row: id, kind, queue, priority, args, ``run_at``, ``created_at``."""
    with engine.connect() as conn:
        stored = {
            row[0]: tuple(row)
            for row in conn.execute(
                sa.text(
                    "SELECT job_id, kind, queue, priority, args, run_at, created_at"
                    " FROM awa_qs.ready_entries WHERE job_id = ANY(:ids) UNION ALL"
                    " SELECT job_id, kind, queue, priority, args, run_at, created_at"
                    " FROM awa_qs.deferred_jobs WHERE job_id = ANY(:ids)"
                ),
                {"ids": [job.id for job in got]},
            )
        }
    answered = [(j.id, j.kind, j.queue, j.priority, j.args, j.run_at, j.created_at) for j in got]
    assert answered == [stored[job.id] for job in got]


def _duplicates_are_refused_alike(pair: Twins, client: awa.Client) -> None:
    """A key held by an existing job, or twice in one batch: both refuse, nothing written."""
    options: dict[str, Any] = {
        "kind": "once",
        "queue": "once",
        "unique_opts": {"by_queue": True, "by_period": 7},
    }
    for items in ([{"n": 9}, {"n": 1}], [{"n": 10}, {"n": 11}, {"n": 10}]):
        with pytest.raises(awa.UniqueConflict):
            client.enqueue_many_copy(items, **options)
        with pytest.raises(awa_sa.DuplicateJob) as raised:
            awa_sa.enqueue_many(pair.awa_sa.engine, items, **options)
        assert raised.value.index == (1 if len(items) == 2 else 2)
        _same(pair)


def _answers_are_the_rows(engine: sa.Engine) -> None:
    """The ids answered are the rows written: ready and deferred, each once."""
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT job_id) FROM (SELECT job_id FROM "
                "awa_qs.ready_entries UNION ALL SELECT job_id FROM awa_qs.deferred_jobs) j"
            )
        ).one()
    assert stored[0] == stored[1] == sum(len(items) for items, _, _ in BATCHES) + len(MIXED)
