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
# The receipt plane is partitioned by claim slot, materialised leases by lease slot: 8 each in
# the default substrate (install_queue_storage_substrate('awa', 16, 8, 8, true)).
CLAIM_SLOT_COUNT = 8
LEASE_SLOT_COUNT = 8

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


_COMPLETION_BATCHES_COMMENT = (
    "Append-only compact history for successful receipt-backed completions. Each row stores "
    "one completion batch and expands through terminal_jobs; matching receipt claims are "
    "closed through lease_claim_closure_batches in the claim ring."
)


def _completion_batches(s: str, q: str) -> str:
    """Where a runtime (and awa-sa) records a bare job's completion instead of a done row."""
    partitions = _per_slot(
        SLOT_COUNT,
        f"CREATE TABLE {q}.receipt_completion_batches_{{n}} "
        f"PARTITION OF {q}.receipt_completion_batches FOR VALUES IN ({{n}});\n"
        f"CREATE INDEX idx_{s}_receipt_completion_batches_{{n}}_lane "
        f"ON {q}.receipt_completion_batches_{{n}} "
        "(ready_generation, queue, priority, enqueue_shard);\n",
    )
    return (
        f"""
CREATE SEQUENCE {q}.receipt_completion_batch_id_seq AS bigint START 1 CACHE 1;
CREATE TABLE {q}.receipt_completion_batches (
    ready_slot       integer       NOT NULL,
    ready_generation bigint        NOT NULL,
    batch_id         bigint        NOT NULL
        DEFAULT nextval('{s}.receipt_completion_batch_id_seq'),
    claim_slot       integer       NOT NULL,
    queue            text          NOT NULL,
    priority         smallint      NOT NULL,
    enqueue_shard    smallint      NOT NULL DEFAULT 0,
    completed_count  integer       NOT NULL,
    job_ids          bigint[]      NOT NULL,
    run_leases       bigint[]      NOT NULL,
    lane_seqs        bigint[]      NOT NULL,
    attempts         smallint[]    NOT NULL,
    attempted_ats    timestamptz[] NOT NULL,
    finalized_at     timestamptz   NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT receipt_completion_batches_pkey PRIMARY KEY (ready_slot, batch_id),
    CONSTRAINT receipt_completion_batches_completed_count_check CHECK (completed_count > 0),
    CONSTRAINT receipt_completion_batches_check CHECK (completed_count = cardinality(job_ids)),
    CONSTRAINT receipt_completion_batches_check1
        CHECK (completed_count = cardinality(run_leases)),
    CONSTRAINT receipt_completion_batches_check2
        CHECK (completed_count = cardinality(lane_seqs)),
    CONSTRAINT receipt_completion_batches_check3
        CHECK (completed_count = cardinality(attempts)),
    CONSTRAINT receipt_completion_batches_check4
        CHECK (completed_count = cardinality(attempted_ats))
) PARTITION BY LIST (ready_slot);
COMMENT ON TABLE {q}.receipt_completion_batches IS '{_COMPLETION_BATCHES_COMMENT}';
"""
        + partitions
    )


_CLAIM_ATTEMPTS_COMMENT = (
    "Append-only queue-slot-local ledger of emitted claim-attempt batches. Claim cursor "
    "recovery checks this compact lane-range evidence instead of scanning claim-ring "
    "partitions, and queue prune reclaims it with the matching ready segment."
)


