"""Decision-table rows 5-10 (routing flipped to a queue-storage schema), on a real cluster.

Routing names a schema in ``mixed_transition`` and ``active``; each is checked for the default
substrate ``awa`` and the named ``awa_qs``. Sequences are advanced to distinct values first, so a
fresh id proves which sequence it came from. Every assertion reads rows back.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import (
    CALLBACK_VALUES,
    KINDS,
    Called,
    advance_all,
    call,
    check_run_at,
    duplicate_mask,
    expected_payload,
    insert_holder,
    insert_job,
    next_state,
    row_text,
    rows,
    scalar,
    seq_next,
    snapshot_of,
)

from awa_sa import (
    CancelledDuplicate,
    Kind,
    Migrated,
    Rescheduled,
    Snooze,
    Stale,
    UniqueConflict,
    reschedule_canonical_attempt,
)

QS_PHASES = [
    ("mixed_transition", "awa"),
    ("mixed_transition", "awa_qs"),
    ("active", "awa"),
]
FIRST_ID = {"awa": 5000, "awa_qs": 7000}
CARRIED = [
    "kind",
    "queue",
    "args",
    "priority",
    "run_lease",
    "max_attempts",
    "attempted_at",
    "created_at",
    "unique_key",
    "unique_states",
]
LIFECYCLE = "rescheduled as duplicate: unique claim held by a newer job"
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3}|\.\d{6}|\.\d{9})?\+00:00$")


class Routed:
    """A cluster whose routing points at ``schema``."""

    def __init__(self, engine: sa.Engine, schema: str) -> None:
        self.engine = engine
        self.schema = schema
        self.other = "awa_qs" if schema == "awa" else "awa"

    def before(self, job_id: int) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = row_text(conn, "awa.jobs_hot", "id = :i", i=job_id)
        assert row is not None
        return row


@pytest.fixture(params=QS_PHASES, ids=[f"{p}-{s}" for p, s in QS_PHASES])
def routed(cluster: Any, request: pytest.FixtureRequest) -> Routed:
    phase, schema = request.param
    cluster.set_phase(phase, schema)
    with cluster.engine.begin() as conn:
        advance_all(conn)
    return Routed(cluster.engine, schema)


def _claims(engine: sa.Engine) -> set[tuple[bytes, int]]:
    with engine.connect() as conn:
        claims = rows(conn, "SELECT * FROM awa.job_unique_claims")
    return {(bytes(r["unique_key"]), r["job_id"]) for r in claims}


def _jsonb(conn: sa.Connection, value: str | None) -> str | None:
    return None if value is None else scalar(conn, "SELECT CAST(:v AS jsonb)::text", v=value)


def _successor_attempt(kind: Kind, before: dict[str, Any]) -> int:
    return int(before["attempt"]) - (1 if isinstance(kind, Snooze) else 0)


def _check_taken(conn: sa.Connection, called: Called, before: dict[str, Any]) -> None:
    """The canonical row is gone from both canonical tables; only the DELETE's marks appeared."""
    job_id = int(before["id"])
    assert row_text(conn, "awa.jobs_hot", "id = :i", i=job_id) is None
    assert row_text(conn, "awa.scheduled_jobs", "id = :i", i=job_id) is None
    assert sorted((t, v) for (t, v, _) in called.new_marks.elements()) == [
        ("admin_dirty_kind_marks", before["kind"]),
        ("admin_dirty_queue_marks", before["queue"]),
    ]


def _check_migrated(
    r: Routed,
    kind: Kind,
    called: Called,
    *,
    before: dict[str, Any],
    new_id: int,
    payload: str | None,
) -> None:
    """Rows 7/8: a deferred job under a fresh id, per docs/contract.md#deferred."""
    outcome = called.outcome
    attempt = _successor_attempt(kind, before)
    assert isinstance(outcome, Migrated)
    assert (outcome.job_id, outcome.attempt) == (new_id, attempt)
    with r.engine.connect() as conn:
        _check_taken(conn, called, before)
        table = f"{r.schema}.deferred_jobs"
        row = row_text(conn, table, "job_id = :i", i=new_id)
        typed = rows(conn, f"SELECT run_at, finalized_at FROM {table} WHERE job_id = :i", i=new_id)
        assert row is not None
        assert {c: row[c] for c in CARRIED} == {c: before[c] for c in CARRIED}
        assert row["state"] == next_state(kind)
        assert int(row["attempt"]) == attempt
        assert typed[0]["run_at"] == outcome.run_at
        check_run_at(kind, int(before["attempt"]), outcome.run_at, called.now)
        if isinstance(kind, Snooze):
            assert typed[0]["finalized_at"] is None  # even when the running row had one
        else:
            assert typed[0]["finalized_at"] == called.now
        assert _jsonb(conn, row["payload"]) == _jsonb(conn, payload)


