"""Tables of a real Awa v040 cluster that the test fixture schema (``awa_sa_schema``) lacks.

The cancel of an available job writes ``ready_tombstones``, as awa-pg does. The queue-storage
retry (:mod:`awa_sa.administer.statements.failed_retry`) writes a lane's
``ready_segments`` entry, reads the pruned failed rows of ``queue_terminal_rollups`` and the
enqueue shard count of ``awa.queue_meta``, as awa-pg does. They are declared here, column for
column as ``awa migrate`` creates them, and compared with a real cluster only
(tests/integration/test_metadata_reflection.py): the fixture schema has no such tables, so a
retry on a queue-storage fixture cluster that finds a job to retry fails there. The reads
(:mod:`awa_sa.read`) leave out a compact completion under ``receipt_completion_tombstones``, as
the schema's ``terminal_jobs`` view does, and a ready row under ``ready_tombstones``, as awa-pg's
listing does; ``queue_stats`` reads the queue names and counts of ``awa.queue_state_counts``,
``awa.queue_descriptors`` and ``awa.runtime_instances``, as awa-pg's ``queue_overviews`` does.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from awa_sa.tables.canonical import AWA_SCHEMA, Timestamp
from awa_sa.tables.queue_storage import QS_PLACEHOLDER

metadata = MetaData(schema=QS_PLACEHOLDER)

ready_segments = Table(
    "ready_segments",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("first_lane_seq", BigInteger, nullable=False),
    Column("next_lane_seq", BigInteger, nullable=False),
    Column("first_run_at", Timestamp, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    PrimaryKeyConstraint(
        "ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "first_lane_seq"
    ),
)
"""The claim side's index of ready rows: one per run of consecutive lane numbers enqueued."""

ready_tombstones = Table(
    "ready_tombstones",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("lane_seq", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("tombstoned_at", Timestamp, nullable=False),
    PrimaryKeyConstraint(
        "ready_slot", "queue", "priority", "enqueue_shard", "lane_seq", "ready_generation"
    ),
)
"""A ready row made unclaimable in place (an available job cancelled): the claim skips it, and
awa-pg's listing counts it no longer available."""

queue_terminal_rollups = Table(
    "queue_terminal_rollups",
    metadata,
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("pruned_completed_count", BigInteger, nullable=False),
    Column("pruned_failed_count", BigInteger, nullable=False),
    PrimaryKeyConstraint("queue", "priority"),
)
"""Terminal rows pruned past retention, per lane; awa-pg 0.6.9 reads the failed count."""

queue_meta = Table(
    "queue_meta",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("paused", Boolean, nullable=False),
    Column("paused_at", Timestamp),
    Column("paused_by", Text),
    Column("enqueue_shards", SmallInteger, nullable=False),
    schema=AWA_SCHEMA,
)
"""A queue's settings; the retry reads ``enqueue_shards`` (more than 1: refused)."""

receipt_completion_tombstones = Table(
    "receipt_completion_tombstones",
    metadata,
    Column("ready_slot", Integer, nullable=False),
    Column("ready_generation", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("run_lease", BigInteger, nullable=False),
    Column("queue", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("enqueue_shard", SmallInteger, nullable=False),
    Column("lane_seq", BigInteger, nullable=False),
    Column("deleted_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("ready_slot", "job_id", "run_lease"),
)
"""A compact completion's position deleted (by awa-pg's admin delete): ``terminal_jobs``
leaves it out."""

_COUNTS = ("scheduled", "available", "running", "completed", "retryable", "failed")

queue_state_counts = Table(
    "queue_state_counts",
    metadata,
    Column("queue", Text, primary_key=True),
    *(Column(name, BigInteger, nullable=False) for name in _COUNTS),
    Column("cancelled", BigInteger, nullable=False),
    Column("waiting_external", BigInteger, nullable=False),
    schema=AWA_SCHEMA,
)
"""The canonical plane's counts per queue and state, a cache the maintenance leader keeps:
what awa-pg's ``queue_stats`` reports while routing is canonical."""

queue_descriptors = Table(
    "queue_descriptors",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("display_name", Text),
    Column("description", Text),
    Column("owner", Text),
    Column("docs_url", Text),
    Column("tags", ARRAY(Text), nullable=False),
    Column("extra", JSONB, nullable=False),
    Column("descriptor_hash", Text, nullable=False),
    Column("sync_interval_ms", BigInteger, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Column("last_seen_at", Timestamp, nullable=False),
    schema=AWA_SCHEMA,
)
"""The queues a worker's code declared; ``queue_stats`` lists each."""

runtime_instances = Table(
    "runtime_instances",
    metadata,
    Column("instance_id", Uuid, primary_key=True),
    Column("hostname", Text),
    Column("pid", Integer, nullable=False),
    Column("version", Text, nullable=False),
    Column("started_at", Timestamp, nullable=False),
    Column("last_seen_at", Timestamp, nullable=False),
    Column("snapshot_interval_ms", BigInteger, nullable=False),
    *(
        Column(name, Boolean, nullable=False)
        for name in ("healthy", "postgres_connected", "poll_loop_alive", "heartbeat_alive")
    ),
    Column("shutting_down", Boolean, nullable=False),
    Column("leader", Boolean, nullable=False),
    Column("global_max_workers", Integer),
    Column("queues", JSONB, nullable=False),
    Column("maintenance_alive", Boolean, nullable=False),
    Column("queue_descriptor_hashes", JSONB, nullable=False),
    Column("job_kind_descriptor_hashes", JSONB, nullable=False),
    Column("storage_capability", Text, nullable=False),
    Column("transition_role", Text, nullable=False),
    schema=AWA_SCHEMA,
)
"""The runtimes' snapshots; ``queue_stats`` lists every queue one reports a descriptor for."""
