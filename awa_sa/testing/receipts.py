"""Seed a running queue-storage attempt the way Awa 0.6.9's enqueue and claim leave it.

On queue storage a job is enqueued into ``S.ready_entries`` (under the next id of
``S.job_id_seq`` and the next sequence number of its lane), and a runtime's claim on a queue
with a deadline writes a receipt into ``S.lease_claims``: ``attempt`` and ``run_lease`` one
above the ready row's, the ready row left as it was, the lane's claim sequence advanced past it.
:func:`queue_storage_attempt` writes those two rows and moves those sequences, so a service's
test can hand its handler a queue-storage job and check what it does with one (awa-sa lists,
resolves and settles it). The suite compares the rows with a real claim.

Every statement is built once and reaches the schema through ``schema_translate_map``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, REGCLASS, array
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.errors import ValidationError
from awa_sa.settle.running import RunningAttempt, running_attempts
from awa_sa.tables import canonical as tables
from awa_sa.tables import queue_storage as qs
from awa_sa.testing.attempts import DEFAULT_DEADLINE_SECS
from awa_sa.testing.phases import DEFAULT_SCHEMA, set_phase

AUTO_FINALIZE_SCHEMA = "awa"
"""Where the first awa-pg runtime finalizes a fresh cluster unless told another schema."""

_SHARD = 0


def _value(name: str, type_: Any) -> sa.ColumnElement[Any]:
    return sa.cast(sa.bindparam(name, type_=type_), type_)


def _lane() -> dict[str, sa.ColumnElement[Any]]:
    return {"queue": _value("b_queue", sa.Text), "priority": _value("b_priority", sa.SmallInteger)}


@cache
def _lane_rows() -> tuple[sa.Insert, ...]:
    """The lane and its two head rows; the heads' triggers create the lane sequences."""
    head = {**_lane(), "enqueue_shard": sa.literal_column(str(_SHARD))}
    return (
        pg_insert(qs.queue_lanes).values(_lane()).on_conflict_do_nothing(),
        pg_insert(qs.queue_enqueue_heads).values(head).on_conflict_do_nothing(),
        pg_insert(qs.queue_claim_heads).values(head).on_conflict_do_nothing(),
    )


@cache
def _sequences() -> sa.Select[Any]:
    """The lane's enqueue and claim sequence names."""
    enqueue, claim = qs.queue_enqueue_heads, qs.queue_claim_heads
    lane = _lane()
    return (
        sa.select(enqueue.c.seq_name.label("enqueue"), claim.c.seq_name.label("claim"))
        .select_from(
            enqueue.join(
                claim,
                sa.and_(
                    claim.c.queue == enqueue.c.queue,
                    claim.c.priority == enqueue.c.priority,
                    claim.c.enqueue_shard == enqueue.c.enqueue_shard,
                ),
            )
        )
        .where(
            enqueue.c.queue == lane["queue"],
            enqueue.c.priority == lane["priority"],
            enqueue.c.enqueue_shard == _SHARD,
        )
    )


@cache
def _enqueue() -> sa.Insert:
    """The ready row, in the ring's current slot, under the next id and lane sequence number."""
    ready, ring = qs.ready_entries, qs.queue_ring_state
    source = sa.select(
        ring.c.current_slot,
        ring.c.generation,
        qs.job_id_seq.next_value(),
        _value("b_kind", sa.Text),
        _lane()["queue"],
        _value("b_args", JSONB),
        _lane()["priority"],
        _value("b_ready_attempt", sa.SmallInteger),
        _value("b_ready_lease", sa.BigInteger),
        _value("b_max_attempts", sa.SmallInteger),
        sa.func.nextval(_value("b_enqueue_seq", REGCLASS)),
        sa.literal_column(str(_SHARD)),
        _value("b_payload", JSONB),
    ).where(ring.c.singleton)
    columns = [
        "ready_slot",
        "ready_generation",
        "job_id",
        "kind",
        "queue",
        "args",
        "priority",
        "attempt",
        "run_lease",
        "max_attempts",
        "lane_seq",
        "enqueue_shard",
        "payload",
    ]
    return (
        sa.insert(ready)
        .from_select(columns, source)
        .returning(ready.c.job_id, ready.c.lane_seq, ready.c.ready_slot, ready.c.ready_generation)
    )


@cache
def _claim() -> sa.Insert:
    """The receipt a claim on a queue with a deadline writes."""
    claims = qs.lease_claims
    return (
        sa.insert(claims)
        .values(
            claim_slot=sa.literal_column("0"),
            job_id=_value("b_job_id", sa.BigInteger),
            run_lease=_value("b_run_lease", sa.BigInteger),
            ready_slot=_value("b_ready_slot", sa.Integer),
            ready_generation=_value("b_ready_generation", sa.BigInteger),
            queue=_lane()["queue"],
            priority=_lane()["priority"],
            attempt=_value("b_attempt", sa.SmallInteger),
            max_attempts=_value("b_max_attempts", sa.SmallInteger),
            lane_seq=_value("b_lane_seq", sa.BigInteger),
            enqueue_shard=sa.literal_column(str(_SHARD)),
            deadline_at=_value("b_claimed_at", sa.DateTime(timezone=True))
            + sa.func.make_interval(0, 0, 0, 0, 0, 0, _value("b_deadline_secs", sa.Float)),
        )
        .returning(claims.c.receipt_id)
    )


