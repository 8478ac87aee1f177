"""Test helpers: seed canonical attempts straight into ``awa.jobs_hot`` and snapshot every table.

Rows are seeded with SQL, not through awa-sa, so a bug in the library cannot hide in its own
fixtures. JSON goes in as text so tests can use values (``1e400``, long decimals) that a Python
float would change.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from awa_sa import (
    Kind,
    Outcome,
    RetryAfter,
    RetryBackoff,
    Snooze,
    reschedule_canonical_attempt,
)
from awa_sa.tables.canonical import JOB_STATES

QS_TABLES = (
    "deferred_jobs",
    "done_entries",
    "queue_lanes",
    "queue_enqueue_heads",
    "queue_claim_heads",
    "queue_terminal_count_deltas",
    "queue_ring_state",
    "ready_entries",
)
CANONICAL_TABLES = (
    "awa.jobs_hot",
    "awa.scheduled_jobs",
    "awa.job_unique_claims",
    "awa.admin_dirty_queue_marks",
    "awa.admin_dirty_kind_marks",
    "awa.storage_transition_state",
    "awa.runtime_storage_backends",
)
CALLBACK_VALUES: dict[str, str] = {
    "callback_id": "gen_random_uuid()",  # unique: idx_awa_jobs_hot_callback_id
    "callback_timeout_at": "now() + interval '1 hour'",
    "callback_filter": "'status == 200'",
    "callback_on_complete": "'done'",
    "callback_on_fail": "'failed'",
    "callback_transform": "'.body'",
}

_INSERT = """
INSERT INTO awa.jobs_hot (
    kind, queue, args, state, priority, attempt, max_attempts, run_at, heartbeat_at,
    deadline_at, attempted_at, finalized_at, errors, metadata, tags, unique_key,
    unique_states, run_lease, progress{callback_cols}
) VALUES (
    :kind, :queue, CAST(:args AS jsonb), CAST(:state AS awa.job_state), :priority, :attempt,
    :max_attempts, now() - interval '1 second', now(), now() + interval '5 minutes', now(),
    CAST(:finalized_at AS timestamptz), CAST(:errors AS jsonb[]), CAST(:metadata AS jsonb),
    CAST(:tags AS text[]), :unique_key, CAST(:unique_states AS bit(8)), :run_lease,
    CAST(:progress AS jsonb){callback_vals}
) RETURNING id
"""


def insert_job(
    conn: sa.Connection,
    *,
    state: str = "running",
    kind: str = "send_email",
    queue: str = "default",
    args: str = '{"to": "a@example.com"}',
    priority: int = 2,
    attempt: int = 1,
    max_attempts: int = 25,
    run_lease: int = 1,
    unique_key: bytes | None = None,
    unique_states: str | None = None,
    metadata: str = "{}",
    tags: Sequence[str] = (),
    errors: Sequence[str] | None = None,
    progress: str | None = None,
    finalized_at: str | None = None,
    callbacks: Sequence[str] = (),
) -> int:
    """Insert one job (a running canonical attempt by default) and return its id."""
    cols = "".join(f", {c}" for c in callbacks)
    vals = "".join(f", {CALLBACK_VALUES[c]}" for c in callbacks)
    stmt = sa.text(_INSERT.format(callback_cols=cols, callback_vals=vals))
    params: dict[str, Any] = {
        "kind": kind,
        "queue": queue,
        "args": args,
        "state": state,
        "priority": priority,
        "attempt": attempt,
        "max_attempts": max_attempts,
        "finalized_at": finalized_at,
        "errors": None if errors is None else list(errors),
        "metadata": metadata,
        "tags": list(tags),
        "unique_key": unique_key,
        "unique_states": unique_states,
        "run_lease": run_lease,
        "progress": progress,
    }
    return int(conn.execute(stmt, params).scalar_one())


def insert_holder(conn: sa.Connection, key: bytes, mask: str = "11111000") -> int:
    """A newer canonical job, ``available``, that holds *key* through the claim trigger."""
    return insert_job(
        conn, state="available", kind="holder", unique_key=key, unique_states=mask, run_lease=0
    )


def snapshot(conn: sa.Connection, schemas: Sequence[str] = ("awa", "awa_qs")) -> dict[str, Any]:
    """Every row of every table the operation may touch, plus every sequence, as text."""
    out: dict[str, Any] = {}
    names = list(CANONICAL_TABLES) + [f"{s}.{t}" for s in schemas for t in QS_TABLES]
    for name in dict.fromkeys(names):
        out[name] = conn.execute(sa.text(f"SELECT t::text FROM {name} t ORDER BY 1")).all()
    out["sequences"] = sequences(conn, schemas)
    return out


RUNTIME_CLOCK = frozenset(
    {
        "runtime_instances",
        "queue_descriptors",
        "job_kind_descriptors",
        "queue_claimer_state",
        "queue_claimer_leases",
    }
)
"""What the runtimes rewrite on their own clock and that names no job, left out of a plane's
snapshot: their liveness, their descriptors' ``last_seen_at`` (refreshed every 10 s and at
shutdown), their claimers' leases and target counts. A change there says nothing about what a
call or a completion wrote."""

SEQUENCE_VALUES = """
    SELECT schemaname || '.' || sequencename, last_value
    FROM pg_sequences WHERE schemaname = ANY(:schemas) ORDER BY 1
