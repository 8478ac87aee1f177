# ruff: noqa: E501  (the runtime's statements, copied as they are)
"""The runtime's own rescue statements, as awa-pg 0.6.9 sends them, for race tests.

Copied from the SQL texts in awa-pg 0.6.9's extension module (``strings -w -n 40
awa/_awa.abi3.so``), where each is assembled with ``format!``: ``__S__`` stands for the
queue-storage schema the runtime splices in, and ``__CLOSED__`` for its closure-evidence
predicate (``receipt_closed_evidence_sql`` with the alias ``claims``), also copied below.
Indentation and a few tab characters aside, the text is the runtime's; nothing is changed.
The runtime binds ``$1``, ``$2``, ...; :func:`statement` renames them ``:p1``, ``:p2``, ...
for :func:`sqlalchemy.text`.

These are the runtime's statements, not awa-sa's: the tests run them against a real v040
cluster so that a rescue can be made to take its snapshot, wait on a held lock, and only then
meet a receipt awa-sa settled meanwhile (docs/contract.md#sealed-receipts).
"""

from __future__ import annotations

import re

import sqlalchemy as sa

CLOSED_EVIDENCE = """
(
    claims.closed_at IS NOT NULL
    OR EXISTS (
        SELECT 1 FROM __S__.lease_claim_closures AS closures
        WHERE closures.claim_slot = claims.claim_slot
          AND closures.job_id = claims.job_id
          AND closures.run_lease = claims.run_lease
    )
    OR EXISTS (
        SELECT 1
        FROM __S__.lease_claim_closure_batches AS closure_batches
        WHERE closure_batches.receipt_ranges @> claims.receipt_id
    )
    OR EXISTS (
        SELECT 1 FROM __S__.done_entries AS done
        WHERE done.job_id = claims.job_id
          AND done.run_lease = claims.run_lease
    )
    OR EXISTS (
        SELECT 1 FROM __S__.deferred_jobs AS deferred
        WHERE deferred.job_id = claims.job_id
          AND deferred.run_lease = claims.run_lease
    )
    OR EXISTS (
        SELECT 1 FROM __S__.dlq_entries AS dlq
        WHERE dlq.job_id = claims.job_id
          AND dlq.run_lease = claims.run_lease
    )
)
"""
"""The runtime's test of a ``lease_claims`` receipt's closure (alias ``claims``)."""