def _check_cancelled(
    r: Routed,
    kind: Kind,
    called: Called,
    *,
    before: dict[str, Any],
    new_id: int,
    payload_errors: list[str],
    progress: str | None,
    keeps_key: bool,
    worker_window: tuple[float, float],
) -> None:
    """Rows 9/10: a cancelled done row, its +1 delta, the lane; the successor never ran."""
    assert called.outcome == CancelledDuplicate(new_id)
    attempt = _successor_attempt(kind, before)
    done = f"{r.schema}.done_entries"
    with r.engine.connect() as conn:
        _check_taken(conn, called, before)
        assert (
            rows(conn, f"SELECT * FROM {r.schema}.deferred_jobs WHERE job_id = :i", i=new_id) == []
        )
        row = row_text(conn, done, "job_id = :i", i=new_id)
        assert row is not None
        typed = rows(conn, f"SELECT run_at, finalized_at FROM {done} WHERE job_id = :i", i=new_id)[
            0
        ]
        partition = scalar(
            conn, f"SELECT tableoid::regclass::text FROM {done} WHERE job_id = :i", i=new_id
        )
        assert partition == f"{r.schema}.done_entries_5"
        expect = {
            "ready_slot": "5",
            "ready_generation": "7",
            "state": "cancelled",
            "attempt": str(attempt),
            "lane_seq": str(-new_id),
            "enqueue_shard": "0",
        }
        assert {k: row[k] for k in expect} == expect
        kept = ("unique_key", "unique_states")
        if keeps_key:
            assert {k: row[k] for k in kept} == {k: before[k] for k in kept}
        else:
            assert {k: row[k] for k in kept} == dict.fromkeys(kept)
        carried = [c for c in CARRIED if c not in kept and c != "priority"] + ["priority"]
        assert {c: row[c] for c in carried} == {c: before[c] for c in carried}
        check_run_at(kind, int(before["attempt"]), typed["run_at"], called.now)
        assert typed["finalized_at"] > called.now  # clock_timestamp(), not now()

        lifecycle = json.loads(row["payload"])["errors"][-1]
        at = lifecycle["at"]
        assert RFC3339.match(at), at
        assert lifecycle == {"error": LIFECYCLE, "attempt": attempt, "at": at, "terminal": True}
        stamp = scalar(conn, "SELECT extract(epoch FROM CAST(:a AS timestamptz))", a=at)
        assert worker_window[0] <= float(stamp) <= worker_window[1]
        meta = before["metadata"]
        tags = json.loads(before["tags"])
        errors = [*payload_errors, json.dumps(lifecycle)]
        expected = expected_payload(meta, tags, errors, progress)
        assert _jsonb(conn, row["payload"]) == _jsonb(conn, expected)

        deltas = rows(
            conn,
            f"SELECT ready_slot, ready_generation, queue, priority, enqueue_shard, counter_bucket,"
            f" terminal_delta FROM {r.schema}.queue_terminal_count_deltas"
            " WHERE counter_bucket = :b AND queue = :q",
            b=new_id % 256,
            q=before["queue"],
        )
        priority = int(before["priority"])
        assert deltas == [
            {
                "ready_slot": 5,
                "ready_generation": 7,
                "queue": before["queue"],
                "priority": priority,
                "enqueue_shard": 0,
                "counter_bucket": new_id % 256,
                "terminal_delta": 1,
            }
        ]
        _check_lane(conn, r.schema, before["queue"], priority)