"""
"""Every sequence of ``:schemas`` as ``(schema.name, last_value)``, in name order."""


def sequences(conn: sa.Connection, schemas: Sequence[str]) -> list[Any]:
    """Every sequence of *schemas* with its last value (:data:`SEQUENCE_VALUES`)."""
    return list(conn.execute(sa.text(SEQUENCE_VALUES), {"schemas": list(schemas)}).all())


def snapshot_of(engine: sa.Engine, schemas: Sequence[str] = ("awa", "awa_qs")) -> dict[str, Any]:
    with engine.connect() as conn:
        return snapshot(conn, schemas)


def plane_tables(
    conn: sa.Connection, schemas: Sequence[str], leaving: Collection[str] = ()
) -> list[str]:
    """Every table of *schemas* as ``schema.table``, but those whose name is in *leaving*:
    read from the catalog, so a table Awa adds is covered without a list to update, and a
    partitioned one through its parent, since its partitions come and go with the data."""
    return list(
        conn.execute(
            sa.text(
                "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class AS c"
                " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
                " WHERE n.nspname = ANY(:schemas) AND c.relkind IN ('r', 'p')"
                " AND NOT c.relispartition AND c.relname <> ALL(CAST(:leaving AS text[]))"
                " ORDER BY 1"
            ),
            {"schemas": list(schemas), "leaving": list(leaving)},
        ).scalars()
    )


def every_row(engine: sa.Engine, schemas: Sequence[str] = ("awa", "awa_qs")) -> dict[str, Any]:
    """Every row of every table of *schemas* and every sequence, read in one snapshot: what a
    refusal must leave alone."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        tables = plane_tables(conn, schemas)
        legs = [f"SELECT '{t}', ARRAY(SELECT x::text FROM {t} AS x ORDER BY 1)" for t in tables]
        out: dict[str, Any] = dict(conn.execute(sa.text(" UNION ALL ".join(legs))).all())
        out["sequences"] = sequences(conn, schemas)
    return out


def one(conn: sa.Connection, sql: str, **params: Any) -> Any:
    """The single row of *sql*, as a mapping."""
    return conn.execute(sa.text(sql), params).mappings().one()


def rows(conn: sa.Connection, sql: str, **params: Any) -> list[Any]:
    return list(conn.execute(sa.text(sql), params).mappings().all())


def scalar(conn: sa.Connection, sql: str, **params: Any) -> Any:
    return conn.execute(sa.text(sql), params).scalar()


def canonical_state(engine: sa.Engine, job_id: int) -> str | None:
    """The job's state in ``awa.jobs_hot``; None once it has left (moved, or never there)."""
    with engine.connect() as conn:
        state = conn.scalar(
            sa.text("SELECT state::text FROM awa.jobs_hot WHERE id = :i"), {"i": job_id}
        )
    return None if state is None else str(state)


def jsonb_text(conn: sa.Connection, value: str | None) -> str | None:
    """PostgreSQL's canonical text of the jsonb *value*: compare payloads text to text."""
    return scalar(conn, "SELECT CAST(:v AS jsonb)::text", v=value) if value is not None else None


def advance_sequence(conn: sa.Connection, seq: str, to: int) -> None:
    """Move *seq* so its next value is *to*: fresh ids can then not match by coincidence."""
    conn.execute(sa.text("SELECT setval(:s, :v, false)"), {"s": seq, "v": to})


