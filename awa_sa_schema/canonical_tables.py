"""DDL of the canonical plane's types, sequence, tables and indexes (schema ``awa``).

Every column list, default, constraint name and index here is written so that PostgreSQL's
catalog printers (``format_type``, ``pg_get_expr``, ``pg_get_constraintdef``,
``pg_get_indexdef``) reproduce the facts recorded in ``v040_catalog.json`` for a database built
by awa-cli 0.6.9. Column order matters: it is part of those facts, and ``INSERT ... SELECT *``
style statements depend on it.
"""

from __future__ import annotations

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

# v040 has no row for version 8 (the reference database skips it), so neither does the fixture.
SCHEMA_VERSIONS = tuple(v for v in range(1, 41) if v != 8)

_ENUM_LABELS = ", ".join(f"'{state}'" for state in JOB_STATES)

TYPES_AND_SEQUENCES = f"""
CREATE SCHEMA awa;
CREATE TYPE awa.job_state AS ENUM ({_ENUM_LABELS});
CREATE SEQUENCE awa.jobs_id_seq AS bigint START 1 CACHE 1;
"""


def _jobs_table(table: str, state_default: str, state_check: str) -> str:
    """``jobs_hot`` and ``scheduled_jobs`` share their shape; only the state rules differ."""
    return f"""
CREATE TABLE awa.{table} (
    id                   bigint        NOT NULL DEFAULT nextval('awa.jobs_id_seq'),
    kind                 text          NOT NULL,
    queue                text          NOT NULL DEFAULT 'default',
    args                 jsonb         NOT NULL DEFAULT '{{}}',
    state                awa.job_state NOT NULL DEFAULT '{state_default}',
    priority             smallint      NOT NULL DEFAULT 2,
    attempt              smallint      NOT NULL DEFAULT 0,
    max_attempts         smallint      NOT NULL DEFAULT 25,
    run_at               timestamptz   NOT NULL DEFAULT now(),
    heartbeat_at         timestamptz,
    deadline_at          timestamptz,
    attempted_at         timestamptz,
    finalized_at         timestamptz,
    created_at           timestamptz   NOT NULL DEFAULT now(),
    errors               jsonb[]       DEFAULT '{{}}',
    metadata             jsonb         NOT NULL DEFAULT '{{}}',
    tags                 text[]        NOT NULL DEFAULT '{{}}',
    unique_key           bytea,
    unique_states        bit(8),
    callback_id          uuid,
    callback_timeout_at  timestamptz,
    callback_filter      text,
    callback_on_complete text,
    callback_on_fail     text,
    callback_transform   text,
    run_lease            bigint        NOT NULL DEFAULT 0,
    progress             jsonb,
    CONSTRAINT {table}_pkey PRIMARY KEY (id),
    CONSTRAINT {table}_state_check CHECK ({state_check}),
    CONSTRAINT {table}_priority_in_range CHECK (priority BETWEEN 1 AND 4),
    CONSTRAINT {table}_max_attempts_range CHECK (max_attempts BETWEEN 1 AND 1000),
    CONSTRAINT {table}_queue_name_length CHECK (length(queue) <= 200),
    CONSTRAINT {table}_kind_length CHECK (length(kind) <= 200),
    CONSTRAINT {table}_tags_count CHECK (cardinality(tags) <= 20)
);
CREATE INDEX idx_awa_{table}_created_at ON awa.{table} USING brin (created_at)
    WITH (pages_per_range = 32);
CREATE INDEX idx_awa_{table}_kind_state ON awa.{table} (kind, state);
CREATE INDEX idx_awa_{table}_queue_state ON awa.{table} (queue, state);
CREATE INDEX idx_awa_{table}_tags ON awa.{table} USING gin (tags)
    WHERE tags IS NOT NULL AND tags <> '{{}}';
"""