DEADLINE_RESCUE = """
WITH cursor_row AS (
    SELECT
        deadline_cursor_deadline_at,
        deadline_cursor_job_id,
        deadline_cursor_run_lease
    FROM __S__.claim_ring_slots
    WHERE slot = $1
    FOR UPDATE
),
after_cursor AS MATERIALIZED (
    SELECT
        claims.claim_slot,
        claims.job_id,
        claims.run_lease,
        row_number() OVER (
            ORDER BY claims.deadline_at, claims.job_id, claims.run_lease
        ) AS rn
    FROM __S__.lease_claims AS claims
    CROSS JOIN cursor_row
    WHERE claims.claim_slot = $1
      AND claims.deadline_at IS NOT NULL
      AND claims.deadline_at < clock_timestamp()
      AND (claims.deadline_at, claims.job_id, claims.run_lease)
          > (
              cursor_row.deadline_cursor_deadline_at,
              cursor_row.deadline_cursor_job_id,
              cursor_row.deadline_cursor_run_lease
            )
    ORDER BY claims.deadline_at, claims.job_id, claims.run_lease
    LIMIT $2
),
after_count AS (
    SELECT count(*)::bigint AS count FROM after_cursor
),
before_cursor AS MATERIALIZED (
    SELECT
        claims.claim_slot,
        claims.job_id,
        claims.run_lease,
        after_count.count + row_number() OVER (
            ORDER BY claims.deadline_at, claims.job_id, claims.run_lease
        ) AS rn
    FROM __S__.lease_claims AS claims
    CROSS JOIN cursor_row
    CROSS JOIN after_count
    WHERE after_count.count < $2
      AND claims.claim_slot = $1
      AND claims.deadline_at IS NOT NULL
      AND claims.deadline_at < clock_timestamp()
      AND (claims.deadline_at, claims.job_id, claims.run_lease)
          <= (
              cursor_row.deadline_cursor_deadline_at,
              cursor_row.deadline_cursor_job_id,
              cursor_row.deadline_cursor_run_lease
            )
    ORDER BY claims.deadline_at, claims.job_id, claims.run_lease
    LIMIT (SELECT GREATEST($2 - count, 0) FROM after_count)
),
candidate_keys AS MATERIALIZED (
    SELECT claim_slot, job_id, run_lease, rn FROM after_cursor
    UNION ALL
    SELECT claim_slot, job_id, run_lease, rn FROM before_cursor
),
candidates AS MATERIALIZED (
    SELECT
        claims.claim_slot,
        claims.ready_slot,
        claims.ready_generation,
        claims.job_id,
        claims.queue,
        'running'::awa.job_state AS state,
        claims.priority,
        claims.attempt,
        claims.run_lease,
        claims.max_attempts,
        claims.lane_seq,
        claims.enqueue_shard,
        claims.claimed_at,
        claims.deadline_at,
        claims.deadline_at < clock_timestamp() AS is_expired,
        __CLOSED__ AS is_closed,
        EXISTS (
            SELECT 1 FROM __S__.leases AS lease
            WHERE lease.job_id = claims.job_id
              AND lease.run_lease = claims.run_lease
        ) AS is_lease_managed,
        candidate_keys.rn
    FROM candidate_keys
    JOIN __S__.lease_claims AS claims
      ON claims.claim_slot = candidate_keys.claim_slot
     AND claims.job_id = candidate_keys.job_id
     AND claims.run_lease = candidate_keys.run_lease
),
expired_candidates AS (
    SELECT candidates.*
    FROM candidates
    WHERE NOT is_closed
      AND NOT is_lease_managed
      AND is_expired
    ORDER BY rn
    LIMIT $3
),
expired_locked AS (
    SELECT expired_candidates.*
    FROM expired_candidates
    JOIN __S__.lease_claims AS claims
      ON claims.claim_slot = expired_candidates.claim_slot
     AND claims.job_id = expired_candidates.job_id
     AND claims.run_lease = expired_candidates.run_lease
    WHERE NOT __CLOSED__
      AND claims.deadline_at < clock_timestamp()
      AND pg_catalog.pg_try_advisory_xact_lock(
          pg_catalog.hashtextextended(
              format('awa.receipt.complete:%s:%s', claims.job_id, claims.run_lease),
              0
          )
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.leases AS lease
          WHERE lease.job_id = claims.job_id
            AND lease.run_lease = claims.run_lease
      )
    FOR UPDATE OF claims SKIP LOCKED
),
inserted AS (
    INSERT INTO __S__.lease_claim_closures (claim_slot, job_id, run_lease, outcome, closed_at)
    SELECT
        expired_locked.claim_slot,
        expired_locked.job_id,
        expired_locked.run_lease,
        'deadline_expired',
        clock_timestamp()
    FROM expired_locked
    ON CONFLICT (claim_slot, job_id, run_lease) DO NOTHING
    RETURNING claim_slot, job_id, run_lease, closed_at
),
marked AS (
    UPDATE __S__.lease_claims AS claims
    SET closed_at = COALESCE(claims.closed_at, inserted.closed_at)
    FROM inserted
    WHERE claims.claim_slot = inserted.claim_slot
      AND claims.job_id = inserted.job_id
      AND claims.run_lease = inserted.run_lease
    RETURNING claims.job_id
),
annotated AS (
    SELECT
        candidates.*,
        (
            candidates.is_closed
            OR candidates.is_lease_managed
            OR EXISTS (
                SELECT 1 FROM inserted
                WHERE inserted.claim_slot = candidates.claim_slot
                  AND inserted.job_id = candidates.job_id
                  AND inserted.run_lease = candidates.run_lease
            )
        ) AS advanceable
    FROM candidates
),
bounded AS (
    SELECT
        annotated.*,
        min(CASE WHEN NOT annotated.advanceable THEN annotated.rn END) OVER () AS first_blocked_rn
    FROM annotated
),
advance_target AS (
    SELECT deadline_at, job_id, run_lease
    FROM bounded
    WHERE first_blocked_rn IS NULL OR rn < first_blocked_rn
    ORDER BY rn DESC
    LIMIT 1
),
advance_cursor AS (
    UPDATE __S__.claim_ring_slots AS slots
    SET deadline_cursor_deadline_at = advance_target.deadline_at,
        deadline_cursor_job_id = advance_target.job_id,
        deadline_cursor_run_lease = advance_target.run_lease
    FROM advance_target
    WHERE slots.slot = $1
    RETURNING slots.slot
),
cursor_advance AS (
    SELECT count(*) FROM advance_cursor
)
SELECT
    expired_locked.ready_slot,
    expired_locked.ready_generation,
    expired_locked.job_id,
    expired_locked.queue,
    expired_locked.state,
    expired_locked.priority,
    expired_locked.attempt,
    expired_locked.run_lease,
    expired_locked.max_attempts,
    expired_locked.lane_seq,
    expired_locked.enqueue_shard,
    expired_locked.claimed_at AS attempted_at
FROM expired_locked
JOIN inserted
  ON inserted.claim_slot = expired_locked.claim_slot
 AND inserted.job_id = expired_locked.job_id
 AND inserted.run_lease = expired_locked.run_lease
CROSS JOIN cursor_advance
"""
"""``rescue_expired_deadlines`` on queue storage: ``lease_claims`` receipts past their
``deadline_at`` in claim slot ``$1`` (``$2`` candidates, ``$3`` rescued at most), closed
``deadline_expired``. Compact receipts have no deadline and are never its candidates."""