def _check_lane(conn: sa.Connection, schema: str, queue: str, priority: int) -> None:
    """Lane (queue, priority, 0) ensured: three rows with defaults and both sequences."""
    lane = rows(
        conn,
        f"SELECT next_seq, claim_seq, pruned_completed_count FROM {schema}.queue_lanes"
        " WHERE queue = :q AND priority = :p",
        q=queue,
        p=priority,
    )
    assert lane == [{"next_seq": 1, "claim_seq": 1, "pruned_completed_count": 0}]
    digest = hashlib.md5(f"{queue}:{priority}:0".encode()).hexdigest()
    for head, seq in (("queue_enqueue_heads", "enqueue"), ("queue_claim_heads", "claim")):
        names = rows(
            conn,
            f"SELECT seq_name FROM {schema}.{head}"
            " WHERE queue = :q AND priority = :p AND enqueue_shard = 0",
            q=queue,
            p=priority,
        )
        assert len(names) == 1
        assert digest in names[0]["seq_name"]
        exists = scalar(
            conn,
            "SELECT count(*) FROM pg_sequences WHERE schemaname = :s AND sequencename = :n",
            s=schema,
            n=f"queue_{seq}_seq_{digest}",
        )
        assert exists == 1


# -- row 5 --------------------------------------------------------------------------------


def test_row5_stale_changes_nothing(routed: Routed) -> None:
    with routed.engine.begin() as conn:
        running = insert_job(conn, run_lease=5, unique_key=b"k", unique_states="11111000")
        waiting = insert_job(conn, state="waiting_external")
        wired = insert_job(conn, run_lease=5, callbacks=["callback_id"])
    before = snapshot_of(routed.engine)
    for kind in KINDS.values():
        for job, lease in ((running, 4), (waiting, 1), (wired, 4), (999_999, 1)):
            assert call(routed.engine, job, kind, lease=lease).outcome == Stale()
    assert snapshot_of(routed.engine) == before  # nor any id sequence value


# -- row 6 --------------------------------------------------------------------------------


def test_row6_callback_wiring_stays_canonical(routed: Routed) -> None:
    jobs: dict[tuple[str, str], int] = {}
    with routed.engine.begin() as conn:
        for name, kind in KINDS.items():
            for column in CALLBACK_VALUES:
                jobs[name, column] = insert_job(conn, callbacks=[column])
            free = duplicate_mask(kind, claims_cancelled=False)
            key = f"free-{name}".encode()
            jobs[name, "free"] = insert_job(
                conn, callbacks=list(CALLBACK_VALUES), unique_key=key, unique_states=free
            )
            key = f"dup-{name}".encode()
            jobs[name, "dup"] = insert_job(
                conn, callbacks=["callback_filter"], unique_key=key, unique_states=free
            )
            insert_holder(conn, key, free)
    for name, kind in KINDS.items():
        for column in [*CALLBACK_VALUES, "free"]:
            job = jobs[name, column]
            before = routed.before(job)
            outcome = call(routed.engine, job, kind).outcome
            assert isinstance(outcome, Rescheduled)
            assert outcome.job_id == job  # the same canonical id
            with routed.engine.connect() as conn:
                after = row_text(conn, "awa.scheduled_jobs", "id = :i", i=job)
            assert after is not None
            assert {c: after[c] for c in CALLBACK_VALUES} == {c: before[c] for c in CALLBACK_VALUES}
            assert after["state"] == next_state(kind)
        frozen = snapshot_of(routed.engine)
        with pytest.raises(UniqueConflict) as info:  # row 4 behaviour, also under queue storage
            call(routed.engine, jobs[name, "dup"], kind)
        assert info.value.constraint == "idx_awa_jobs_unique"
        assert snapshot_of(routed.engine) == frozen
    assert {k for k, j in _claims(routed.engine) if k.startswith(b"free")} == {
        f"free-{n}".encode() for n in KINDS
    }
    with routed.engine.connect() as conn:
        for schema in ("awa", "awa_qs"):
            assert seq_next(conn, f"{schema}.job_id_seq") == FIRST_ID[schema]
            assert rows(conn, f"SELECT * FROM {schema}.deferred_jobs") == []


# -- rows 7 and 8 -------------------------------------------------------------------------


