"""DDL of the queue-storage tables for one schema ``S``.

v040 installs the same substrate in every queue-storage schema, with ``S`` embedded in index
names (``idx_<S>_...``); the default substrate lives in ``awa`` itself. One generator serves every
``S`` so that ``awa`` and a named schema can never drift apart. The job-state type is always
``awa.job_state``, whatever ``S`` is.
"""

from __future__ import annotations

from ._sql import ident

# v040 installs 16 ring slots; every ready_slot value needs a partition or inserts fail.
SLOT_COUNT = 16

# Reloptions exactly as v040 stores them (the text is kept verbatim, so "0.0" stays "0.0").
_HOT_ROW_OPTIONS = (
    "fillfactor = 50, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = {n}, "
    "autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2"
)

_DELTAS_COMMENT = (
    "Append-only signed terminal-count deltas. Completion/delete paths insert here; maintenance "
    "folds sealed-slot deltas into queue_terminal_live_counts when no visible backend snapshot "
    "or idle transaction id pins the MVCC horizon, and queue prune truncates the matching "
    "partition."
)


def _deferred_jobs(s: str, q: str) -> str:
    return f"""
CREATE SEQUENCE {q}.job_id_seq AS bigint START 1 CACHE 1;

CREATE TABLE {q}.deferred_jobs (
    job_id        bigint        NOT NULL,
    kind          text          NOT NULL,
    queue         text          NOT NULL,
    args          jsonb         NOT NULL DEFAULT '{{}}',
    state         awa.job_state NOT NULL,
    priority      smallint      NOT NULL,
    attempt       smallint      NOT NULL DEFAULT 0,
    run_lease     bigint        NOT NULL DEFAULT 0,
    max_attempts  smallint      NOT NULL DEFAULT 25,
    run_at        timestamptz   NOT NULL,
    attempted_at  timestamptz,
    finalized_at  timestamptz,
    created_at    timestamptz   NOT NULL DEFAULT clock_timestamp(),
    unique_key    bytea,
    unique_states text,
    payload       jsonb,
    CONSTRAINT deferred_jobs_pkey PRIMARY KEY (job_id),
    CONSTRAINT deferred_jobs_state_check CHECK (state IN ('scheduled', 'retryable'))
);
CREATE INDEX idx_{s}_deferred_due ON {q}.deferred_jobs (state, run_at, queue, priority, job_id);
CREATE INDEX idx_{s}_deferred_job_unique ON {q}.deferred_jobs (unique_key);
"""


def _ready_entries(s: str, q: str) -> str:
    partitions = "".join(
        f"""
CREATE TABLE {q}.ready_entries_{n} PARTITION OF {q}.ready_entries FOR VALUES IN ({n});
CREATE INDEX idx_{s}_ready_{n}_job ON {q}.ready_entries_{n} (job_id);
CREATE INDEX idx_{s}_ready_{n}_lane_shard
    ON {q}.ready_entries_{n} (queue, priority, enqueue_shard, lane_seq);
"""
        for n in range(SLOT_COUNT)
    )
    return (
        f"""
CREATE TABLE {q}.ready_entries (
    ready_slot       integer     NOT NULL,
    ready_generation bigint      NOT NULL,
    job_id           bigint      NOT NULL,
    kind             text        NOT NULL,
    queue            text        NOT NULL,
    args             jsonb       NOT NULL DEFAULT '{{}}',
    priority         smallint    NOT NULL,
    attempt          smallint    NOT NULL DEFAULT 0,
    run_lease        bigint      NOT NULL DEFAULT 0,
    max_attempts     smallint    NOT NULL DEFAULT 25,
    lane_seq         bigint      NOT NULL,
    enqueue_shard    smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempted_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    unique_key       bytea,
    unique_states    text,
    payload          jsonb,
    CONSTRAINT ready_entries_pkey
        PRIMARY KEY (ready_slot, queue, priority, enqueue_shard, lane_seq)
) PARTITION BY LIST (ready_slot);
"""
        + partitions
    )