def _claim_attempt_batches(s: str, q: str) -> str:
    """What every claim writes beside its receipts: the lane range and the claim's own clock."""
    partitions = _per_slot(
        SLOT_COUNT,
        f"""
CREATE TABLE {q}.ready_claim_attempt_batches_{{n}}
    PARTITION OF {q}.ready_claim_attempt_batches FOR VALUES IN ({{n}});
CREATE INDEX idx_{s}_ready_claim_attempt_batches_{{n}}_claim_slot
    ON {q}.ready_claim_attempt_batches_{{n}} (claim_slot) WHERE claim_slot IS NOT NULL;
CREATE INDEX idx_{s}_ready_claim_attempt_batches_{{n}}_lane
    ON {q}.ready_claim_attempt_batches_{{n}}
    (ready_generation, queue, priority, enqueue_shard, next_lane_seq, first_lane_seq);
""",
    )
    return (
        f"""
CREATE SEQUENCE {q}.ready_claim_attempt_batch_id_seq AS bigint START 1 CACHE 1;
CREATE TABLE {q}.ready_claim_attempt_batches (
    ready_slot       integer        NOT NULL,
    ready_generation bigint         NOT NULL,
    batch_id         bigint         NOT NULL
        DEFAULT nextval('{s}.ready_claim_attempt_batch_id_seq'),
    queue            text           NOT NULL,
    priority         smallint       NOT NULL,
    enqueue_shard    smallint       NOT NULL DEFAULT 0,
    claim_slot       integer,
    first_lane_seq   bigint         NOT NULL,
    next_lane_seq    bigint         NOT NULL,
    claimed_count    integer        NOT NULL,
    lane_ranges      int8multirange NOT NULL,
    claimed_at       timestamptz    NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT ready_claim_attempt_batches_pkey PRIMARY KEY (ready_slot, batch_id),
    CONSTRAINT ready_claim_attempt_batches_check CHECK (first_lane_seq < next_lane_seq),
    CONSTRAINT ready_claim_attempt_batches_claimed_count_check CHECK (claimed_count > 0)
) PARTITION BY LIST (ready_slot);
COMMENT ON TABLE {q}.ready_claim_attempt_batches IS '{_CLAIM_ATTEMPTS_COMMENT}';
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


_CLAIM_BATCHES_COMMENT = (
    "Append-only compact receipt-claim ledger. Zero-deadline receipt claims can store one row "
    "per claim batch here instead of one lease_claims row per job; cold paths expand by "
    "receipt_id and materialize only when needed."
)

_CLOSURE_BATCHES_COMMENT = (
    "Append-only compact closure evidence for high-volume receipt completions. Each row closes "
    "a batch of immutable receipt claims by receipt_id, whether those claims live as row-local "
    "lease_claims rows or compact lease_claim_batches items, and is reclaimed with the matching "
    "claim-slot partition."
)


def _per_slot(count: int, ddl: str) -> str:
    return "".join(ddl.format(n=n) for n in range(count))


def _receipts(s: str, q: str) -> str:
    """The receipt plane: the claims a queue-storage runtime holds, and what closes them.

    awa-sa only reads these (running attempts are the open receipts), but a running attempt is
    told apart from a settled one by every kind of closure evidence, so all of it is here, and
    ``attempt_state``, where a receipt's heartbeats go.
    Indexes declared on a parent are named by PostgreSQL on each partition, as in v040; the
    per-partition ``idx_<S>_...`` indexes are v040's own per-child ones.
    """
    hot = _HOT_ROW_OPTIONS.format(n=200)
    attempt_state_options = hot.replace("fillfactor = 50", "fillfactor = 80")
    lease_claims = _per_slot(
        CLAIM_SLOT_COUNT,
        f"CREATE TABLE {q}.lease_claims_{{n}} PARTITION OF {q}.lease_claims "
        f"FOR VALUES IN ({{n}}) WITH ({hot});\n",
    )
    claim_batches = _per_slot(
        CLAIM_SLOT_COUNT,
        f"""
CREATE TABLE {q}.lease_claim_batches_{{n}} PARTITION OF {q}.lease_claim_batches
    FOR VALUES IN ({{n}});
CREATE INDEX idx_{s}_lease_claim_batches_{{n}}_ready_ref
    ON {q}.lease_claim_batches_{{n}} (ready_slot, ready_generation);
CREATE INDEX idx_{s}_lease_claim_batches_{{n}}_receipt_ranges
    ON {q}.lease_claim_batches_{{n}} USING gist (receipt_ranges);
CREATE INDEX idx_{s}_lease_claim_batches_{{n}}_rescue_cursor
    ON {q}.lease_claim_batches_{{n}} (claimed_at, batch_id);
""",
    )
    closures = _per_slot(
        CLAIM_SLOT_COUNT,
        f"CREATE TABLE {q}.lease_claim_closures_{{n}} PARTITION OF {q}.lease_claim_closures "
        f"FOR VALUES IN ({{n}});\n",
    )
    closure_batches = _per_slot(
        CLAIM_SLOT_COUNT,
        f"""
CREATE TABLE {q}.lease_claim_closure_batches_{{n}} PARTITION OF {q}.lease_claim_closure_batches
    FOR VALUES IN ({{n}});
CREATE INDEX idx_{s}_lease_claim_closure_batches_{{n}}_ready_ref
    ON {q}.lease_claim_closure_batches_{{n}} (ready_slot, ready_generation)
    WHERE ready_slot IS NOT NULL;
CREATE INDEX idx_{s}_lease_claim_closure_batches_{{n}}_receipt_ranges
    ON {q}.lease_claim_closure_batches_{{n}} USING gist (receipt_ranges);
""",
    )
    leases = _per_slot(
        LEASE_SLOT_COUNT,
        f"""
CREATE TABLE {q}.leases_{{n}} PARTITION OF {q}.leases FOR VALUES IN ({{n}}) WITH ({hot});
CREATE INDEX idx_{s}_leases_{{n}}_callback ON {q}.leases_{{n}} (callback_id);
CREATE INDEX idx_{s}_leases_{{n}}_job ON {q}.leases_{{n}} (job_id, run_lease);
CREATE INDEX idx_{s}_leases_{{n}}_lane_shard
    ON {q}.leases_{{n}} (queue, priority, enqueue_shard, lane_seq);
CREATE INDEX idx_{s}_leases_{{n}}_ready_ref ON {q}.leases_{{n}} (ready_slot, ready_generation);
CREATE INDEX idx_{s}_leases_{{n}}_state_callback_timeout
    ON {q}.leases_{{n}} (state, callback_timeout_at);
CREATE INDEX idx_{s}_leases_{{n}}_state_deadline ON {q}.leases_{{n}} (state, deadline_at);
""",
    )
    return f"""
CREATE SEQUENCE {q}.lease_claim_receipt_id_seq AS bigint START 1 CACHE 1;
CREATE SEQUENCE {q}.lease_claim_batch_id_seq AS bigint START 1 CACHE 1;
CREATE SEQUENCE {q}.lease_claim_closure_batch_id_seq AS bigint START 1 CACHE 1;

CREATE TABLE {q}.lease_claims (
    claim_slot       integer     NOT NULL,
    receipt_id       bigint      NOT NULL DEFAULT nextval('{s}.lease_claim_receipt_id_seq'),
    job_id           bigint      NOT NULL,
    run_lease        bigint      NOT NULL,
    ready_slot       integer     NOT NULL,
    ready_generation bigint      NOT NULL,
    queue            text        NOT NULL,
    priority         smallint    NOT NULL,
    attempt          smallint    NOT NULL,
    max_attempts     smallint    NOT NULL,
    lane_seq         bigint      NOT NULL,
    enqueue_shard    smallint    NOT NULL DEFAULT 0,
    claimed_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    materialized_at  timestamptz,
    closed_at        timestamptz,
    deadline_at      timestamptz,
    CONSTRAINT lease_claims_pkey PRIMARY KEY (claim_slot, job_id, run_lease)
) PARTITION BY LIST (claim_slot);
CREATE INDEX idx_{s}_lease_claims_deadline_brin ON {q}.lease_claims
    USING brin (deadline_at) WITH (pages_per_range = 16);
CREATE INDEX idx_{s}_lease_claims_deadline_cursor ON {q}.lease_claims
    (deadline_at, job_id, run_lease) WHERE deadline_at IS NOT NULL;
CREATE INDEX idx_{s}_lease_claims_job_run ON {q}.lease_claims (job_id, run_lease);
CREATE INDEX idx_{s}_lease_claims_ready_ref ON {q}.lease_claims (ready_slot, ready_generation);
CREATE INDEX idx_{s}_lease_claims_rescue_cursor ON {q}.lease_claims
    (claimed_at, job_id, run_lease);
CREATE INDEX idx_{s}_lease_claims_stale ON {q}.lease_claims
    (materialized_at, claimed_at, job_id);
{lease_claims}
CREATE TABLE {q}.lease_claim_batches (
    claim_slot       integer        NOT NULL,
    batch_id         bigint         NOT NULL DEFAULT nextval('{s}.lease_claim_batch_id_seq'),
    ready_slot       integer        NOT NULL,
    ready_generation bigint         NOT NULL,
    queue            text           NOT NULL,
    priority         smallint       NOT NULL,
    enqueue_shard    smallint       NOT NULL DEFAULT 0,
    claimed_count    integer        NOT NULL,
    job_ids          bigint[]       NOT NULL,
    run_leases       bigint[]       NOT NULL,
    receipt_ids      bigint[]       NOT NULL,
    receipt_ranges   int8multirange NOT NULL,
    lane_seqs        bigint[]       NOT NULL,
    attempts         smallint[]     NOT NULL,
    max_attempts     smallint[]     NOT NULL,
    deadline_at      timestamptz,
    claimed_at       timestamptz    NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT lease_claim_batches_pkey PRIMARY KEY (claim_slot, batch_id),
    CONSTRAINT lease_claim_batches_claimed_count_check CHECK (claimed_count > 0),
    CONSTRAINT lease_claim_batches_check CHECK (claimed_count = cardinality(job_ids)),
    CONSTRAINT lease_claim_batches_check1 CHECK (claimed_count = cardinality(run_leases)),
    CONSTRAINT lease_claim_batches_check2 CHECK (claimed_count = cardinality(receipt_ids)),
    CONSTRAINT lease_claim_batches_check3 CHECK (claimed_count = cardinality(lane_seqs)),
    CONSTRAINT lease_claim_batches_check4 CHECK (claimed_count = cardinality(attempts)),
    CONSTRAINT lease_claim_batches_check5 CHECK (claimed_count = cardinality(max_attempts))
) PARTITION BY LIST (claim_slot);
COMMENT ON TABLE {q}.lease_claim_batches IS '{_CLAIM_BATCHES_COMMENT}';
{claim_batches}
CREATE TABLE {q}.lease_claim_closures (
    claim_slot integer     NOT NULL,
    job_id     bigint      NOT NULL,
    run_lease  bigint      NOT NULL,
    outcome    text        NOT NULL,
    closed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT lease_claim_closures_pkey PRIMARY KEY (claim_slot, job_id, run_lease)
) PARTITION BY LIST (claim_slot);
CREATE INDEX idx_{s}_lease_claim_closures_job_run ON {q}.lease_claim_closures
    (job_id, run_lease);
{closures}
CREATE TABLE {q}.lease_claim_closure_batches (
    claim_slot       integer        NOT NULL,
    ready_slot       integer,
    ready_generation bigint,
    batch_id         bigint         NOT NULL
        DEFAULT nextval('{s}.lease_claim_closure_batch_id_seq'),
    outcome          text           NOT NULL,
    closed_count     integer        NOT NULL,
    receipt_ids      bigint[]       NOT NULL,
    receipt_ranges   int8multirange NOT NULL,
    closed_at        timestamptz    NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT lease_claim_closure_batches_pkey PRIMARY KEY (claim_slot, batch_id),
    CONSTRAINT lease_claim_closure_batches_closed_count_check CHECK (closed_count > 0),
    CONSTRAINT lease_claim_closure_batches_check CHECK (closed_count = cardinality(receipt_ids))
) PARTITION BY LIST (claim_slot);
COMMENT ON TABLE {q}.lease_claim_closure_batches IS '{_CLOSURE_BATCHES_COMMENT}';
{closure_batches}
CREATE TABLE {q}.leases (
    lease_slot          integer       NOT NULL,
    lease_generation    bigint        NOT NULL,
    ready_slot          integer       NOT NULL,
    ready_generation    bigint        NOT NULL,
    job_id              bigint        NOT NULL,
    queue               text          NOT NULL,
    state               awa.job_state NOT NULL DEFAULT 'running',
    priority            smallint      NOT NULL,
    attempt             smallint      NOT NULL DEFAULT 1,
    run_lease           bigint        NOT NULL DEFAULT 1,
    max_attempts        smallint      NOT NULL DEFAULT 25,
    lane_seq            bigint        NOT NULL,
    enqueue_shard       smallint      NOT NULL DEFAULT 0,
    heartbeat_at        timestamptz,
    deadline_at         timestamptz,
    attempted_at        timestamptz,
    callback_id         uuid,
    callback_timeout_at timestamptz,
    CONSTRAINT leases_pkey PRIMARY KEY (lease_slot, queue, priority, enqueue_shard, lane_seq)
) PARTITION BY LIST (lease_slot);
{leases}
CREATE TABLE {q}.attempt_state (
    job_id               bigint      NOT NULL,
    run_lease            bigint      NOT NULL,
    heartbeat_at         timestamptz,
    progress             jsonb,
    callback_filter      text,
    callback_on_complete text,
    callback_on_fail     text,
    callback_transform   text,
    callback_result      jsonb,
    updated_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT attempt_state_pkey PRIMARY KEY (job_id, run_lease)
) WITH ({attempt_state_options});

CREATE TABLE {q}.dlq_entries (
    job_id             bigint        NOT NULL,
    kind               text          NOT NULL,
    queue              text          NOT NULL,
    args               jsonb         NOT NULL DEFAULT '{{}}',
    state              awa.job_state NOT NULL DEFAULT 'failed',
    priority           smallint      NOT NULL,
    attempt            smallint      NOT NULL DEFAULT 1,
    run_lease          bigint        NOT NULL DEFAULT 1,
    max_attempts       smallint      NOT NULL DEFAULT 25,
    run_at             timestamptz   NOT NULL DEFAULT clock_timestamp(),
    attempted_at       timestamptz,
    finalized_at       timestamptz   NOT NULL DEFAULT clock_timestamp(),
    created_at         timestamptz   NOT NULL DEFAULT clock_timestamp(),
    unique_key         bytea,
    unique_states      text,
    payload            jsonb,
    dlq_reason         text          NOT NULL,
    dlq_at             timestamptz   NOT NULL DEFAULT clock_timestamp(),
    original_run_lease bigint        NOT NULL,
    CONSTRAINT dlq_entries_pkey PRIMARY KEY (job_id)
);
CREATE INDEX idx_{s}_dlq_queue_time ON {q}.dlq_entries (queue, dlq_at DESC);
"""


def tables_sql(schema: str) -> tuple[str, ...]:
    """The table DDL for *schema*, which the caller has already vetted."""
    q = ident(schema)
    return (
        _deferred_jobs(schema, q),
        _ready_entries(schema, q),
        _done_entries(schema, q),
        _terminal_count_deltas(q),
        _completion_batches(schema, q),
        _claim_attempt_batches(schema, q),
        _lanes_and_ring(q),
        _receipts(schema, q),
    )
