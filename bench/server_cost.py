"""What a canonical reschedule costs the database: pg_stat_statements on the bench's own server.

The server loads pg_stat_statements with tracking off; only the connections measured here turn
it on (with planning time), so nothing else the bench does is counted. For each form the
statistics are reset, a run of reschedules is made, and the execution plus planning time of
every statement the server saw (BEGIN and COMMIT included) is divided by the reschedules.

The second row is the two-statement path awa-sa took before the one statement (and still takes
when routing says queue storage): BEGIN, the lock, the routing move, COMMIT, raw psycopg. The
last row is Awa's routing function called alone, one statement per transaction: the share of
the two-statement forms that the one statement saves by reading the locked row instead.

The straightforward form is what a hand-written reschedule would send: one statement that takes
the singleton ``FOR SHARE`` and calls ``awa.active_queue_storage_schema()``, then a plain
``DELETE ... RETURNING`` feeding an ``INSERT``. (It is not awa-sa's: a STABLE function reads with
the statement's snapshot, taken before the lock wait, so that read can miss a transition that
committed while it waited; awa-sa reads routing in the next statement.)
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa

from awa_sa import reschedule_canonical_attempt
from bench.workload import KIND, Jobs, canonical_texts, move_values

SETTINGS = ("shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=none")
_TRACKED = "-c pg_stat_statements.track=top -c pg_stat_statements.track_planning=on"

STRAIGHT_LOCK = (
    "SELECT awa.active_queue_storage_schema() FROM awa.storage_transition_state"
    " WHERE singleton FOR SHARE"
)
_COPIED = (
    "id, kind, queue, args, {state}, priority, attempt, max_attempts, {run_at}, NULL, NULL,"
    " attempted_at, {finalized_at}, created_at, errors, metadata, tags, unique_key,"
    " unique_states, callback_id, callback_timeout_at, callback_filter, callback_on_complete,"
    " callback_on_fail, callback_transform, run_lease, NULL"
)
STRAIGHT_MOVE = (
    "WITH taken AS (DELETE FROM awa.jobs_hot WHERE id = %(id)s AND run_lease = %(lease)s"
    " AND state = 'running' RETURNING *)"
    " INSERT INTO awa.scheduled_jobs (id, kind, queue, args, state, priority, attempt,"
    " max_attempts, run_at, heartbeat_at, deadline_at, attempted_at, finalized_at, created_at,"
    " errors, metadata, tags, unique_key, unique_states, callback_id, callback_timeout_at,"
    " callback_filter, callback_on_complete, callback_on_fail, callback_transform, run_lease,"
    " progress) SELECT "
    + _COPIED.format(
        state="'retryable'",
        run_at="now() + make_interval(secs => %(delay)s)",
        finalized_at="now()",
    )
    + " FROM taken RETURNING id, run_at, attempt"
)


def measure(url: str, dbname: str, calls: int) -> dict[str, Any]:
    """Per reschedule: milliseconds of server time and statements seen, for both forms."""
    admin = sa.create_engine(url, poolclass=sa.NullPool)
    tracked = sa.create_engine(url, pool_size=1, connect_args={"options": _TRACKED})
    with admin.begin() as conn:
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
    jobs = Jobs(url)
    jobs.seed(4 * (calls + 20))
    dsn = url.replace("+psycopg", "")
    raw = psycopg.connect(dsn, options=_TRACKED)

    def awa(job_id: int, lease: int) -> None:
        reschedule_canonical_attempt(tracked, job_id, lease, KIND)

    def straight(job_id: int, lease: int) -> None:
        raw.execute(STRAIGHT_LOCK, prepare=True).fetchall()
        values = {"id": job_id, "lease": lease, "delay": KIND.delay_secs}
        raw.execute(STRAIGHT_MOVE, values, prepare=True).fetchall()
        raw.commit()

    lock, move = canonical_texts(tracked.dialect)

    def two_statements(job_id: int, lease: int) -> None:
        raw.execute(lock.sql, prepare=True).fetchall()
        raw.execute(move.sql, move.params(move_values(job_id, lease)), prepare=True).fetchall()
        raw.commit()

    def routing_read(job_id: int, lease: int) -> None:
        raw.execute("SELECT awa.active_queue_storage_schema()", prepare=True).fetchall()
        raw.commit()

    out: dict[str, Any] = {}
    try:
        forms = (
            ("awa-sa", awa),
            ("two statements", two_statements),
            ("straightforward", straight),
            ("routing read", routing_read),
        )
        for name, op in forms:
            for job_id, lease in jobs.take(20):  # connect, prepare: not part of a call's cost
                op(job_id, lease)
            with admin.begin() as conn:
                conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
            for job_id, lease in jobs.take(calls):
                op(job_id, lease)
            out[name] = _read(admin, dbname, calls)
    finally:
        raw.close()
        tracked.dispose()
        admin.dispose()
    return out


def _read(admin: sa.Engine, dbname: str, calls: int) -> dict[str, Any]:
    with admin.begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT query, calls, total_exec_time, total_plan_time FROM pg_stat_statements"
                " s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = :db"
            ),
            {"db": dbname},
        ).all()
    statements = []
    for row in rows:
        head = row.query.split(None, 1)[0].upper()
        statements.append(
            {
                "statement": head if head in ("BEGIN", "COMMIT") else row.query[:60],
                "per_call": row.calls / calls,
                "exec_ms": row.total_exec_time / calls,
                "plan_ms": row.total_plan_time / calls,
            }
        )
    statements.sort(key=lambda s: -s["exec_ms"])
    return {
        "ms_per_reschedule": sum(s["exec_ms"] + s["plan_ms"] for s in statements),
        "statements_per_reschedule": sum(s["per_call"] for s in statements),
        "statements": statements,
    }