def _done_entries(s: str, q: str) -> str:
    partitions = "".join(
        f"""
CREATE TABLE {q}.done_entries_{n} PARTITION OF {q}.done_entries FOR VALUES IN ({n});
CREATE INDEX idx_{s}_done_{n}_failed_queue ON {q}.done_entries_{n} (queue)
    WHERE state = 'failed';
CREATE INDEX idx_{s}_done_{n}_job ON {q}.done_entries_{n} (job_id);
CREATE INDEX idx_{s}_done_{n}_lane_shard
    ON {q}.done_entries_{n} (queue, priority, enqueue_shard, lane_seq);
"""
        for n in range(SLOT_COUNT)
    )
    return (
        f"""
CREATE TABLE {q}.done_entries (
    ready_slot       integer       NOT NULL,
    ready_generation bigint        NOT NULL,
    job_id           bigint        NOT NULL,
    kind             text          NOT NULL,
    queue            text          NOT NULL,
    args             jsonb,
    state            awa.job_state NOT NULL DEFAULT 'completed',
    priority         smallint      NOT NULL,
    attempt          smallint      NOT NULL DEFAULT 1,
    run_lease        bigint        NOT NULL DEFAULT 1,
    max_attempts     smallint,
    lane_seq         bigint        NOT NULL,
    enqueue_shard    smallint      NOT NULL DEFAULT 0,
    run_at           timestamptz,
    attempted_at     timestamptz,
    finalized_at     timestamptz   NOT NULL DEFAULT clock_timestamp(),
    created_at       timestamptz,
    unique_key       bytea,
    unique_states    text,
    payload          jsonb,
    CONSTRAINT done_entries_pkey
        PRIMARY KEY (ready_slot, queue, priority, enqueue_shard, lane_seq)
) PARTITION BY LIST (ready_slot);
"""
        + partitions
    )


def _terminal_count_deltas(q: str) -> str:
    partitions = "".join(
        f"CREATE TABLE {q}.queue_terminal_count_deltas_{n} "
        f"PARTITION OF {q}.queue_terminal_count_deltas FOR VALUES IN ({n});\n"
        for n in range(SLOT_COUNT)
    )
    return (
        f"""
CREATE TABLE {q}.queue_terminal_count_deltas (
    ready_slot       integer     NOT NULL,
    ready_generation bigint      NOT NULL,
    queue            text        NOT NULL,
    priority         smallint    NOT NULL,
    enqueue_shard    smallint    NOT NULL,
    counter_bucket   smallint    NOT NULL DEFAULT 0,
    terminal_delta   bigint      NOT NULL,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT queue_terminal_count_deltas_nonzero CHECK (terminal_delta <> 0)
) PARTITION BY LIST (ready_slot);
COMMENT ON TABLE {q}.queue_terminal_count_deltas IS '{_DELTAS_COMMENT}';
"""
        + partitions
    )


def _lanes_and_ring(q: str) -> str:
    heads = _HOT_ROW_OPTIONS.format(n=200)
    ring = _HOT_ROW_OPTIONS.format(n=50)
    return f"""
CREATE TABLE {q}.queue_lanes (
    queue                  text     NOT NULL,
    priority               smallint NOT NULL,
    next_seq               bigint   NOT NULL DEFAULT 1,
    claim_seq              bigint   NOT NULL DEFAULT 1,
    pruned_completed_count bigint   NOT NULL DEFAULT 0,
    CONSTRAINT queue_lanes_pkey PRIMARY KEY (queue, priority)
);

CREATE TABLE {q}.queue_enqueue_heads (
    queue         text     NOT NULL,
    priority      smallint NOT NULL,
    enqueue_shard smallint NOT NULL DEFAULT 0,
    next_seq      bigint   NOT NULL DEFAULT 1,
    seq_name      text,
    CONSTRAINT queue_enqueue_heads_pkey PRIMARY KEY (queue, priority, enqueue_shard)
) WITH ({heads});

CREATE TABLE {q}.queue_claim_heads (
    queue                       text     NOT NULL,
    priority                    smallint NOT NULL,
    enqueue_shard               smallint NOT NULL DEFAULT 0,
    claim_seq                   bigint   NOT NULL DEFAULT 1,
    seq_name                    text,
    ready_segment_slot          integer,
    ready_segment_generation    bigint,
    ready_segment_next_lane_seq bigint,
    CONSTRAINT queue_claim_heads_pkey PRIMARY KEY (queue, priority, enqueue_shard)
) WITH ({heads});

CREATE TABLE {q}.queue_ring_state (
    singleton                   boolean     NOT NULL DEFAULT true,
    current_slot                integer     NOT NULL,
    generation                  bigint      NOT NULL,
    slot_count                  integer     NOT NULL,
    terminal_counter_trusted_at timestamptz,
    CONSTRAINT queue_ring_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT queue_ring_state_singleton_check CHECK (singleton)
) WITH ({ring});
-- A fresh substrate writes to slot 0 of generation 0; its (empty) terminal counters are exact.
INSERT INTO {q}.queue_ring_state (current_slot, generation, slot_count, terminal_counter_trusted_at)
VALUES (0, 0, {SLOT_COUNT}, now());
"""


def tables_sql(schema: str) -> tuple[str, ...]:
    """The table DDL for *schema*, which the caller has already vetted."""
    q = ident(schema)
    return (
        _deferred_jobs(schema, q),
        _ready_entries(schema, q),
        _done_entries(schema, q),
        _terminal_count_deltas(q),
        _lanes_and_ring(q),
    )
