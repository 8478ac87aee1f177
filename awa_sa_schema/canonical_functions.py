"""Functions and triggers of the canonical plane, written from the v040 catalog's prose.

The reschedule operation depends on their side effects (claims released and retaken, dirty
marks appended, routing resolved inside the database), so each one reproduces the described
behaviour; signatures, language, volatility and ``SET search_path`` follow the catalog exactly.
"""

from __future__ import annotations

from .canonical_tables import JOB_STATES

_BIT_POSITIONS = "\n".join(
    f"        WHEN '{state}' THEN {position}" for position, state in enumerate(JOB_STATES)
)

# Bit 0 is the leftmost character of the BIT(8) text, which is exactly get_bit's numbering.
JOB_STATE_IN_BITMASK = f"""
CREATE FUNCTION awa.job_state_in_bitmask(bitmask bit, state awa.job_state)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
AS $fn$
    SELECT get_bit(bitmask, CASE state
{_BIT_POSITIONS}
    END) = 1
$fn$;
"""

# random() is in [0, 1), so the result is in [2^A, 1.25 * 2^A) seconds, capped at a day. The
# float8 arithmetic and make_interval are deliberate: the overflow behaviour for A >= 44 (a
# negative interval, then "interval out of range", then float overflow) is part of the contract.
BACKOFF_DURATION = """
CREATE FUNCTION awa.backoff_duration(attempt smallint, max_attempts smallint)
RETURNS interval
LANGUAGE sql
VOLATILE
AS $fn$
    SELECT LEAST(
        make_interval(secs => 2 ^ attempt)
            + make_interval(secs => random() * 2 ^ attempt * 0.25),
        interval '24 hours'
    )
$fn$;
"""

# The claim row for (key, id) must exist exactly while a canonical row claims its key. An
# update that keeps the same key and id keeps the same claim row, so it is left alone; otherwise
# the old claim is released first, which lets a row that changes key (or moves between tables
# in one statement) take its new claim. A different holder makes PostgreSQL itself raise the
# 23505 on idx_awa_jobs_unique, so callers see the ordinary unique-violation error fields.
SYNC_JOB_UNIQUE_CLAIMS = """
CREATE FUNCTION awa.sync_job_unique_claims()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    old_claims boolean := false;
    new_claims boolean := false;
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        old_claims := OLD.unique_key IS NOT NULL AND OLD.unique_states IS NOT NULL
            AND awa.job_state_in_bitmask(OLD.unique_states, OLD.state);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        new_claims := NEW.unique_key IS NOT NULL AND NEW.unique_states IS NOT NULL
            AND awa.job_state_in_bitmask(NEW.unique_states, NEW.state);
    END IF;

    IF old_claims AND new_claims THEN
        IF OLD.unique_key = NEW.unique_key AND OLD.id = NEW.id THEN
            RETURN NULL;
        END IF;
    END IF;

    IF old_claims THEN
        DELETE FROM awa.job_unique_claims
        WHERE unique_key = OLD.unique_key AND job_id = OLD.id;
    END IF;

    IF new_claims THEN
        INSERT INTO awa.job_unique_claims (unique_key, job_id)
        VALUES (NEW.unique_key, NEW.id)
        ON CONFLICT (unique_key) DO NOTHING;
        IF NOT FOUND THEN
            PERFORM 1 FROM awa.job_unique_claims
            WHERE unique_key = NEW.unique_key AND job_id = NEW.id;
            IF NOT FOUND THEN
                INSERT INTO awa.job_unique_claims (unique_key, job_id)
                VALUES (NEW.unique_key, NEW.id);
            END IF;
        END IF;
    END IF;
    RETURN NULL;
END
$fn$;
"""

# The marks are plain appends (the wait_free_dirty_marks form): no keys, no conflict handling,
# so concurrent writers never wait on each other. A statement touching no rows appends nothing.
MARK_DIRTY_KEYS = """
CREATE FUNCTION awa.mark_dirty_keys_insert()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    INSERT INTO awa.admin_dirty_queue_marks (queue) SELECT DISTINCT queue FROM new_rows;
    INSERT INTO awa.admin_dirty_kind_marks (kind) SELECT DISTINCT kind FROM new_rows;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION awa.mark_dirty_keys_delete()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    INSERT INTO awa.admin_dirty_queue_marks (queue) SELECT DISTINCT queue FROM old_rows;
    INSERT INTO awa.admin_dirty_kind_marks (kind) SELECT DISTINCT kind FROM old_rows;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION awa.mark_dirty_keys_update()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    INSERT INTO awa.admin_dirty_queue_marks (queue)
    SELECT DISTINCT touched.queue
    FROM old_rows AS o
    JOIN new_rows AS n ON n.id = o.id
    CROSS JOIN LATERAL (VALUES (o.queue), (n.queue)) AS touched (queue)
    WHERE o.queue IS DISTINCT FROM n.queue OR o.state IS DISTINCT FROM n.state;

    INSERT INTO awa.admin_dirty_kind_marks (kind)
    SELECT DISTINCT touched.kind
    FROM old_rows AS o
    JOIN new_rows AS n ON n.id = o.id
    CROSS JOIN LATERAL (VALUES (o.kind), (n.kind)) AS touched (kind)
    WHERE o.kind IS DISTINCT FROM n.kind;
    RETURN NULL;
END
$fn$;
"""

