"""Lane functions and head triggers of one queue-storage schema ``S``.

Lane sequences (``S.queue_enqueue_seq_<md5>``, ``S.queue_claim_seq_<md5>``) are created lazily,
either by the BEFORE triggers on the head tables or by ``S.ensure_lane_sequences``. All of these
functions run with ``search_path = pg_catalog`` (as in v040), so every reference to ``S`` is
baked into the body as a literal when the substrate is installed.

Behaviour checked against an awa-cli 0.6.9 database by observation only: sequences are stored
unqualified in ``seq_name``; sequences only ever move forward; an UPDATE of ``claim_seq`` does
not move the claim sequence; an increasing UPDATE of ``next_seq`` advances the enqueue sequence
by the difference.
"""

from __future__ import annotations

from ._sql import ident

ENQUEUE_PREFIX = "queue_enqueue_seq"
CLAIM_PREFIX = "queue_claim_seq"


def _create_sequence_if_missing(s: str, var: str) -> str:
    """PL/pgSQL that creates the lane sequence named by *var* unless it exists.

    The to_regclass probe keeps the common "already there" case free of NOTICE chatter; IF NOT
    EXISTS still covers a concurrent creator that committed in between.
    """
    return f"""
    IF to_regclass(format('%I.%I', '{s}', {var})) IS NULL THEN
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint START 1 MINVALUE 1 CACHE 1',
                       '{s}', {var});
    END IF;"""


def _under_sequence_lock(s: str, seq_var: str, body: str) -> str:
    """PL/pgSQL running *body* under the per-sequence session advisory lock.

    The lock is session-level (as in v040), so it would outlive a failed transaction; the
    exception block releases it before re-raising.
    """
    return f"""
    v_lock := hashtextextended('{s}.' || {seq_var}, 0);
    PERFORM pg_advisory_lock(v_lock);
    BEGIN{body}
    EXCEPTION WHEN OTHERS THEN
        PERFORM pg_advisory_unlock(v_lock);
        RAISE;
    END;
    PERFORM pg_advisory_unlock(v_lock);"""


def _lane_sequence_name(q: str) -> str:
    return f"""
CREATE FUNCTION {q}.queue_lane_sequence_name(
    p_prefix text, p_queue text, p_priority smallint, p_enqueue_shard smallint)
RETURNS text
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog
AS $fn$
    SELECT p_prefix || '_'
        || md5(p_queue || ':' || p_priority::text || ':' || p_enqueue_shard::text)
$fn$;
"""


def _sequence_next_value(s: str, q: str) -> str:
    return f"""
CREATE FUNCTION {q}.sequence_next_value(p_seq_name text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $fn$
DECLARE
    v_last bigint;
    v_called boolean;
BEGIN
    -- Before the first nextval/setval(.., true) the stored value is itself the next one.
    EXECUTE format('SELECT last_value, is_called FROM %I.%I', '{s}', p_seq_name)
        INTO v_last, v_called;
    RETURN CASE WHEN v_called THEN v_last + 1 ELSE v_last END;
END
$fn$;
"""


def _set_sequence_next(s: str, q: str) -> str:
    body = f"""
        IF {q}.sequence_next_value(p_seq_name) < p_next THEN
            PERFORM setval(format('%I.%I', '{s}', p_seq_name)::regclass, p_next, false);
        END IF;"""
    return f"""
CREATE FUNCTION {q}.set_sequence_next(p_seq_name text, p_next bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $fn$
DECLARE
    v_lock bigint;
BEGIN{_under_sequence_lock(s, "p_seq_name", body)}
END
$fn$;
"""


