"""The one code path that builds (or removes) a queue-storage substrate for a schema name."""

from __future__ import annotations

import sqlalchemy as sa

from ._sql import check_schema_name, ident, run_sql
from .queue_storage_functions import functions_sql
from .queue_storage_tables import tables_sql

# Relations whose presence means "this schema has a substrate"; set_phase refuses to route to a
# schema lacking any of them, because the reschedule would then fail deep inside with a
# confusing "relation does not exist" or nextval error.
SUBSTRATE_MARKERS = ("job_id_seq", "deferred_jobs", "done_entries", "queue_ring_state")

_FIND_SUBSTRATES = sa.text(
    """
    SELECT n.nspname
    FROM pg_namespace AS n
    WHERE to_regclass(quote_ident(n.nspname) || '.queue_ring_state') IS NOT NULL
      AND to_regclass(quote_ident(n.nspname) || '.deferred_jobs') IS NOT NULL
    ORDER BY n.nspname
    """
)


def has_queue_storage(connection: sa.Connection, schema: str) -> bool:
    """True when every marker relation of the substrate exists in *schema*."""
    check_schema_name(schema)
    found = connection.execute(
        sa.select(
            *(
                sa.func.to_regclass(f"{ident(schema)}.{name}").is_not(None)
                for name in SUBSTRATE_MARKERS
            )
        )
    ).one()
    return all(found)


def installed_queue_storage_schemas(connection: sa.Connection) -> list[str]:
    """Names of the schemas that hold a substrate, ``awa`` included."""
    return list(connection.execute(_FIND_SUBSTRATES).scalars())


def install_queue_storage(connection: sa.Connection, schema: str) -> None:
    """Create the v040 queue-storage substrate in *schema* (a no-op if it is already there).

    Works for ``awa`` (next to the canonical tables, as v040 does) and for any other vetted
    name, which is created if needed. The canonical plane must exist: the tables use the
    ``awa.job_state`` enum. Refuses names not matching ``^[a-z_][a-z0-9_]*$`` with ValueError.
    Runs in the caller's transaction and does not commit.
    """
    check_schema_name(schema)
    if connection.execute(sa.select(sa.func.to_regtype("awa.job_state"))).scalar() is None:
        raise RuntimeError("the canonical plane (type awa.job_state) must be installed first")
    if has_queue_storage(connection, schema):
        return
    run_sql(connection, f"CREATE SCHEMA IF NOT EXISTS {ident(schema)};")
    for ddl in tables_sql(schema) + functions_sql(schema):
        run_sql(connection, ddl)


_DROP_LANE_SEQUENCES = """
DO $drop$
DECLARE
    v_seq record;
BEGIN
    FOR v_seq IN
        SELECT c.relname FROM pg_class AS c
        WHERE c.relnamespace = '{q}'::regnamespace AND c.relkind = 'S'
          AND c.relname ~ '^queue_(enqueue|claim)_seq_[0-9a-f]{{32}}$'
    LOOP
        EXECUTE format('DROP SEQUENCE %I.%I', '{s}', v_seq.relname);
    END LOOP;
END
$drop$;
"""


def uninstall_queue_storage(connection: sa.Connection, schema: str) -> None:
    """Remove the substrate from *schema*; drop the schema too unless it is ``awa``.

    ``awa`` also holds the canonical plane, so there the substrate's objects are dropped one by
    one and the schema stays. Any other schema was created for the substrate alone.
    """
    check_schema_name(schema)
    q = ident(schema)
    if schema != "awa":
        run_sql(connection, f"DROP SCHEMA IF EXISTS {q} CASCADE;")
        return
    run_sql(connection, _DROP_LANE_SEQUENCES.format(q=q, s=schema))
    run_sql(
        connection,
        f"""
DROP FUNCTION IF EXISTS {q}.ensure_lane_sequences(text, smallint, smallint);
DROP TABLE IF EXISTS {q}.dlq_entries, {q}.attempt_state, {q}.leases,
    {q}.lease_claim_closure_batches, {q}.lease_claim_closures, {q}.lease_claim_batches,
    {q}.lease_claims;
DROP SEQUENCE IF EXISTS {q}.lease_claim_closure_batch_id_seq, {q}.lease_claim_batch_id_seq,
    {q}.lease_claim_receipt_id_seq;
DROP TABLE IF EXISTS {q}.queue_claim_heads, {q}.queue_enqueue_heads, {q}.queue_lanes,
    {q}.queue_ring_state, {q}.queue_terminal_count_deltas, {q}.receipt_completion_batches,
    {q}.ready_claim_attempt_batches,
    {q}.done_entries,
    {q}.ready_entries, {q}.deferred_jobs;
DROP FUNCTION IF EXISTS {q}.queue_claim_head_sequence_sync(),
    {q}.queue_enqueue_head_sequence_sync(), {q}.set_sequence_next(text, bigint),
    {q}.sequence_next_value(text),
    {q}.queue_lane_sequence_name(text, text, smallint, smallint);
DROP SEQUENCE IF EXISTS {q}.job_id_seq, {q}.receipt_completion_batch_id_seq,
    {q}.ready_claim_attempt_batch_id_seq;
""",
    )