NOTIFY_NEW_JOB = """
CREATE FUNCTION awa.notify_new_job()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    PERFORM pg_notify('awa:' || NEW.queue, '');
    RETURN NULL;
END
$fn$;
"""

# Routing is decided in the database, from the table, by a STABLE function: that is what makes a
# one-statement "lock and read" see the statement's (possibly stale) snapshot, the behaviour
# docs/contract.md#routing-read is about. Both bodies are the ones `awa migrate` installs, byte for
# byte (awa-cli 0.6.6 to 0.6.9 install the same): the reschedule's one-statement canonical path
# computes routing inline from the locked row and checks, in every call, that the installed
# bodies hash to these (awa_sa.statements.ROUTING_BODY_MD5). Blank handling follows from them:
# in mixed_transition/active a blank prepared_engine hides current_engine (COALESCE only skips
# NULL, the blank is trimmed to '' afterwards, so routing is canonical); a details schema counts
# as missing only when it is exactly '' (not trimmed); the marker's schema_name is taken as is.
ROUTING = """
CREATE FUNCTION awa.active_storage_engine()
RETURNS text
LANGUAGE sql
STABLE
SET search_path = pg_catalog, awa
AS $fn$
    SELECT COALESCE(
        (
            SELECT NULLIF(
                btrim(
                    CASE
                        WHEN state IN ('mixed_transition', 'active')
                            THEN COALESCE(prepared_engine, current_engine)
                        ELSE current_engine
                    END
                ),
                ''
            )
            FROM awa.storage_transition_state
            WHERE singleton
        ),
        'canonical'
    )
$fn$;

CREATE FUNCTION awa.active_queue_storage_schema()
RETURNS text
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, awa, public
AS $fn$
DECLARE
    v_schema TEXT;
BEGIN
    SELECT COALESCE(
        NULLIF(sts.details->>'schema', ''),
        (
            SELECT rsb.schema_name
            FROM awa.runtime_storage_backends AS rsb
            WHERE rsb.backend = 'queue_storage'
        ),
        'awa'
    )
    INTO v_schema
    FROM awa.storage_transition_state AS sts
    WHERE sts.singleton
      AND awa.active_storage_engine() = 'queue_storage';

    RETURN v_schema;
END;
$fn$;
"""

_CLAIMING = "{row}.unique_key IS NOT NULL AND {row}.unique_states IS NOT NULL"


def _claim_triggers(table: str) -> str:
    """The WHEN clauses only pre-filter rows that could claim; the function decides."""
    old, new = _CLAIMING.format(row="OLD"), _CLAIMING.format(row="NEW")
    return f"""
CREATE TRIGGER trg_{table}_unique_claims_insert AFTER INSERT ON awa.{table}
    FOR EACH ROW WHEN ({new}) EXECUTE FUNCTION awa.sync_job_unique_claims();
CREATE TRIGGER trg_{table}_unique_claims_update AFTER UPDATE ON awa.{table}
    FOR EACH ROW WHEN (({old}) OR ({new})) EXECUTE FUNCTION awa.sync_job_unique_claims();
CREATE TRIGGER trg_{table}_unique_claims_delete AFTER DELETE ON awa.{table}
    FOR EACH ROW WHEN ({old}) EXECUTE FUNCTION awa.sync_job_unique_claims();
"""


def _dirty_triggers(table: str) -> str:
    return f"""
CREATE TRIGGER trg_{table}_dirty_keys_insert AFTER INSERT ON awa.{table}
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION awa.mark_dirty_keys_insert();
CREATE TRIGGER trg_{table}_dirty_keys_update AFTER UPDATE ON awa.{table}
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION awa.mark_dirty_keys_update();
CREATE TRIGGER trg_{table}_dirty_keys_delete AFTER DELETE ON awa.{table}
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION awa.mark_dirty_keys_delete();
"""


TRIGGERS = (
    _claim_triggers("jobs_hot")
    + _claim_triggers("scheduled_jobs")
    + _dirty_triggers("jobs_hot")
    + _dirty_triggers("scheduled_jobs")
    + """
CREATE TRIGGER trg_awa_notify AFTER INSERT ON awa.jobs_hot
    FOR EACH ROW WHEN (NEW.state = 'available' AND NEW.run_at <= now())
    EXECUTE FUNCTION awa.notify_new_job();
"""
)

ALL = (
    JOB_STATE_IN_BITMASK,
    BACKOFF_DURATION,
    SYNC_JOB_UNIQUE_CLAIMS,
    MARK_DIRTY_KEYS,
    NOTIFY_NEW_JOB,
    ROUTING,
    TRIGGERS,
)