@cache
def _claim_attempt() -> sa.Insert:
    """The claim's own record of the lane range it took, and of its clock."""
    attempts = qs.ready_claim_attempt_batches
    lane_seq = _value("b_lane_seq", sa.BigInteger)
    values: dict[str, sa.ColumnElement[Any]] = {
        "ready_slot": _value("b_ready_slot", sa.Integer),
        "ready_generation": _value("b_ready_generation", sa.BigInteger),
        "queue": _lane()["queue"],
        "priority": _lane()["priority"],
        "enqueue_shard": sa.literal_column(str(_SHARD)),
        "claim_slot": sa.literal_column("0"),
        "first_lane_seq": lane_seq,
        "next_lane_seq": lane_seq + 1,
        "claimed_count": sa.literal_column("1"),
        "lane_ranges": sa.func.int8multirange(sa.func.int8range(lane_seq, lane_seq + 1)),
    }
    rows = sa.select(*(value.label(name) for name, value in values.items()))
    return sa.insert(attempts).from_select(list(values), rows).returning(attempts.c.claimed_at)


@cache
def _compact_claim() -> sa.Insert:
    """The compact receipt a claim on a queue without a deadline writes: a batch of one."""
    batches = qs.lease_claim_batches
    receipt = sa.func.nextval(_value("b_receipt_seq", REGCLASS))
    picked = sa.select(receipt.label("receipt_id")).cte("receipt")
    one: sa.ColumnElement[Any] = sa.literal_column("1")
    rid = picked.c.receipt_id
    source = sa.select(
        sa.literal_column("0"),
        _value("b_ready_slot", sa.Integer),
        _value("b_ready_generation", sa.BigInteger),
        _lane()["queue"],
        _lane()["priority"],
        sa.literal_column(str(_SHARD)),
        one,
        array([_value("b_job_id", sa.BigInteger)]),
        array([_value("b_run_lease", sa.BigInteger)]),
        array([rid]),
        sa.func.int8multirange(sa.func.int8range(rid, rid + one)),
        array([_value("b_lane_seq", sa.BigInteger)]),
        array([_value("b_attempt", sa.SmallInteger)]),
        array([_value("b_max_attempts", sa.SmallInteger)]),
        _value("b_claimed_at", sa.DateTime(timezone=True)),
    ).select_from(picked)
    columns = [
        "claim_slot",
        "ready_slot",
        "ready_generation",
        "queue",
        "priority",
        "enqueue_shard",
        "claimed_count",
        "job_ids",
        "run_leases",
        "receipt_ids",
        "receipt_ranges",
        "lane_seqs",
        "attempts",
        "max_attempts",
        "claimed_at",
    ]
    return sa.insert(batches).from_select(columns, source).returning(batches.c.batch_id)


@cache
def _claimed_past() -> sa.Select[Any]:
    """Move the lane's claim sequence past the claimed row (never back), as the claim does."""
    seq = _value("b_claim_seq", REGCLASS)
    last = sa.func.coalesce(sa.func.pg_sequence_last_value(seq), 0)
    return sa.select(
        sa.func.setval(seq, sa.func.greatest(_value("b_lane_seq", sa.BigInteger), last))
    )


@cache
def _routing() -> sa.Select[Any]:
    """Where routing points, and whether the cluster is one a first runtime would finalize:
    canonical, nothing prepared, no job in either canonical table."""
    state = tables.storage_transition_state
    fresh = sa.and_(
        state.c.state == "canonical",
        state.c.prepared_engine.is_(None),
        ~sa.exists().select_from(tables.jobs_hot),
        ~sa.exists().select_from(tables.scheduled_jobs),
    )
    return sa.select(
        sa.func.awa.active_queue_storage_schema().label("schema"), fresh.label("fresh")
    ).where(state.c.singleton)


def _routed(conn: sa.Connection, schema: str | None) -> str:
    """The schema to claim in; a fresh canonical cluster is finalized to it first, as the
    first awa-pg runtime to start on it does (``storage_auto_finalize_if_fresh``)."""
    routing = conn.execute(_routing()).one()
    if routing.schema is None and routing.fresh:
        set_phase(conn, "active", schema or AUTO_FINALIZE_SCHEMA)
        return schema or AUTO_FINALIZE_SCHEMA
    if routing.schema is None:
        raise ValidationError(
            "routing is canonical and the cluster is not fresh (a job or a prepared transition"
            " is there, so no runtime would finalize it): set_phase(conn, 'mixed_transition',"
            f" {schema or DEFAULT_SCHEMA!r}) first"
        )
    if schema is not None and routing.schema != schema:
        raise ValidationError(
            f"routing is {routing.schema}, not {schema}: set_phase(conn, 'mixed_transition', "
            f"{schema!r}) first"
        )
    return str(routing.schema)