def test_rows7_8_migrated_under_a_fresh_id(routed: Routed) -> None:
    new_id = FIRST_ID[routed.schema]
    claims: set[tuple[bytes, int]] = set()
    for name, kind in KINDS.items():
        claims |= _rows7_8_for(routed, name, kind, new_id)
        new_id += 5
    # Row 7: no claim for the successor (the DELETE released the running claim).
    # Row 8: the claim belongs to the fresh id.
    assert _claims(routed.engine) == claims
    with routed.engine.connect() as conn:
        assert seq_next(conn, f"{routed.schema}.job_id_seq") == new_id
        assert seq_next(conn, f"{routed.other}.job_id_seq") == FIRST_ID[routed.other]
        assert seq_next(conn, "awa.jobs_id_seq") == 1000 + 5 * len(KINDS)
        assert rows(conn, "SELECT * FROM awa.scheduled_jobs") == []
        assert rows(conn, f"SELECT * FROM {routed.schema}.done_entries") == []


def _rows7_8_for(r: Routed, name: str, kind: Kind, new_id: int) -> set[tuple[bytes, int]]:
    """Five attempts of one kind, migrated in order from *new_id*; returns the claims due."""
    free_mask = duplicate_mask(kind, claims_cancelled=False)
    key = name.encode()
    with r.engine.begin() as conn:
        full = insert_job(
            conn,
            args='{"to": "a@example.com", "big": 1e400}',
            metadata='{"tenant": "acme", "d": 0.1000000000000000000001, "n": 1e400}',
            tags=["t1", "t2"],
            errors=['{"old": 1}'],
            attempt=3,
            progress='{"old": true}',
            finalized_at="2020-01-01 00:00:00+00",
        )
        bare = insert_job(conn, progress='{"old": true}', errors=[])
        released = insert_job(conn, unique_key=key + b"-released", unique_states="00100000")
        free = insert_job(conn, unique_key=key + b"-free", unique_states=free_mask)
        moved = insert_job(conn, unique_key=key + b"-moved", unique_states="11111000")

    before = r.before(full)
    error = {"error": "boom", "attempt": 3, "n": 10**30}
    called = call(r.engine, full, kind, error=error, progress={"percent": 40})
    payload = expected_payload(
        before["metadata"], ["t1", "t2"], ['{"old": 1}', json.dumps(error)], '{"percent": 40}'
    )
    _check_migrated(r, kind, called, before=before, new_id=new_id, payload=payload)

    before = r.before(bare)  # empty metadata, no tags/errors/progress: payload SQL NULL
    called = call(r.engine, bare, kind)
    _check_migrated(r, kind, called, before=before, new_id=new_id + 1, payload=None)
    with r.engine.connect() as conn:
        sql = f"SELECT payload IS NULL FROM {r.schema}.deferred_jobs WHERE job_id = :i"
        assert scalar(conn, sql, i=new_id + 1)

    for offset, job in enumerate((released, free, moved), start=2):
        before = r.before(job)
        called = call(r.engine, job, kind, error="e")
        payload = expected_payload(errors=['"e"'])
        _check_migrated(r, kind, called, before=before, new_id=new_id + offset, payload=payload)
    return {(key + b"-free", new_id + 3), (key + b"-moved", new_id + 4)}


# -- rows 9 and 10 ------------------------------------------------------------------------


