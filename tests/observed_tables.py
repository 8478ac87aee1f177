"""Tables the library never touches but the tests read back, declared like the library's own.

Their shapes are checked against live catalogs with the library's tables
(``test_metadata_reflection.py``), so a test that reads them cannot silently read the wrong thing.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB

from awa_sa.tables.canonical import AWA_SCHEMA, Timestamp
from awa_sa.tables.queue_storage import QS_PLACEHOLDER

metadata = MetaData(schema=AWA_SCHEMA)
queue_storage_metadata = MetaData(schema=QS_PLACEHOLDER)

runtime_storage_backends = Table(
    "runtime_storage_backends",
    metadata,
    Column("backend", Text, primary_key=True),
    Column("schema_name", Text, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
)

admin_dirty_queue_marks = Table(
    "admin_dirty_queue_marks",
    metadata,
    Column("queue", Text, nullable=False),
    Column("touched_at", Timestamp, nullable=False),
)

admin_dirty_kind_marks = Table(
    "admin_dirty_kind_marks",
    metadata,
    Column("kind", Text, nullable=False),
    Column("touched_at", Timestamp, nullable=False),
)

ready_entries = Table(
    "ready_entries",
    queue_storage_metadata,
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
    PrimaryKeyConstraint("ready_slot", "queue", "priority", "enqueue_shard", "lane_seq"),
)