def queue_storage_attempt(
    conn: sa.Connection,
    *,
    schema: str | None = None,
    kind: str = "example_job",
    queue: str = "default",
    args: Any = None,
    priority: int = 2,
    attempt: int = 1,
    max_attempts: int = 25,
    metadata: Mapping[str, Any] | None = None,
    tags: Sequence[str] = (),
    deadline_secs: float = DEFAULT_DEADLINE_SECS,
) -> RunningAttempt:
    """Enqueue a job on queue storage and claim it as a runtime would; return its attempt.

    The claim is made in the schema routing points at (*schema*, when named, must be that
    one). A fresh database, canonical with no job and nothing prepared (the fixtures' start,
    and a cluster ``awa migrate`` just built), is first finalized to *schema* (``awa`` unless
    named), as the first awa-pg runtime to start on it would: in a service's tests, as in
    production, every attempt is then a queue-storage receipt. Elsewhere set the phase first
    (``set_phase(conn, "mixed_transition", schema)`` or ``"active"``). Runs in *conn*'s
    transaction and never commits. ``attempt``
    above 1 models a job claimed again after a retry: the ready row carries the previous
    attempt and lease. The returned :class:`~awa_sa.RunningAttempt` is read back with
    :func:`~awa_sa.running_attempts`, so its ``created_at`` is what a handler's ``Job`` would
    carry (:func:`job_of` gives that ``Job``). ``deadline_secs=0`` claims as a queue without a
    deadline does: a compact receipt, one position of a ``lease_claim_batches`` row, which
    ``awa_sa.settle`` refuses (``CompactReceipt``).

        >>> from awa_sa import attempt_of
        >>> from awa_sa.testing import job_of, queue_storage_attempt
        >>> with engine.begin() as conn:
        ...     mine = queue_storage_attempt(conn, kind="send_email", queue="mail")
        ...     found = attempt_of(conn, job_of(mine))
        >>> (found.storage, found.job_id == mine.job_id, found.on_queue_storage)
        ('awa', True, True)
    """
    if attempt < 1:
        raise ValidationError(f"a running attempt has attempt >= 1, got {attempt}")
    if deadline_secs < 0:
        raise ValidationError(f"deadline_secs must not be negative, got {deadline_secs}")
    schema = _routed(conn, schema)
    translate = {"schema_translate_map": qs.translate_map(schema)}
    lane = {"b_queue": queue, "b_priority": priority}
    for stmt in _lane_rows():
        conn.execute(stmt, lane, execution_options=translate)
    seqs = conn.execute(_sequences(), lane, execution_options=translate).one()
    payload = {
        "tags": list(tags),
        "errors": [],
        "metadata": dict(metadata or {}),
        "progress": None,
    }
    ready = conn.execute(
        _enqueue(),
        {
            **lane,
            "b_kind": kind,
            "b_args": {} if args is None else args,
            "b_ready_attempt": attempt - 1,
            "b_ready_lease": attempt - 1,
            "b_max_attempts": max_attempts,
            "b_enqueue_seq": f"{schema}.{seqs.enqueue}",
            "b_payload": payload,
        },
        execution_options=translate,
    ).one()
    claim = {
        **lane,
        "b_job_id": ready.job_id,
        "b_run_lease": attempt,
        "b_ready_slot": ready.ready_slot,
        "b_ready_generation": ready.ready_generation,
        "b_attempt": attempt,
        "b_max_attempts": max_attempts,
        "b_lane_seq": ready.lane_seq,
    }
    claim["b_claimed_at"] = conn.execute(_claim_attempt(), claim, **_opts(translate)).scalar_one()
    if deadline_secs:
        conn.execute(_claim(), {**claim, "b_deadline_secs": deadline_secs}, **_opts(translate))
    else:
        receipts = f"{schema}.lease_claim_receipt_id_seq"
        conn.execute(_compact_claim(), {**claim, "b_receipt_seq": receipts}, **_opts(translate))
    conn.execute(
        _claimed_past(), {"b_claim_seq": f"{schema}.{seqs.claim}", "b_lane_seq": ready.lane_seq}
    )
    [mine] = [
        a
        for a in running_attempts(conn, job_id=ready.job_id, attempt=attempt)
        if a.storage == schema
    ]
    return mine


def _opts(translate: Mapping[str, Any]) -> dict[str, Any]:
    return {"execution_options": translate}


def job_of(attempt: RunningAttempt) -> SimpleNamespace:
    """A stand-in for the awa-pg ``Job`` a handler receives for *attempt*: what
    :func:`~awa_sa.attempt_of` reads, ``created_at`` as awa-pg's RFC 3339 text."""
    return SimpleNamespace(
        id=attempt.job_id,
        attempt=attempt.attempt,
        kind=attempt.kind,
        queue=attempt.queue,
        created_at=attempt.created_at.isoformat(),
        args=attempt.args,
        max_attempts=attempt.max_attempts,
    )
