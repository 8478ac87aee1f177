"""The queue-storage tables of Awa v040, declared once for every queue-storage schema.

Each table sits under the placeholder schema :data:`QS_PLACEHOLDER`; statements are compiled
with ``schema_translate_map={QS_PLACEHOLDER: name}``. One ``Table`` object per table means one
statement object per shape serves every schema: the builders build it once, and
``awa_sa.core.compiled`` renders the routed name in when it compiles the text for that schema (a
``Table`` per name would mean a statement per name). SQLAlchemy quotes the translated name.
Which names are accepted at all is decided by :func:`translate_map`.
"""

from __future__ import annotations

import re

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import ARRAY, INT8MULTIRANGE, JSONB

from awa_sa.core.errors import InvalidSchemaName
from awa_sa.core.internals import SchemaTranslatedFunction
from awa_sa.tables.canonical import Timestamp, job_state

QS_PLACEHOLDER = "__awa_queue_storage__"
"""Never a real schema: a statement run without a translate map fails instead of guessing."""

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
_MAX_IDENTIFIER_BYTES = 63

metadata = MetaData(schema=QS_PLACEHOLDER)

job_id_seq = Sequence("job_id_seq", metadata=metadata, schema=QS_PLACEHOLDER)
"""The successor-id sequence; independent of the canonical ``awa.jobs_id_seq``."""


def translate_map(schema: str) -> dict[str | None, str | None]:
    """The ``schema_translate_map`` for queue-storage schema *schema*, validated.

    Awa splices the name into identifiers, so it accepts only plain lower-case identifiers;
    so do we (docs/contract.md#validation). PostgreSQL would silently truncate a longer name.
    """
    if not (_IDENTIFIER.fullmatch(schema) and len(schema.encode()) <= _MAX_IDENTIFIER_BYTES):
        raise InvalidSchemaName(schema)
    return {QS_PLACEHOLDER: schema}


