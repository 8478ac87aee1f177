"""The batch API: the outcomes and rows of one-by-one calls, in a constant number of statements.

The reference is the single call applied to each item in turn, inside one transaction, on a clone
of the same database: every table the operation can touch is read back from both databases and
compared. Values the two transactions cannot share are normalised: ``now()`` (each database has
its own transaction) becomes a marker and run_at an offset from it; the cancelled row's
``clock_timestamp()``, the delta's ``recorded_at`` and the lifecycle error's worker-clock ``at``
are dropped. Dirty marks are compared as sets: a batch appends one per statement, not per item.
Backoff jobs use attempts of 17 and more, where the backoff is exactly the 24 h cap.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import (
    CALLBACK_VALUES,
    CANONICAL_TABLES,
    QS_TABLES,
    advance_all,
    advance_sequence,
    insert_holder,
    insert_job,
    sequences,
)
from recording import recording, step
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa.asyncio as awa_async
import awa_sa_schema
from awa_sa import (
    Attempt,
    AwaSAError,
    CancelledDuplicate,
    Kind,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    UniqueConflict,
    ValidationError,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
)

SCHEMAS = ("awa", "awa_qs")
ROUTINGS = [  # (phase, schema); "missing" deletes the transition singleton
    ("canonical", "awa_qs"),
    ("missing", "awa_qs"),
    ("mixed_transition", "awa_qs"),
    ("active", "awa"),
]
SUCCESSOR_TABLES = {"awa.scheduled_jobs"} | {f"{s}.{t}" for s in SCHEMAS for t in QS_TABLES}
DROPPED = {("done_entries", "finalized_at"), ("queue_terminal_count_deltas", "recorded_at")}
MARKS = {"awa.admin_dirty_queue_marks", "awa.admin_dirty_kind_marks"}
NO_NOW = datetime(1, 1, 1, tzinfo=UTC)
"""For a snapshot outside any reschedule transaction: no value equals it."""


# -- running both ways and comparing ------------------------------------------------------


@dataclass
class Run:
    """What one way of applying the items returned and left behind."""

    outcomes: list[Any] | None
    error: type[Exception] | None
    tables: dict[str, Any]


def set_routing(conn: sa.Connection, phase: str, schema: str) -> None:
    if phase == "missing":
        conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
    else:
        awa_sa_schema.set_phase(conn, phase, schema)


def _normal_time(table: str, key: str, value: Any, now: datetime) -> Any:
    if not isinstance(value, str):
        return value
    at = datetime.fromisoformat(value)
    if at == now:
        return "now()"
    if key == "run_at" and table in SUCCESSOR_TABLES and abs(at - now) < timedelta(days=2):
        return f"now() + {(at - now).total_seconds()}s"  # written by this transaction
    return value


def _no_worker_clock(error: Any) -> Any:
    if isinstance(error, dict) and error.get("terminal") is True:
        return {k: v for k, v in error.items() if k != "at"}  # the lifecycle error
    return error


def _normal_row(table: str, row: dict[str, Any], now: datetime) -> str:
    short = table.split(".", 1)[1]
    out: dict[str, Any] = {}
    for key, value in row.items():
        if (short, key) in DROPPED:
            continue
        out[key] = value
        if key in ("run_at", "finalized_at", "touched_at"):
            out[key] = _normal_time(table, key, value, now)
        elif key == "payload" and short == "done_entries" and value is not None:
            out[key] = {**value, "errors": [_no_worker_clock(e) for e in value["errors"]]}
    return json.dumps(out, sort_keys=True)


def tables(conn: sa.Connection, now: datetime) -> dict[str, Any]:
    """Every row of every table the operation may touch, and every sequence, normalised."""
    names = list(CANONICAL_TABLES) + [f"{s}.{t}" for s in SCHEMAS for t in QS_TABLES]
    out: dict[str, Any] = {}
    for name in names:
        rows = conn.execute(sa.text(f"SELECT to_jsonb(t) FROM {name} t")).scalars()
        normal = [_normal_row(name, row, now) for row in rows]
        out[name] = set(normal) if name in MARKS else sorted(normal)
    out["sequences"] = sequences(conn, SCHEMAS)
    return out


def _normal_outcome(outcome: Outcome, now: datetime) -> Any:
    if isinstance(outcome, Rescheduled | Migrated):
        assert outcome.run_at.tzinfo is not None
        offset = (outcome.run_at - now).total_seconds()
        return (type(outcome).__name__, outcome.job_id, outcome.attempt, offset)
    if isinstance(outcome, CancelledDuplicate):
        return ("CancelledDuplicate", outcome.job_id)
    return type(outcome).__name__


def apply(engine: sa.Engine, items: list[Attempt], batch: bool) -> Run:
    """The items as one batch, or one call each, in one transaction of the Connection form."""
    now = NO_NOW
    try:
        with engine.begin() as conn:
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            if batch:
                outcomes = reschedule_canonical_attempts(conn, items)
            else:
                outcomes = [
                    reschedule_canonical_attempt(
                        conn, a.job_id, a.run_lease, a.kind, error=a.error, progress=a.progress
                    )
                    for a in items
                ]
        normal: list[Any] | None = [_normal_outcome(o, now) for o in outcomes]
        error = None
    except AwaSAError as exc:
        normal, error, now = None, type(exc), NO_NOW
    with engine.connect() as conn:
        return Run(normal, error, tables(conn, now))


def compare(
    engine: sa.Engine, clone_database: Callable[[str], str], items: list[Attempt]
) -> list[Any]:
    """Apply *items* as a batch here and one by one on a clone; both must agree. The outcomes."""
    engine.dispose()  # a database can be cloned only without open connections
    # One pooled connection: a backend's first read of the planes loads the catalog entries of
    # their hundreds of partitions, and a backend per transaction paid that each time (issue 39).
    reference = sa.create_engine(clone_database(engine.url.database or ""), pool_size=1)
    with engine.connect() as conn:
        before = tables(conn, NO_NOW)
    try:
        expected = apply(reference, items, batch=False)
    finally:
        reference.dispose()
    actual = apply(engine, items, batch=True)
    assert actual.error == expected.error
    if expected.error is not None:
        # Nothing kept either way; sequences excepted (nextval is not transactional).
        for run in (expected, actual):
            assert {**run.tables, "sequences": []} == {**before, "sequences": []}
        return []
    assert actual.outcomes == expected.outcomes
    for name, rows in expected.tables.items():
        assert actual.tables[name] == rows, name
    assert actual.outcomes is not None
    return actual.outcomes


# -- a random mix --------------------------------------------------------------------------

MASKS = ("11111000", "11000000", "11001000", "11000010", "11001010", "00100000", "01111111")
HOLDER_MASKS = ("11000000", "11001000", "11001010", "11111110")


def _kind(rng: random.Random) -> Kind:
    delay = rng.choice([0.5, 30.0, 0.0, 3600.25, 45])
    kinds: list[Kind] = [Snooze(delay), RetryAfter(delay), RetryBackoff()]
    return rng.choice(kinds)


def _json(rng: random.Random) -> Any:
    return rng.choice([None, None, {"error": "boom", "attempt": 3}, [1, "two"], "text", 1e300])


def _job(conn: sa.Connection, rng: random.Random, keys: list[bytes]) -> tuple[int, int]:
    lease = rng.choice([1, 2, 7])
    kw: dict[str, Any] = {
        "queue": rng.choice(["q1", "q2"]),
        "kind": rng.choice(["k1", "k2"]),
        "priority": rng.choice([1, 2]),
        "attempt": rng.choice([17, 18, 30]),  # backoff is exactly the 24 h cap
        "run_lease": lease,
        "metadata": rng.choice(["{}", '{"tenant": "acme"}']),
        "tags": rng.choice([(), ("t1",), ("t1", "t2")]),
        "errors": rng.choice([None, (), ('{"error": "old", "attempt": 1}',)]),
        "progress": rng.choice([None, '{"page": 1}']),
        "finalized_at": rng.choice([None, "2020-01-01T00:00:00Z"]),
    }
    wired = rng.random() < 0.2
    if wired:
        kw["callbacks"] = [rng.choice(list(CALLBACK_VALUES))]
    # A conflict on the canonical path (where a wired job stays) fails the whole batch.
    if rng.random() < (0.15 if wired else 0.6):
        kw["unique_key"] = rng.choice(keys)
        kw["unique_states"] = rng.choice(MASKS)
    try:
        with conn.begin_nested():  # a running claim on a key another running job holds
            return insert_job(conn, **kw), lease
    except sa.exc.IntegrityError:
        kw["unique_states"] = "11000000"  # not claiming while running
        return insert_job(conn, **kw), lease


def random_mix(
    conn: sa.Connection, seed: int, holders: bool, few_keys: bool | None = None
) -> list[Attempt]:
    """Jobs of every shape, items of every kind, repeats, wrong leases, misses and holders.

    With few keys, rows of the batch share them (then it goes one attempt at a time); with
    many, rarely (the set-wise path). Left to the seed by default.
    """
    rng = random.Random(seed)
    few = rng.random() < 0.5 if few_keys is None else few_keys
    keys = [f"key-{seed}-{i}".encode() for i in range(3 if few else 40)]
    jobs = [_job(conn, rng, keys) for _ in range(rng.randint(6, 14))]
    misses = [(10**9 + seed, 1)]
    if holders:
        for key in rng.sample(keys, rng.randint(1, 4)):
            try:
                with conn.begin_nested():
                    misses.append((insert_holder(conn, key, rng.choice(HOLDER_MASKS)), 0))
            except sa.exc.IntegrityError:
                pass  # a running job holds it
    items: list[Attempt] = []
    for job, lease in jobs + misses:
        if rng.random() < 0.2:
            items.append(Attempt(job, lease + 100, _kind(rng)))  # wrong lease
        items.append(Attempt(job, lease, _kind(rng), error=_json(rng), progress=_json(rng)))
    items += [rng.choice(items) for _ in range(rng.randint(0, 3))]  # repeats
    rng.shuffle(items)
    return items


MIXES = [(seed, *ROUTINGS[seed % len(ROUTINGS)]) for seed in range(8)]  # two mixes a routing


@pytest.mark.parametrize(("seed", "phase", "schema"), MIXES, ids=[f"{s}-{p}" for s, p, _ in MIXES])
def test_random_batch_equals_one_by_one(
    engine: sa.Engine, clone_database: Callable[[str], str], seed: int, phase: str, schema: str
) -> None:
    with engine.begin() as conn:
        advance_all(conn)
        set_routing(conn, phase, schema)
        # Holders make the canonical path fail as a whole (a conflict there is an error).
        items = random_mix(conn, seed, holders=phase in ("mixed_transition", "active"))
    compare(engine, clone_database, items)


# -- hand-written cases --------------------------------------------------------------------


@pytest.fixture
def sent(engine: sa.Engine) -> Iterator[list[str]]:
    """Statements sent on *engine*, labelled by their step, plus BEGIN/COMMIT events."""
    with recording(engine, step, events=("begin", "commit")) as seen:
        yield seen


def test_empty_batch_touches_nothing(engine: sa.Engine, sent: list[str]) -> None:
    checkouts: list[object] = []
    event.listen(engine, "checkout", lambda *args: checkouts.append(args))
    assert reschedule_canonical_attempts(engine, []) == []
    assert reschedule_canonical_attempts(engine, iter(())) == []
    assert sent == []
    assert checkouts == []


def test_every_item_is_validated_first_and_named_by_index(
    engine: sa.Engine, sent: list[str]
) -> None:
    with engine.begin() as conn:
        job = insert_job(conn)
    sent.clear()
    good = Attempt(job, 1, Snooze(1))
    # Wrong types on purpose (hence the ignores): a caller without a type checker can pass them.
    cases: list[tuple[Any, str]] = [
        ([good, Attempt(job, 1, "snooze")], r"attempts\[1\]: kind must be"),  # type: ignore[arg-type]
        ([good, good, Attempt(job, 1, Snooze(1), error={1j})], r"attempts\[2\]: error is not"),
        ([good, Attempt(job, 2**63, Snooze(1))], r"attempts\[1\]: run_lease=.* bigint range"),
        ([good, (job, 1, Snooze(1))], r"attempts\[1\] must be an Attempt, got tuple"),
        ([Attempt(job, 1, Snooze(1e12))], r"attempts\[0\]: delay_secs=.* outside years"),
        (good, "attempts must be an iterable of Attempt, got Attempt"),
        ("abc", "attempts must be an iterable of Attempt, got str"),
    ]
    for attempts, message in cases:
        with pytest.raises(ValidationError, match=message):
            reschedule_canonical_attempts(engine, attempts)
    with pytest.raises(ValidationError, match="AsyncEngine"):  # the async face's bind, on purpose
        reschedule_canonical_attempts(create_async_engine(engine.url), [good])  # type: ignore[arg-type]
    assert sent == []
    assert reschedule_canonical_attempts(engine, [good]) != [Stale()]  # the job is untouched


@pytest.mark.parametrize(("phase", "schema"), ROUTINGS, ids=[p for p, _ in ROUTINGS])
def test_repeats_and_wrong_leases(
    engine: sa.Engine, clone_database: Callable[[str], str], phase: str, schema: str
) -> None:
    """The second of two equal items is Stale; a wrong lease is Stale before a right one."""
    with engine.begin() as conn:
        set_routing(conn, phase, schema)
        a, b, c = (insert_job(conn, run_lease=3) for _ in range(3))
    items = [
        Attempt(a, 3, Snooze(5)),
        Attempt(a, 3, RetryAfter(1)),
        Attempt(b, 4, RetryBackoff()),
        Attempt(b, 3, Snooze(5), error={"e": 1}),
        Attempt(b, 4, Snooze(5)),
        Attempt(c, 3, RetryAfter(7), progress={"p": 2}),
        Attempt(c, 2, RetryAfter(7)),
    ]
    outcomes = compare(engine, clone_database, items)
    moved = Rescheduled if phase in ("canonical", "missing") else Migrated
    assert [o if o == "Stale" else o[0] for o in outcomes] == [
        moved.__name__,
        "Stale",
        "Stale",
        moved.__name__,
        "Stale",
        moved.__name__,
        "Stale",
    ]


def test_release_order_decides_canonically(
    engine: sa.Engine, clone_database: Callable[[str], str]
) -> None:
    """Two running jobs share a key; only the later holds it. Listed first, the claimer fails.

    Set-wise, both releases would come before both claims and the batch would succeed; one by
    one it must not. The batch detects the shared key and goes one attempt at a time.
    """
    with engine.begin() as conn:
        claimer = insert_job(conn, unique_key=b"k", unique_states="11000000")
        holder = insert_job(conn, unique_key=b"k", unique_states="00100000")  # running only
    items = [Attempt(claimer, 1, Snooze(1)), Attempt(holder, 1, RetryAfter(1))]
    with engine.begin() as conn, pytest.raises(UniqueConflict):
        reschedule_canonical_attempts(conn, items)
    outcomes = compare(engine, clone_database, items[::-1])
    assert [o[0] for o in outcomes] == ["Rescheduled", "Rescheduled"]


def test_release_order_decides_in_queue_storage(
    engine: sa.Engine, clone_database: Callable[[str], str], sent: list[str]
) -> None:
    """The same pair migrating: first in the list, the claimer loses the key and is cancelled."""
    with engine.begin() as conn:
        set_routing(conn, "mixed_transition", "awa_qs")
        claimer = insert_job(conn, unique_key=b"k", unique_states="11000000")
        holder = insert_job(conn, unique_key=b"k", unique_states="00100000")
    items = [Attempt(claimer, 1, Snooze(1)), Attempt(holder, 1, RetryAfter(1))]
    outcomes = compare(engine, clone_database, items)
    assert [o[0] for o in outcomes] == ["CancelledDuplicate", "Migrated"]
    assert sent.count("take+allocate") == 1 + 2  # the batch's take touched nothing; then one each


@pytest.mark.parametrize("schema", SCHEMAS)
def test_lost_claims_and_a_unique_violation_fall_back_per_item(
    engine: sa.Engine, clone_database: Callable[[str], str], sent: list[str], schema: str
) -> None:
    """A lost claim rolls the deferred-rows savepoint back and the rest is written again; a 23505
    that cannot be pinned on a row makes each row try alone. Both end as one by one would."""
    with engine.begin() as conn:
        set_routing(conn, "mixed_transition", schema)
        advance_sequence(conn, f"{schema}.job_id_seq", 500)
        jobs = [
            insert_job(conn, unique_key=b"a", unique_states="11111000"),
            insert_job(conn, unique_key=b"b", unique_states="11000010"),  # held, cancelled too
            insert_job(conn, unique_key=b"c", unique_states="11000000"),  # held
            insert_job(conn),  # gets id 503, which a deferred row already has
            insert_job(conn, unique_key=b"e", unique_states="11111000"),
        ]
        insert_holder(conn, b"b", "11000010")
        insert_holder(conn, b"c", "11000000")
        conn.execute(
            sa.text(
                f"INSERT INTO {schema}.deferred_jobs (job_id, kind, queue, args, state, priority,"
                " attempt, run_lease, max_attempts, run_at, created_at) VALUES (503, 'x', 'x',"
                " '{}', 'scheduled', 0, 0, 0, 1, '2000-01-01Z', '2000-01-01Z')"
            )
        )
    sent.clear()
    outcomes = compare(engine, clone_database, [Attempt(j, 1, Snooze(1)) for j in jobs])
    assert [o[:2] for o in outcomes] == [
        ("Migrated", 500),
        ("CancelledDuplicate", 501),
        ("CancelledDuplicate", 502),
        ("CancelledDuplicate", 503),
        ("Migrated", 504),
    ]
    batch = sent[sent.index("one statement") :]
    # The Connection form: the one statement locked the singleton; routing is read afresh.
    head = ["one statement", "routing+move", "savepoint", "open claims", "take+allocate"]
    assert batch[: len(head)] == head
    assert batch[len(head) : len(head) + 7] == [
        *["savepoint", "claim", "rollback to"],  # b and c lost
        *["savepoint", "claim", "deferred", "rollback to"],  # 503 taken: which row?
    ]


@pytest.mark.parametrize(("phase", "schema"), ROUTINGS[2:], ids=[p for p, _ in ROUTINGS[2:]])
def test_queue_storage_batch_statements_do_not_grow(
    engine: sa.Engine, sent: list[str], phase: str, schema: str
) -> None:
    """Taken, fallen through, claimed and written: each a single statement for the whole batch."""
    with engine.begin() as conn:
        set_routing(conn, phase, schema)
        jobs = [
            insert_job(conn, unique_key=f"u{i}".encode(), unique_states="11111000")
            for i in range(40)
        ]
        jobs += [insert_job(conn) for _ in range(40)]
        wired = [insert_job(conn, callbacks=["callback_on_fail"]) for _ in range(10)]
    items = [Attempt(j, 1, Snooze(1)) for j in jobs + wired] + [Attempt(10**9, 1, Snooze(1))]
    sent.clear()
    outcomes = reschedule_canonical_attempts(engine, items)
    assert [type(o) for o in outcomes] == [Migrated] * 80 + [Rescheduled] * 10 + [Stale]
    assert sent == [
        *["BEGIN", "one statement"],  # in autocommit: it says queue storage, so a transaction
        *["BEGIN", "lock", "routing+move", "savepoint", "open claims", "take+allocate", "move"],
        *["savepoint", "claim", "deferred", "release", "release", "COMMIT"],
    ]


def test_dirty_marks_are_appended_per_statement(engine: sa.Engine) -> None:
    """The one documented difference: one mark per distinct queue and kind per statement."""
    with engine.begin() as conn:
        jobs = [insert_job(conn, queue="q", kind="k") for _ in range(5)]
    count = sa.text(
        "SELECT (SELECT count(*) FROM awa.admin_dirty_queue_marks WHERE queue = 'q'),"
        " (SELECT count(*) FROM awa.admin_dirty_kind_marks WHERE kind = 'k')"
    )
    with engine.connect() as conn:
        before = conn.execute(count).one()
    reschedule_canonical_attempts(engine, [Attempt(j, 1, Snooze(1)) for j in jobs])
    with engine.connect() as conn:
        after = conn.execute(count).one()
    # One for the DELETE, one for the INSERT; one by one, that would be 10 of each.
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)


def test_backoff_per_row_from_the_database(engine: sa.Engine) -> None:
    """Each row gets its own awa.backoff_duration(attempt): 2^A to 1.25 * 2^A seconds."""
    with engine.begin() as conn:
        jobs = {a: insert_job(conn, attempt=a) for a in range(0, 12)}
    with engine.begin() as conn:
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
        items = [Attempt(j, 1, RetryBackoff()) for j in jobs.values()]
        outcomes = reschedule_canonical_attempts(conn, items)
    for attempt, outcome in zip(jobs, outcomes, strict=True):
        assert isinstance(outcome, Rescheduled)
        assert outcome.attempt == attempt
        assert 2.0**attempt <= (outcome.run_at - now).total_seconds() < 1.25 * 2.0**attempt


def test_errors_leave_nothing_behind(engine: sa.Engine) -> None:
    """A conflict on the canonical path fails the batch and aborts the caller's transaction, as
    the single call does; non-object metadata in queue storage fails it inside the savepoint."""
    with engine.begin() as conn:
        fine = insert_job(conn)
        conflict = insert_job(conn, unique_key=b"k", unique_states="11000000")
        insert_holder(conn, b"k", "11000000")
        bad = insert_job(conn, metadata="[1]")

    def unchanged(step: Callable[[sa.Connection], None]) -> None:
        with engine.connect() as conn:
            before = tables(conn, NO_NOW)
        with engine.connect() as conn:
            step(conn)
            conn.rollback()
        with engine.connect() as conn:
            assert {**tables(conn, NO_NOW), "sequences": []} == {**before, "sequences": []}

    def canonical_conflict(conn: sa.Connection) -> None:
        items = [Attempt(fine, 1, Snooze(1)), Attempt(conflict, 1, Snooze(1))]
        with pytest.raises(UniqueConflict):
            reschedule_canonical_attempts(conn, items)
        with pytest.raises(sa.exc.InternalError):  # in_failed_sql_transaction
            conn.execute(sa.text("SELECT 1"))

    def bad_metadata(conn: sa.Connection) -> None:
        items = [Attempt(fine, 1, Snooze(1)), Attempt(bad, 1, Snooze(1))]
        with pytest.raises(ValidationError, match=f"job {bad} has array"):
            reschedule_canonical_attempts(conn, items)
        conn.execute(sa.text("SELECT 1"))  # still usable

    unchanged(canonical_conflict)
    with engine.begin() as conn:
        set_routing(conn, "mixed_transition", "awa_qs")
    unchanged(bad_metadata)


async def test_async_batch(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        set_routing(conn, "mixed_transition", "awa_qs")
        jobs = [insert_job(conn) for _ in range(4)]
        wired = insert_job(conn, callbacks=["callback_id"])
    aengine = create_async_engine(engine.url)
    try:
        items = [Attempt(jobs[0], 1, Snooze(1)), Attempt(wired, 1, RetryAfter(1))]
        outcomes = await awa_async.reschedule_canonical_attempts(aengine, items)
        assert [type(o) for o in outcomes] == [Migrated, Rescheduled]
        async with aengine.connect() as conn:
            items = [Attempt(j, 1, RetryBackoff()) for j in jobs[1:]] + items
            outcomes = await awa_async.reschedule_canonical_attempts(conn, items)
            assert [type(o) for o in outcomes] == [Migrated] * 3 + [Stale, Stale]
            await conn.rollback()  # the caller's transaction: never committed by us
        outcomes = await awa_async.reschedule_canonical_attempts(aengine, items[:3])
        assert [type(o) for o in outcomes] == [Migrated] * 3
        assert await awa_async.reschedule_canonical_attempts(aengine, []) == []
        # A kind of None and a sync bind: wrong types on purpose (hence the ignores).
        with pytest.raises(ValidationError, match=r"attempts\[0\]"):
            await awa_async.reschedule_canonical_attempts(aengine, [Attempt(1, 1, None)])  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="sync binds"):
            await awa_async.reschedule_canonical_attempts(engine, items)  # type: ignore[arg-type]
        # Several batches at once, each on its own pooled connection.
        more = []
        with engine.begin() as conn:
            more = [[insert_job(conn) for _ in range(5)] for _ in range(4)]
        results = await asyncio.gather(
            *(
                awa_async.reschedule_canonical_attempts(
                    aengine, [Attempt(j, 1, Snooze(1)) for j in group]
                )
                for group in more
            )
        )
        assert [type(o) for r in results for o in r] == [Migrated] * 20
    finally:
        await aengine.dispose()


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
def test_batch_on_both_clusters(
    cluster: Cluster, clone_database: Callable[[str], str], phase: str
) -> None:
    """The random mix on the Alembic fixture and on a database built by ``awa migrate``."""
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        items = random_mix(conn, 100, holders=phase != "canonical", few_keys=False)
    outcomes = compare(cluster.engine, clone_database, items)
    assert len({o if isinstance(o, str) else o[0] for o in outcomes}) >= 2
