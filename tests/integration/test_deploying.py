"""What docs/deploying.md says about transactions, isolation and schema translation, shown.

* A Connection-form transaction holds the routing lock until it ends, and the real
  ``awa storage prepare`` waits for it (seen in pg_stat_activity), then goes through.
* READ COMMITTED (PostgreSQL's default, the whole suite's) always works. REPEATABLE READ and
  SERIALIZABLE work until a storage transition commits after the transaction's snapshot: then
  the call fails with 40001 and writes nothing.
* A ``schema_translate_map`` on the caller's engine does not reach awa-sa's statements (Awa's
  schema names are fixed), and awa-sa leaves it in force for the caller's own statements.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from conftest import Cluster, run_awa
from jobs import insert_job
from racing import backend_pid, fingerprint, in_thread, wait_until_blocked

import awa_sa
import awa_sa_schema
from awa_sa import DatabaseError, Migrated, Rescheduled, Snooze
from awa_sa.testing.server import EmbeddedPostgres


def _phase(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(
            conn.exec_driver_sql(
                "SELECT state FROM awa.storage_transition_state WHERE singleton"
            ).scalar()
        )


def test_a_held_connection_form_transaction_holds_off_awa_storage_prepare(
    pg: EmbeddedPostgres, real_db_url: str, real_engine: sa.Engine
) -> None:
    with real_engine.begin() as conn:
        job = insert_job(conn)
    dbname = sa.make_url(real_db_url).database or ""
    with real_engine.connect() as caller, caller.begin():
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(caller, job, 1, Snooze(5)), Rescheduled
        )
        details = '{"schema": "awa_qs"}'
        prepare = in_thread(
            lambda: run_awa(
                pg, dbname, "storage", "prepare", "--engine", "queue_storage", "--details", details
            )
        )
        (waiter,) = wait_until_blocked(real_engine, backend_pid(caller), pending=[prepare])
        assert waiter.wait_event in ("transactionid", "tuple", "relation")
        assert "storage" in waiter.query.lower()
        assert not prepare.done()
    prepare.result(timeout=60)
    assert _phase(real_engine) == "prepared"


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_isolation_fails_with_40001_after_a_transition(
    isolation: str, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        jobs = [insert_job(conn) for _ in range(2)]
    # Untouched since the snapshot: works.
    with engine.connect() as caller:
        caller.execution_options(isolation_level=isolation)
        with caller.begin():
            caller.exec_driver_sql("SELECT 1")
            assert isinstance(
                awa_sa.reschedule_canonical_attempt(caller, jobs[0], 1, Snooze(5)), Rescheduled
            )
    # A transition commits after the snapshot: 40001, nothing written.
    with engine.connect() as caller:
        caller.execution_options(isolation_level=isolation)
        with caller.begin():
            caller.exec_driver_sql("SELECT 1")  # the snapshot is taken here
            with engine.begin() as other:
                awa_sa_schema.set_phase(other, "prepared", "awa_qs")
            before = fingerprint(engine)
            with pytest.raises(DatabaseError) as failed:
                awa_sa.reschedule_canonical_attempt(caller, jobs[1], 1, Snooze(5))
            caller.rollback()
    assert failed.value.sqlstate == "40001"
    assert fingerprint(engine) == before
    # Retried in a new transaction, it goes through.
    assert isinstance(
        awa_sa.reschedule_canonical_attempt(engine, jobs[1], 1, Snooze(5)), Rescheduled
    )


def test_schema_translate_map_does_not_reach_awa_sa(cluster: Cluster) -> None:
    engine = cluster.engine
    with engine.begin() as conn:
        jobs = [insert_job(conn) for _ in range(2)]
        conn.exec_driver_sql("CREATE SCHEMA tenant")
        conn.exec_driver_sql("CREATE TABLE tenant.notes (n int)")
    notes = sa.Table("notes", sa.MetaData(), sa.Column("n", sa.Integer))  # no schema
    mapped = engine.execution_options(schema_translate_map={None: "tenant", "awa": "elsewhere"})
    assert isinstance(
        awa_sa.reschedule_canonical_attempt(mapped, jobs[0], 1, Snooze(5)), Rescheduled
    )
    cluster.set_phase("mixed_transition", "awa_qs")
    with mapped.begin() as conn:
        assert isinstance(
            awa_sa.reschedule_canonical_attempt(conn, jobs[1], 1, Snooze(5)), Migrated
        )
        conn.execute(notes.insert().values(n=1))  # the caller's mapping still applies
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT n FROM tenant.notes").scalars().all() == [1]
        moved = conn.exec_driver_sql(
            f"SELECT count(*) FROM awa.scheduled_jobs WHERE id = {jobs[0]}"
        ).scalar()
    assert moved == 1