RECEIPT_HEARTBEAT_RESCUE = """
WITH cursor_row AS (
    SELECT
        rescue_cursor_claimed_at,
        rescue_cursor_job_id,
        rescue_cursor_run_lease
    FROM __S__.claim_ring_slots
    WHERE slot = $1
    FOR UPDATE
),
claim_source AS MATERIALIZED (
    SELECT
        claims.claim_slot,
        NULL::bigint AS batch_id,
        claims.ready_slot,
        claims.ready_generation,
        claims.job_id,
        claims.queue,
        claims.priority,
        claims.attempt,
        claims.run_lease,
        claims.max_attempts,
        claims.lane_seq,
        claims.enqueue_shard,
        claims.receipt_id,
        claims.claimed_at,
        claims.closed_at,
        false AS compact_batch
    FROM __S__.lease_claims AS claims
    WHERE claims.claim_slot = $1
    UNION ALL
    SELECT
        claim_batches.claim_slot,
        claim_batches.batch_id,
        claim_batches.ready_slot,
        claim_batches.ready_generation,
        items.job_id,
        claim_batches.queue,
        claim_batches.priority,
        items.attempt,
        items.run_lease,
        items.max_attempts,
        items.lane_seq,
        claim_batches.enqueue_shard,
        items.receipt_id,
        claim_batches.claimed_at,
        NULL::timestamptz AS closed_at,
        true AS compact_batch
    FROM __S__.lease_claim_batches AS claim_batches
    CROSS JOIN LATERAL unnest(
        claim_batches.job_ids,
        claim_batches.run_leases,
        claim_batches.receipt_ids,
        claim_batches.lane_seqs,
        claim_batches.attempts,
        claim_batches.max_attempts
    ) AS items(job_id, run_lease, receipt_id, lane_seq, attempt, max_attempts)
    WHERE claim_batches.claim_slot = $1
),
after_cursor AS MATERIALIZED (
    SELECT
        claim_source.claim_slot,
        claim_source.job_id,
        claim_source.run_lease,
        row_number() OVER (
            ORDER BY claim_source.claimed_at, claim_source.job_id, claim_source.run_lease
        ) AS rn
    FROM claim_source
    CROSS JOIN cursor_row
    WHERE claim_source.claimed_at < $2
      AND (claim_source.claimed_at, claim_source.job_id, claim_source.run_lease)
          > (
              cursor_row.rescue_cursor_claimed_at,
              cursor_row.rescue_cursor_job_id,
              cursor_row.rescue_cursor_run_lease
            )
    ORDER BY claim_source.claimed_at, claim_source.job_id, claim_source.run_lease
    LIMIT $3
),
after_count AS (
    SELECT count(*)::bigint AS count FROM after_cursor
),
before_cursor AS MATERIALIZED (
    SELECT
        claim_source.claim_slot,
        claim_source.job_id,
        claim_source.run_lease,
        after_count.count + row_number() OVER (
            ORDER BY claim_source.claimed_at, claim_source.job_id, claim_source.run_lease
        ) AS rn
    FROM claim_source
    CROSS JOIN cursor_row
    CROSS JOIN after_count
    WHERE after_count.count < $3
      AND claim_source.claimed_at < $2
      AND (claim_source.claimed_at, claim_source.job_id, claim_source.run_lease)
          <= (
              cursor_row.rescue_cursor_claimed_at,
              cursor_row.rescue_cursor_job_id,
              cursor_row.rescue_cursor_run_lease
            )
    ORDER BY claim_source.claimed_at, claim_source.job_id, claim_source.run_lease
    LIMIT (SELECT GREATEST($3 - count, 0) FROM after_count)
),
candidate_keys AS MATERIALIZED (
    SELECT claim_slot, job_id, run_lease, rn FROM after_cursor
    UNION ALL
    SELECT claim_slot, job_id, run_lease, rn FROM before_cursor
),
candidates AS MATERIALIZED (
    SELECT
        claim_source.claim_slot,
        claim_source.batch_id,
        claim_source.ready_slot,
        claim_source.ready_generation,
        claim_source.job_id,
        claim_source.queue,
        claim_source.priority,
        claim_source.attempt,
        claim_source.run_lease,
        claim_source.max_attempts,
        claim_source.lane_seq,
        claim_source.enqueue_shard,
        claim_source.receipt_id,
        claim_source.claimed_at,
        claim_source.closed_at,
        claim_source.compact_batch,
        COALESCE(attempt.heartbeat_at, claim_source.claimed_at) < $2 AS is_stale,
        (
            claim_source.closed_at IS NOT NULL
            OR EXISTS (
                SELECT 1 FROM __S__.lease_claim_closures AS closures
                WHERE closures.claim_slot = claim_source.claim_slot
                  AND closures.job_id = claim_source.job_id
                  AND closures.run_lease = claim_source.run_lease
            )
            OR EXISTS (
                SELECT 1
                FROM __S__.lease_claim_closure_batches AS closure_batches
                WHERE closure_batches.receipt_ranges @> claim_source.receipt_id
            )
            OR EXISTS (
                SELECT 1 FROM __S__.done_entries AS done
                WHERE done.job_id = claim_source.job_id
                  AND done.run_lease = claim_source.run_lease
            )
            OR EXISTS (
                SELECT 1 FROM __S__.deferred_jobs AS deferred
                WHERE deferred.job_id = claim_source.job_id
                  AND deferred.run_lease = claim_source.run_lease
            )
            OR EXISTS (
                SELECT 1 FROM __S__.dlq_entries AS dlq
                WHERE dlq.job_id = claim_source.job_id
                  AND dlq.run_lease = claim_source.run_lease
            )
        ) AS is_closed,
        EXISTS (
            SELECT 1 FROM __S__.leases AS lease
            WHERE lease.job_id = claim_source.job_id
              AND lease.run_lease = claim_source.run_lease
        ) AS is_lease_managed,
        candidate_keys.rn
    FROM candidate_keys
    JOIN claim_source
      ON claim_source.claim_slot = candidate_keys.claim_slot
     AND claim_source.job_id = candidate_keys.job_id
     AND claim_source.run_lease = candidate_keys.run_lease
    LEFT JOIN __S__.attempt_state AS attempt
      ON attempt.job_id = claim_source.job_id
     AND attempt.run_lease = claim_source.run_lease
),
stale_candidates AS (
    SELECT candidates.*
    FROM candidates
    WHERE NOT is_closed
      AND NOT is_lease_managed
      AND is_stale
    ORDER BY rn
    LIMIT $4
),
stale_row_locked AS (
    SELECT stale_candidates.*
    FROM stale_candidates
    JOIN __S__.lease_claims AS claims
      ON claims.claim_slot = stale_candidates.claim_slot
     AND claims.job_id = stale_candidates.job_id
     AND claims.run_lease = stale_candidates.run_lease
    WHERE NOT stale_candidates.compact_batch
      AND claims.closed_at IS NULL
      AND NOT EXISTS (
          SELECT 1 FROM __S__.lease_claim_closures AS closures
          WHERE closures.claim_slot = claims.claim_slot
            AND closures.job_id = claims.job_id
            AND closures.run_lease = claims.run_lease
      )
      AND NOT EXISTS (
          SELECT 1
          FROM __S__.lease_claim_closure_batches AS closure_batches
          WHERE closure_batches.receipt_ranges @> claims.receipt_id
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.done_entries AS done
          WHERE done.job_id = claims.job_id
            AND done.run_lease = claims.run_lease
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.deferred_jobs AS deferred
          WHERE deferred.job_id = claims.job_id
            AND deferred.run_lease = claims.run_lease
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.dlq_entries AS dlq
          WHERE dlq.job_id = claims.job_id
            AND dlq.run_lease = claims.run_lease
      )
      AND pg_catalog.pg_try_advisory_xact_lock(
          pg_catalog.hashtextextended(
              format('awa.receipt.complete:%s:%s', claims.job_id, claims.run_lease),
              0
          )
      )
      -- A claim that already materialized into `leases` is
      -- on the lease-side heartbeat-rescue path (see
      -- `rescue_stale_heartbeats`). Rescuing it again here
      -- would write a second closure for an attempt the
      -- runtime is still tracking via its lease row.
      AND NOT EXISTS (
          SELECT 1 FROM __S__.leases AS lease
              WHERE lease.job_id = claims.job_id
                AND lease.run_lease = claims.run_lease
          )
    FOR UPDATE OF claims SKIP LOCKED
),
stale_batch_locked AS (
    SELECT stale_candidates.*
    FROM stale_candidates
    JOIN __S__.lease_claim_batches AS claim_batches
      ON claim_batches.claim_slot = stale_candidates.claim_slot
     AND claim_batches.batch_id = stale_candidates.batch_id
    WHERE stale_candidates.compact_batch
      AND NOT EXISTS (
          SELECT 1 FROM __S__.lease_claim_closures AS closures
          WHERE closures.claim_slot = stale_candidates.claim_slot
            AND closures.job_id = stale_candidates.job_id
            AND closures.run_lease = stale_candidates.run_lease
      )
      AND NOT EXISTS (
          SELECT 1
          FROM __S__.lease_claim_closure_batches AS closure_batches
          WHERE closure_batches.receipt_ranges @> stale_candidates.receipt_id
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.done_entries AS done
          WHERE done.job_id = stale_candidates.job_id
            AND done.run_lease = stale_candidates.run_lease
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.deferred_jobs AS deferred
          WHERE deferred.job_id = stale_candidates.job_id
            AND deferred.run_lease = stale_candidates.run_lease
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.dlq_entries AS dlq
          WHERE dlq.job_id = stale_candidates.job_id
            AND dlq.run_lease = stale_candidates.run_lease
      )
      AND pg_catalog.pg_try_advisory_xact_lock(
          pg_catalog.hashtextextended(
              format('awa.receipt.complete:%s:%s', stale_candidates.job_id, stale_candidates.run_lease),
              0
          )
      )
      AND NOT EXISTS (
          SELECT 1 FROM __S__.leases AS lease
          WHERE lease.job_id = stale_candidates.job_id
            AND lease.run_lease = stale_candidates.run_lease
      )
    FOR UPDATE OF claim_batches SKIP LOCKED
),
stale_locked AS (
    SELECT * FROM stale_row_locked
    UNION ALL
    SELECT * FROM stale_batch_locked
),
-- Row-sourced (deadline lease) claims close explicitly so the
-- prune gates balance them against the lease_claims row.
-- Compact batch-sourced claims have no lease_claims row to
-- JOIN, so they close into the batch ledger the queue prune
-- gate counts via compact_count.
inserted AS (
    INSERT INTO __S__.lease_claim_closures (claim_slot, job_id, run_lease, outcome, closed_at)
    SELECT stale_locked.claim_slot, stale_locked.job_id, stale_locked.run_lease, 'rescued', clock_timestamp()
    FROM stale_locked
    WHERE NOT stale_locked.compact_batch
    ON CONFLICT (claim_slot, job_id, run_lease) DO NOTHING
    RETURNING claim_slot, job_id, run_lease, closed_at
),
inserted_batches AS (
    INSERT INTO __S__.lease_claim_closure_batches (
        claim_slot,
        ready_slot,
        ready_generation,
        outcome,
        closed_count,
        receipt_ids,
        receipt_ranges,
        closed_at
    )
    SELECT
        stale_locked.claim_slot,
        stale_locked.ready_slot,
        stale_locked.ready_generation,
        'rescued',
        count(*)::int,
        array_agg(stale_locked.receipt_id ORDER BY stale_locked.receipt_id),
        range_agg(int8range(stale_locked.receipt_id, stale_locked.receipt_id + 1, '[)') ORDER BY stale_locked.receipt_id),
        clock_timestamp()
    FROM stale_locked
    WHERE stale_locked.compact_batch
    GROUP BY
        stale_locked.claim_slot,
        stale_locked.ready_slot,
        stale_locked.ready_generation
    RETURNING claim_slot
),
closed_locked AS (
    SELECT claim_slot, job_id, run_lease FROM inserted
    UNION ALL
    SELECT stale_locked.claim_slot, stale_locked.job_id, stale_locked.run_lease
    FROM stale_locked
    WHERE stale_locked.compact_batch
      AND EXISTS (SELECT 1 FROM inserted_batches)
),
marked AS (
    UPDATE __S__.lease_claims AS claims
    SET closed_at = COALESCE(claims.closed_at, inserted.closed_at)
    FROM inserted
    WHERE claims.claim_slot = inserted.claim_slot
      AND claims.job_id = inserted.job_id
      AND claims.run_lease = inserted.run_lease
    RETURNING claims.job_id
),
annotated AS (
    SELECT
        candidates.*,
        (
            candidates.is_closed
            OR candidates.is_lease_managed
            OR NOT candidates.is_stale
            OR EXISTS (
                SELECT 1 FROM closed_locked
                WHERE closed_locked.claim_slot = candidates.claim_slot
                  AND closed_locked.job_id = candidates.job_id
                  AND closed_locked.run_lease = candidates.run_lease
            )
        ) AS advanceable
    FROM candidates
),
bounded AS (
    SELECT
        annotated.*,
        min(CASE WHEN NOT annotated.advanceable THEN annotated.rn END) OVER () AS first_blocked_rn
    FROM annotated
),
advance_target AS (
    SELECT claimed_at, job_id, run_lease
    FROM bounded
    WHERE first_blocked_rn IS NULL OR rn < first_blocked_rn
    ORDER BY rn DESC
    LIMIT 1
),
advance_cursor AS (
    UPDATE __S__.claim_ring_slots AS slots
    SET rescue_cursor_claimed_at = advance_target.claimed_at,
        rescue_cursor_job_id = advance_target.job_id,
        rescue_cursor_run_lease = advance_target.run_lease
    FROM advance_target
    WHERE slots.slot = $1
    RETURNING slots.slot
),
cursor_advance AS (
    SELECT count(*) FROM advance_cursor
)
SELECT
    stale_locked.ready_slot,
    stale_locked.ready_generation,
    stale_locked.job_id,
    stale_locked.queue,
    'running'::awa.job_state AS state,
    stale_locked.priority,
    stale_locked.attempt,
    stale_locked.run_lease,
    stale_locked.max_attempts,
    stale_locked.lane_seq,
    stale_locked.enqueue_shard,
    stale_locked.claimed_at AS attempted_at
FROM stale_locked
JOIN closed_locked
  ON closed_locked.claim_slot = stale_locked.claim_slot
 AND closed_locked.job_id = stale_locked.job_id
 AND closed_locked.run_lease = stale_locked.run_lease
CROSS JOIN cursor_advance
"""
"""``rescue_stale_heartbeats`` on queue storage ("receipt claim stale: worker presumed dead"):
receipts of claim slot ``$1``, of both shapes, whose last heartbeat (``attempt_state``, or the
claim time) is before ``$2``; ``$3`` candidates, ``$4`` rescued at most; closed ``rescued``."""