def test_rows9_10_cancelled_duplicate(routed: Routed) -> None:
    jobs: dict[tuple[str, bool], int] = {}
    with routed.engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE {routed.schema}.queue_ring_state SET current_slot = 5, generation = 7")
        )
        for name, kind in KINDS.items():
            for claims_cancelled in (False, True):
                mask = duplicate_mask(kind, claims_cancelled)
                key = f"{name}-{claims_cancelled}".encode()
                jobs[name, claims_cancelled] = insert_job(
                    conn,
                    queue="mail",
                    priority=3,
                    unique_key=key,
                    unique_states=mask,
                    metadata='{"tenant": "acme", "n": 1e400}',
                    tags=["t1"],
                    errors=['{"old": 1}'],
                    attempt=4,
                )
                insert_holder(conn, key, mask)
    holders = _claims(routed.engine)
    new_id = FIRST_ID[routed.schema]
    for name, kind in KINDS.items():
        for claims_cancelled in (False, True):
            job = jobs[name, claims_cancelled]
            before = routed.before(job)
            start = time.time()
            called = call(routed.engine, job, kind, progress={"p": 1})
            window = (start, time.time())
            errors = ['{"old": 1}']
            _check_cancelled(
                routed,
                kind,
                called,
                before=before,
                new_id=new_id,
                payload_errors=errors,
                progress='{"p": 1}',
                keeps_key=not claims_cancelled,  # row 9 keeps it; row 10 strips it
                worker_window=window,
            )
            new_id += 1
    assert _claims(routed.engine) == holders  # the newer holders keep their keys
    with routed.engine.connect() as conn:
        assert seq_next(conn, f"{routed.schema}.job_id_seq") == new_id
        assert seq_next(conn, f"{routed.other}.job_id_seq") == FIRST_ID[routed.other]
        lanes = rows(conn, f"SELECT queue, priority FROM {routed.schema}.queue_lanes")
        assert lanes == [{"queue": "mail", "priority": 3}]  # ensured once, reused after


# -- edges ---------------------------------------------------------------------------------


def test_lane_lock_and_clock_inside_the_callers_transaction(cluster: Any) -> None:
    """The lane advisory lock is transaction-scoped on Awa's key; finalized_at is the clock."""
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        job = insert_job(
            conn, queue="default", priority=2, unique_key=b"k", unique_states="11000000"
        )
        insert_holder(conn, b"k", "11000000")
    with cluster.engine.begin() as conn:
        outcome = reschedule_canonical_attempt(conn, job, 1, Snooze(10))
        assert isinstance(outcome, CancelledDuplicate)
        held = scalar(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            " AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(:k, 0)",
            k="awa_qs:default:2:0",
        )
        assert held == 1
        finalized, now = conn.execute(
            sa.text("SELECT finalized_at, now() FROM awa_qs.done_entries WHERE job_id = :i"),
            {"i": outcome.job_id},
        ).one()
        assert finalized > now
    with cluster.engine.connect() as conn:
        left = scalar(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        assert left == 0


def test_fresh_id_equal_to_the_holder_counts_as_our_claim(cluster: Any) -> None:
    """The shared claim table cannot tell the id spaces apart (docs/contract.md#decision-table)."""
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
        job = insert_job(conn, unique_key=b"k", unique_states="11000000")
        holder = insert_holder(conn, b"k", "11000000")
        conn.execute(sa.text("SELECT setval('awa_qs.job_id_seq', :v, false)"), {"v": holder})
    outcome = call(cluster.engine, job, Snooze(1)).outcome
    assert isinstance(outcome, Migrated)
    assert outcome.job_id == holder
    assert _claims(cluster.engine) == {(b"k", holder)}


ROUTING_CASES = [
    ("{}", "awa_qs", "awa_qs"),  # the marker row is the fallback
    ('{"schema": ""}', None, "awa"),  # blank counts as missing; last fallback 'awa'
    ('{"schema": "awa_qs"}', "awa", "awa_qs"),  # details win over the marker
]


def test_routing_follows_the_database_function(cluster: Any) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        advance_all(conn)
    next_id = dict(FIRST_ID)
    for details, marker, schema in ROUTING_CASES:
        with cluster.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE awa.storage_transition_state SET details = CAST(:d AS jsonb)"),
                {"d": details},
            )
            conn.execute(sa.text("DELETE FROM awa.runtime_storage_backends"))
            if marker is not None:
                conn.execute(
                    sa.text(
                        "INSERT INTO awa.runtime_storage_backends (backend, schema_name)"
                        " VALUES ('queue_storage', :s)"
                    ),
                    {"s": marker},
                )
            job = insert_job(conn)
        outcome = call(cluster.engine, job, Snooze(1)).outcome
        assert isinstance(outcome, Migrated)
        assert outcome.job_id == next_id[schema], (details, marker)
        next_id[schema] += 1
    with cluster.engine.connect() as conn:
        for schema, first in FIRST_ID.items():
            count = scalar(conn, f"SELECT count(*) FROM {schema}.deferred_jobs")
            assert count == next_id[schema] - first
