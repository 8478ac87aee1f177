"""Tables of a real Awa v040 cluster that the test fixture schema (``awa_sa_schema``) lacks.

The cancel of an available job writes ``ready_tombstones``, as awa-pg does. The queue-storage
retry (:mod:`awa_sa.administer.statements.failed_retry`) writes a lane's
``ready_segments`` entry, reads the pruned failed rows of ``queue_terminal_rollups`` and the
enqueue shard count of ``awa.queue_meta``, as awa-pg does. They are declared here, column for
column as ``awa migrate`` creates them, and compared with a real cluster only
(tests/integration/test_metadata_reflection.py): the fixture schema has no such tables, so a
retry on a queue-storage fixture cluster that finds a job to retry fails there.
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
)

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
"""A ready row made unclaimable in place (a cancelled available job): the claim skips it."""

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