def statement(text: str, schema: str) -> sa.TextClause:
    """*text* for *schema*, its ``$n`` parameters named ``:pn``."""
    sql = text.replace("__CLOSED__", CLOSED_EVIDENCE.strip()).replace("__S__", schema)
    return sa.text(re.sub(r"\$(\d+)", r":p\1", sql))


LEASE_HEARTBEAT_RESCUE = """
DELETE FROM __S__.leases AS target
WHERE (target.job_id, target.run_lease) IN (
    SELECT lease.job_id, lease.run_lease
    FROM __S__.leases AS lease
    LEFT JOIN __S__.attempt_state AS attempt
      ON attempt.job_id = lease.job_id
     AND attempt.run_lease = lease.run_lease
    WHERE lease.state = 'running'
      AND COALESCE(attempt.heartbeat_at, lease.heartbeat_at) < $1
    ORDER BY COALESCE(attempt.heartbeat_at, lease.heartbeat_at) ASC
    LIMIT 500
    FOR UPDATE OF lease SKIP LOCKED
)
RETURNING job_id, run_lease
"""
"""The first statement of ``rescue_stale_heartbeats`` for materialised leases ("heartbeat
stale: worker presumed dead"): the running leases whose last heartbeat is before ``$1``
deleted (the runtime then hydrates them in the same transaction). The relation after each
``FROM`` is spliced in by ``format!``: ``leases AS target`` and ``leases AS lease``, as the
aliases the text uses say; ``RETURNING`` shortened to what the tests read."""

CALLBACK_TIMEOUT_RESCUE = """
DELETE FROM __S__.leases
WHERE job_id IN (
    SELECT job_id
    FROM __S__.leases
    WHERE state = 'waiting_external'
      AND callback_timeout_at IS NOT NULL
      AND callback_timeout_at < clock_timestamp()
    ORDER BY callback_timeout_at ASC
    LIMIT 500
    FOR UPDATE SKIP LOCKED
)
RETURNING job_id, run_lease
"""
"""The first statement of ``rescue_expired_callbacks`` on queue storage: the parked leases
whose callback timed out, deleted; ``RETURNING`` shortened as above."""