JOBS_HOT = (
    _jobs_table("jobs_hot", "available", "state NOT IN ('scheduled', 'retryable')")
    + """
CREATE UNIQUE INDEX idx_awa_jobs_hot_callback_id ON awa.jobs_hot (callback_id)
    WHERE callback_id IS NOT NULL;
CREATE INDEX idx_awa_jobs_hot_callback_timeout ON awa.jobs_hot (callback_timeout_at)
    WHERE state = 'waiting_external' AND callback_timeout_at IS NOT NULL;
CREATE INDEX idx_awa_jobs_hot_completed_finalized ON awa.jobs_hot (finalized_at DESC, queue)
    WHERE state = 'completed' AND finalized_at IS NOT NULL;
CREATE INDEX idx_awa_jobs_hot_deadline ON awa.jobs_hot (deadline_at)
    WHERE state = 'running' AND deadline_at IS NOT NULL;
CREATE INDEX idx_awa_jobs_hot_dequeue ON awa.jobs_hot (queue, priority, run_at, id)
    WHERE state = 'available';
CREATE INDEX idx_awa_jobs_hot_heartbeat ON awa.jobs_hot (heartbeat_at)
    WHERE state = 'running';
"""
)

SCHEDULED_JOBS = (
    _jobs_table("scheduled_jobs", "scheduled", "state IN ('scheduled', 'retryable')")
    + """
CREATE INDEX idx_awa_scheduled_jobs_run_at_scheduled ON awa.scheduled_jobs (run_at, id, queue)
    WHERE state = 'scheduled';
CREATE INDEX idx_awa_scheduled_jobs_run_at_retryable ON awa.scheduled_jobs (run_at, id, queue)
    WHERE state = 'retryable';
"""
)

# No primary key and no UNIQUE constraint on purpose: v040 has only this unique index, and its
# name is what a conflicting claim reports as the constraint (idx_awa_jobs_unique).
UNIQUE_CLAIMS = """
CREATE TABLE awa.job_unique_claims (
    unique_key bytea  NOT NULL,
    job_id     bigint NOT NULL
);
CREATE UNIQUE INDEX idx_awa_jobs_unique ON awa.job_unique_claims (unique_key);
"""

# Keyless append-only tables: the wait_free_dirty_marks patch made the triggers plain inserts.
DIRTY_MARKS = """
CREATE TABLE awa.admin_dirty_queue_marks (
    queue      text        NOT NULL,
    touched_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE awa.admin_dirty_kind_marks (
    kind       text        NOT NULL,
    touched_at timestamptz NOT NULL DEFAULT now()
);
"""

STORAGE_ROUTING = """
CREATE TABLE awa.storage_transition_state (
    singleton        boolean     NOT NULL DEFAULT true,
    current_engine   text        NOT NULL,
    prepared_engine  text,
    state            text        NOT NULL,
    transition_epoch bigint      NOT NULL DEFAULT 0,
    details          jsonb       NOT NULL DEFAULT '{}',
    entered_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finalized_at     timestamptz,
    CONSTRAINT storage_transition_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT storage_transition_state_singleton_check CHECK (singleton),
    CONSTRAINT storage_transition_state_current_engine_check CHECK (btrim(current_engine) <> ''),
    CONSTRAINT storage_transition_state_state_check
        CHECK (state IN ('canonical', 'prepared', 'mixed_transition', 'active')),
    CONSTRAINT storage_transition_state_check
        CHECK (state NOT IN ('prepared', 'mixed_transition') OR prepared_engine IS NOT NULL)
);
-- A fresh v040 cluster starts canonical at epoch 0 with empty details.
INSERT INTO awa.storage_transition_state (current_engine, state) VALUES ('canonical', 'canonical');

CREATE TABLE awa.runtime_storage_backends (
    backend     text        NOT NULL,
    schema_name text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT runtime_storage_backends_pkey PRIMARY KEY (backend)
);
"""

_VERSION_ROWS = ",\n    ".join(
    f"({v}, 'awa-sa test fixture: stands in for Awa schema v{v:03d}')" for v in SCHEMA_VERSIONS
)

SCHEMA_VERSION = f"""
CREATE TABLE awa.schema_version (
    version     integer     NOT NULL,
    description text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);
INSERT INTO awa.schema_version (version, description) VALUES
    {_VERSION_ROWS};
"""

ALL = (
    TYPES_AND_SEQUENCES,
    JOBS_HOT,
    SCHEDULED_JOBS,
    UNIQUE_CLAIMS,
    DIRTY_MARKS,
    STORAGE_ROUTING,
    SCHEMA_VERSION,
)