def row_text(conn: sa.Connection, table: str, where: str, **params: Any) -> dict[str, Any] | None:
    """One row as ``{column: text}`` (jsonb kept exact), or None when there is no such row."""
    pairs = conn.execute(
        sa.text(f"SELECT key, value FROM {table} t, jsonb_each_text(to_jsonb(t)) WHERE {where}"),
        params,
    )
    return dict(pairs.all()) or None


def marks(conn: sa.Connection) -> Counter[tuple[str, str, dt.datetime]]:
    """The dirty marks as a multiset of ``(table, queue-or-kind, touched_at)``."""
    out: Counter[tuple[str, str, dt.datetime]] = Counter()
    for table, col in (("admin_dirty_queue_marks", "queue"), ("admin_dirty_kind_marks", "kind")):
        for value, at in conn.execute(sa.text(f"SELECT {col}, touched_at FROM awa.{table}")):
            out[(table, value, at)] += 1
    return out


@dataclass
class Called:
    """What one own-transaction reschedule returned and the marks its transaction appended."""

    outcome: Outcome
    new_marks: Counter[tuple[str, str, dt.datetime]]

    @property
    def now(self) -> dt.datetime:
        """The reschedule transaction's ``now()``: every dirty mark it appended carries it."""
        stamps = {at for (_, _, at) in self.new_marks}
        assert len(stamps) == 1, self.new_marks
        return stamps.pop()


def call(engine: sa.Engine, job_id: int, kind: Kind, lease: int = 1, **kw: Any) -> Called:
    """Reschedule with the Engine form (own transaction) and report the marks it appended."""
    with engine.connect() as conn:
        before = marks(conn)
    outcome = reschedule_canonical_attempt(engine, job_id, lease, kind, **kw)
    with engine.connect() as conn:
        after = marks(conn)
    return Called(outcome, after - before)


def expected_payload(
    metadata: str = "{}",
    tags: Sequence[str] = (),
    errors: Sequence[str] = (),
    progress: str | None = None,
) -> str | None:
    """docs/contract.md#payload, written independently of the library: JSON text or None."""
    parts = []
    if json.loads(metadata) != {}:
        parts.append(f'"metadata": {metadata}')
    if tags:
        parts.append(f'"tags": {json.dumps(list(tags))}')
    if errors:
        parts.append(f'"errors": [{", ".join(errors)}]')
    if progress is not None:
        parts.append(f'"progress": {progress}')
    return "{" + ", ".join(parts) + "}" if parts else None


def bit_claims(mask: str | None, state: str) -> bool:
    return mask is not None and mask[JOB_STATES.index(state)] == "1"


KINDS: dict[str, Kind] = {
    "snooze": Snooze(30.5),
    "retry_after": RetryAfter(45.25),
    "retry_backoff": RetryBackoff(),
}


def next_state(kind: Kind) -> str:
    return "scheduled" if isinstance(kind, Snooze) else "retryable"


def duplicate_mask(kind: Kind, claims_cancelled: bool) -> str:
    """A mask that claims the successor's state but not ``running``: a newer job can take it."""
    base = "11000000" if isinstance(kind, Snooze) else "11001000"
    return base[:6] + ("1" if claims_cancelled else "0") + base[7:]


def check_run_at(kind: Kind, attempt: int, run_at: dt.datetime, now: dt.datetime) -> None:
    """run_at against the transaction clock: exact for a delay, within the jitter for backoff."""
    assert run_at.tzinfo is not None
    if isinstance(kind, RetryBackoff):
        secs = (run_at - now).total_seconds()
        if 2.0**attempt >= 86_400.0:
            assert secs == 86_400.0  # the 24 h cap
        else:
            assert 2.0**attempt <= secs
            assert secs < 1.25 * 2.0**attempt
    else:
        assert run_at == now + dt.timedelta(seconds=kind.delay_secs)


def advance_all(conn: sa.Connection) -> None:
    """Put every id sequence somewhere distinct, so no id can match another by coincidence."""
    advance_sequence(conn, "awa.jobs_id_seq", 1000)
    advance_sequence(conn, "awa.job_id_seq", 5000)
    advance_sequence(conn, "awa_qs.job_id_seq", 7000)


def seq_next(conn: sa.Connection, seq: str) -> int:
    """The value *seq* hands out next, read without consuming it."""
    return int(
        scalar(
            conn, f"SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM {seq}"
        )
    )