deferred_jobs = Table(
    "deferred_jobs",
    metadata,
    Column("job_id", BigInteger, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("state", job_state, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("max_attempts", SmallInteger, nullable=False),
    Column("run_at", Timestamp, nullable=False),
    Column("attempted_at", Timestamp),
    Column("finalized_at", Timestamp),
    Column("created_at", Timestamp, nullable=False),
    Column("unique_key", LargeBinary),
    Column("unique_states", Text),
    Column("payload", JSONB),
)

_LANE_KEY = ("ready_slot", "queue", "priority", "enqueue_shard", "lane_seq")

done_entries = Table(
    "done_entries",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("args", JSONB),
    Column("state", job_state, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("max_attempts", SmallInteger),
    Column("lane_seq", BigInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("run_at", Timestamp),
    Column("attempted_at", Timestamp),
    Column("finalized_at", Timestamp, nullable=False),
    Column("created_at", Timestamp),
    Column("unique_key", LargeBinary),
    Column("unique_states", Text),
    Column("payload", JSONB),
    PrimaryKeyConstraint(*_LANE_KEY),
)

queue_ring_state = Table(
    "queue_ring_state",
    metadata,
    Column("singleton", Boolean, primary_key=True),
    Column("current_slot", Integer, nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("slot_count", Integer, nullable=False),
    Column("terminal_counter_trusted_at", Timestamp),
)

queue_lanes = Table(
    "queue_lanes",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("priority", SmallInteger, primary_key=True),
    Column("next_seq", BigInteger, nullable=False),
    Column("claim_seq", BigInteger, nullable=False),
    Column("pruned_completed_count", BigInteger, nullable=False),
)

queue_enqueue_heads = Table(
    "queue_enqueue_heads",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("priority", SmallInteger, primary_key=True),
    Column("enqueue_shard", SmallInteger, primary_key=True),
    Column("next_seq", BigInteger, nullable=False),
    Column("seq_name", Text),
)

queue_claim_heads = Table(
    "queue_claim_heads",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("priority", SmallInteger, primary_key=True),
    Column("enqueue_shard", SmallInteger, primary_key=True),
    Column("claim_seq", BigInteger, nullable=False),
    Column("seq_name", Text),
    Column("ready_segment_slot", Integer),
    Column("ready_segment_generation", BigInteger),
    Column("ready_segment_next_lane_seq", BigInteger),
)

queue_terminal_count_deltas = Table(
    "queue_terminal_count_deltas",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("counter_bucket", SmallInteger, nullable=False),
    Column("terminal_delta", BigInteger, nullable=False),
    Column("recorded_at", Timestamp, nullable=False),
)


class ensure_lane_sequences(SchemaTranslatedFunction):
    """``S.ensure_lane_sequences(queue, priority, shard)``, with ``S`` schema-translated."""

    inherit_cache = True
    name = "ensure_lane_sequences"
    schema = QS_PLACEHOLDER


class reserve_enqueue_seq(SchemaTranslatedFunction):
    """``S.reserve_enqueue_seq(queue, priority, shard, count)``: the first of *count* lane
    numbers, reserved under a transaction-scoped lock on the lane, its sequences ensured."""

    inherit_cache = True
    name = "reserve_enqueue_seq"
    schema = QS_PLACEHOLDER


class sequence_next_value(SchemaTranslatedFunction):
    """``S.sequence_next_value(seq_name)``: the number a lane sequence gives next (a claim
    cursor's, for the reads: a ready row at or past it is not claimed yet)."""

    inherit_cache = True
    name = "sequence_next_value"
    schema = QS_PLACEHOLDER


# The receipt plane: what a queue-storage runtime claims, and what closes a claim (read to find
# a running attempt, written when one is settled).

ready_entries = Table(
    "ready_entries",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("max_attempts", SmallInteger, nullable=False),
    Column("lane_seq", BigInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("run_at", Timestamp, nullable=False),
    Column("attempted_at", Timestamp),
    Column("created_at", Timestamp, nullable=False),
    Column("unique_key", LargeBinary),
    Column("unique_states", Text),
    Column("payload", JSONB),
    PrimaryKeyConstraint(*_LANE_KEY),
)
"""A job as enqueued; a claim leaves the row as it was (the receipt points at it)."""

lease_claims = Table(
    "lease_claims",
    metadata,
    Column("claim_slot", Integer, nullable=False),
    Column("receipt_id", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("max_attempts", SmallInteger, nullable=False),
    Column("lane_seq", BigInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("claimed_at", Timestamp, nullable=False),
    Column("materialized_at", Timestamp),
    Column("closed_at", Timestamp),
    Column("deadline_at", Timestamp),
    PrimaryKeyConstraint("claim_slot", "job_id", "run_lease"),
)
"""One receipt per claim on a queue with a deadline. ``priority`` is the claim's effective
(aged) priority, not necessarily the lane's; ``receipt_id`` is unique across the schema."""

lease_claim_batches = Table(
    "lease_claim_batches",
    metadata,
    Column("claim_slot", Integer, nullable=False),
    Column("batch_id", BigInteger, nullable=False),
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("claimed_count", Integer, nullable=False),
    Column("job_ids", ARRAY(BigInteger), nullable=False),
    Column("run_leases", ARRAY(BigInteger), nullable=False),
    Column("receipt_ids", ARRAY(BigInteger), nullable=False),
    Column("receipt_ranges", INT8MULTIRANGE, nullable=False),
    Column("lane_seqs", ARRAY(BigInteger), nullable=False),
    Column("attempts", ARRAY(SmallInteger), nullable=False),
    Column("max_attempts", ARRAY(SmallInteger), nullable=False),
    Column("deadline_at", Timestamp),
    Column("claimed_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("claim_slot", "batch_id"),
)
"""The compact receipts of one claim on a queue without a deadline: parallel arrays, one
position per job (the claim's ``claim_batch_index`` is the 1-based position)."""

lease_claim_closures = Table(
    "lease_claim_closures",
    metadata,
    Column("claim_slot", Integer, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("closed_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("claim_slot", "job_id", "run_lease"),
)

lease_claim_closure_batches = Table(
    "lease_claim_closure_batches",
    metadata,
    Column("claim_slot", Integer, nullable=False),
    Column("ready_slot", Integer),
    Column("ready_generation", BigInteger),
    Column("batch_id", BigInteger, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("closed_count", Integer, nullable=False),
    Column("receipt_ids", ARRAY(BigInteger), nullable=False),
    Column("receipt_ranges", INT8MULTIRANGE, nullable=False),
    Column("closed_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("claim_slot", "batch_id"),
)
"""Closes receipts by ``receipt_id`` range, whichever table holds the receipt."""

leases = Table(
    "leases",
    metadata,
    Column("lease_slot", Integer, nullable=False),
    Column("lease_generation", BigInteger, nullable=False),
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("state", job_state, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("max_attempts", SmallInteger, nullable=False),
    Column("lane_seq", BigInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("heartbeat_at", Timestamp),
    Column("deadline_at", Timestamp),
    Column("attempted_at", Timestamp),
    Column("callback_id", Uuid),
    Column("callback_timeout_at", Timestamp),
    PrimaryKeyConstraint("lease_slot", "queue", "priority", "enqueue_shard", "lane_seq"),
)
"""A claim materialised into a lease (``register_callback`` does it); its receipt stays open,
with ``materialized_at`` set."""

dlq_entries = Table(
    "dlq_entries",
    metadata,
    Column("job_id", BigInteger, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("state", job_state, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("attempt", SmallInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("max_attempts", SmallInteger, nullable=False),
    Column("run_at", Timestamp, nullable=False),
    Column("attempted_at", Timestamp),
    Column("finalized_at", Timestamp, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("unique_key", LargeBinary),
    Column("unique_states", Text),
    Column("payload", JSONB),
    Column("dlq_reason", Text, nullable=False),
    Column("dlq_at", Timestamp, nullable=False),
    Column("original_run_lease", BigInteger, nullable=False),
)

attempt_state = Table(
    "attempt_state",
    metadata,
    Column("job_id", BigInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("heartbeat_at", Timestamp),
    Column("progress", JSONB),
    Column("callback_filter", Text),
    Column("callback_on_complete", Text),
    Column("callback_on_fail", Text),
    Column("callback_transform", Text),
    Column("callback_result", JSONB),
    Column("updated_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("job_id", "run_lease"),
)
"""Per-attempt mutable state of a receipt: its heartbeats land here (none at claim time)."""

receipt_completion_batches = Table(
    "receipt_completion_batches",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("batch_id", BigInteger, nullable=False),
    Column("claim_slot", Integer, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("completed_count", Integer, nullable=False),
    Column("job_ids", ARRAY(BigInteger), nullable=False),
    Column("run_leases", ARRAY(BigInteger), nullable=False),
    Column("lane_seqs", ARRAY(BigInteger), nullable=False),
    Column("attempts", ARRAY(SmallInteger), nullable=False),
    Column("attempted_ats", ARRAY(Timestamp), nullable=False),
    Column("finalized_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("ready_slot", "batch_id"),
)
"""A bare job's completion: no ``done_entries`` row; ``terminal_jobs`` expands these."""

ready_claim_attempt_batches = Table(
    "ready_claim_attempt_batches",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("batch_id", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("claim_slot", Integer),
    Column("first_lane_seq", BigInteger, nullable=False),
    Column("next_lane_seq", BigInteger, nullable=False),
    Column("claimed_count", Integer, nullable=False),
    Column("lane_ranges", INT8MULTIRANGE, nullable=False),
    Column("claimed_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("ready_slot", "batch_id"),
)
"""Every claim's lane range and its own clock, which the job row a claim returns carries as
``attempted_at`` (a receipt's ``claimed_at`` is a later clock)."""
