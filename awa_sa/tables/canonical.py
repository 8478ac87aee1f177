"""The canonical plane of Awa v040 (schema ``awa``) as SQLAlchemy Core tables.

Only what statements need is declared: names, types, nullability and primary keys, checked
against a live v040 catalog by the test suite. Server defaults, indexes and triggers stay in the
database, where Awa owns them; these tables are never used to emit DDL.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import ARRAY, BIT, ENUM, JSONB

AWA_SCHEMA = "awa"

metadata = MetaData()

JOB_STATES = (
    "scheduled",
    "available",
    "running",
    "completed",
    "retryable",
    "failed",
    "cancelled",
    "waiting_external",
)
"""The labels of ``awa.job_state`` in their declared order; the index is the unique-mask bit."""

job_state = ENUM(
    *JOB_STATES, name="job_state", schema=AWA_SCHEMA, create_type=False, metadata=metadata
)

Timestamp = DateTime(timezone=True)


def _job_columns() -> list[Column[object]]:
    """The 27 columns shared, in the same order, by ``jobs_hot`` and ``scheduled_jobs``."""
    return [
        Column("id", BigInteger, primary_key=True),
        Column("kind", Text, nullable=False),
        Column("queue", Text, nullable=False),
        Column("args", JSONB, nullable=False),
        Column("state", job_state, nullable=False),
        Column("priority", SmallInteger, nullable=False),
        Column("attempt", SmallInteger, nullable=False),
        Column("max_attempts", SmallInteger, nullable=False),
        Column("run_at", Timestamp, nullable=False),
        Column("heartbeat_at", Timestamp),
        Column("deadline_at", Timestamp),
        Column("attempted_at", Timestamp),
        Column("finalized_at", Timestamp),
        Column("created_at", Timestamp, nullable=False),
        Column("errors", ARRAY(JSONB)),
        Column("metadata", JSONB, nullable=False),
        Column("tags", ARRAY(Text), nullable=False),
        Column("unique_key", LargeBinary),
        Column("unique_states", BIT(8)),
        Column("callback_id", Uuid),
        Column("callback_timeout_at", Timestamp),
        Column("callback_filter", Text),
        Column("callback_on_complete", Text),
        Column("callback_on_fail", Text),
        Column("callback_transform", Text),
        Column("run_lease", BigInteger, nullable=False),
        Column("progress", JSONB),
    ]


jobs_hot = Table("jobs_hot", metadata, *_job_columns(), schema=AWA_SCHEMA)
scheduled_jobs = Table("scheduled_jobs", metadata, *_job_columns(), schema=AWA_SCHEMA)

CALLBACK_COLUMNS = (
    "callback_id",
    "callback_timeout_at",
    "callback_filter",
    "callback_on_complete",
    "callback_on_fail",
    "callback_transform",
)

job_unique_claims = Table(
    "job_unique_claims",
    metadata,
    Column("unique_key", LargeBinary, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    schema=AWA_SCHEMA,
)

storage_transition_state = Table(
    "storage_transition_state",
    metadata,
    Column("singleton", Boolean, primary_key=True),
    Column("current_engine", Text, nullable=False),
    Column("prepared_engine", Text),
    Column("state", Text, nullable=False),
    Column("transition_epoch", BigInteger, nullable=False),
    Column("details", JSONB, nullable=False),
    Column("entered_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Column("finalized_at", Timestamp),
    schema=AWA_SCHEMA,
)

postgres_catalog = MetaData()
"""PostgreSQL's own catalog, apart from Awa's tables (nothing here is created or compared)."""

pg_proc = Table("pg_proc", postgres_catalog, schema="pg_catalog")
"""Read by the routing guard: the installed routing functions' bodies. The guard names ``oid``
and ``prosrc`` unqualified in its text (``awa_sa.settle.statements.canonical._bodies_known``), so no
column is declared here."""