def _enqueue_head_sync(s: str, q: str) -> str:
    reserve = f"""
        PERFORM setval(format('%I.%I', '{s}', v_seq)::regclass,
                       {q}.sequence_next_value(v_seq) + (NEW.next_seq - OLD.next_seq), false);"""
    return f"""
CREATE FUNCTION {q}.queue_enqueue_head_sequence_sync()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $fn$
DECLARE
    v_seq text := {q}.queue_lane_sequence_name(
        '{ENQUEUE_PREFIX}', NEW.queue, NEW.priority, NEW.enqueue_shard);
    v_lock bigint;
BEGIN{_create_sequence_if_missing(s, "v_seq")}
    NEW.seq_name := v_seq;
    IF TG_OP = 'INSERT' THEN
        PERFORM {q}.set_sequence_next(v_seq, NEW.next_seq);
    ELSIF NEW.next_seq > OLD.next_seq THEN
        -- The head moved on by k positions: take k values out of the sequence as well.{
        _under_sequence_lock(s, "v_seq", reserve)
    }
    END IF;
    RETURN NEW;
END
$fn$;

CREATE TRIGGER queue_enqueue_heads_sequence_sync
    BEFORE INSERT OR UPDATE OF next_seq ON {q}.queue_enqueue_heads
    FOR EACH ROW EXECUTE FUNCTION {q}.queue_enqueue_head_sequence_sync();
"""


def _claim_head_sync(s: str, q: str) -> str:
    return f"""
CREATE FUNCTION {q}.queue_claim_head_sequence_sync()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $fn$
DECLARE
    v_seq text := {q}.queue_lane_sequence_name(
        '{CLAIM_PREFIX}', NEW.queue, NEW.priority, NEW.enqueue_shard);
BEGIN{_create_sequence_if_missing(s, "v_seq")}
    NEW.seq_name := v_seq;
    IF TG_OP = 'INSERT' THEN
        PERFORM {q}.set_sequence_next(v_seq, NEW.claim_seq);
    END IF;
    RETURN NEW;
END
$fn$;

CREATE TRIGGER queue_claim_heads_sequence_sync
    BEFORE INSERT OR UPDATE OF claim_seq ON {q}.queue_claim_heads
    FOR EACH ROW EXECUTE FUNCTION {q}.queue_claim_head_sequence_sync();
"""


def _ensure_lane_sequences(s: str, q: str) -> str:
    # Updating seq_name alone does not fire the head triggers (they are UPDATE OF next_seq /
    # claim_seq), so this cannot recurse into the sequence bookkeeping.
    return f"""
CREATE FUNCTION {q}.ensure_lane_sequences(
    p_queue text, p_priority smallint, p_enqueue_shard smallint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $fn$
DECLARE
    v_enqueue text := {q}.queue_lane_sequence_name(
        '{ENQUEUE_PREFIX}', p_queue, p_priority, p_enqueue_shard);
    v_claim text := {q}.queue_lane_sequence_name(
        '{CLAIM_PREFIX}', p_queue, p_priority, p_enqueue_shard);
BEGIN{_create_sequence_if_missing(s, "v_enqueue")}{_create_sequence_if_missing(s, "v_claim")}
    UPDATE {q}.queue_enqueue_heads SET seq_name = v_enqueue
    WHERE queue = p_queue AND priority = p_priority AND enqueue_shard = p_enqueue_shard
      AND seq_name IS DISTINCT FROM v_enqueue;
    UPDATE {q}.queue_claim_heads SET seq_name = v_claim
    WHERE queue = p_queue AND priority = p_priority AND enqueue_shard = p_enqueue_shard
      AND seq_name IS DISTINCT FROM v_claim;
END
$fn$;
"""


def functions_sql(schema: str) -> tuple[str, ...]:
    """The function and trigger DDL for *schema*, which the caller has already vetted.

    Order matters only for readability: PL/pgSQL bodies are resolved at call time.
    """
    q = ident(schema)
    return (
        _lane_sequence_name(q),
        _sequence_next_value(schema, q),
        _set_sequence_next(schema, q),
        _enqueue_head_sync(schema, q),
        _claim_head_sync(schema, q),
        _ensure_lane_sequences(schema, q),
    )
