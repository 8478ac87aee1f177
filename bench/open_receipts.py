"""One job's open receipts: what each read costs the server, planning included (issue 39).

``.venv/bin/python -m bench.open_receipts`` (not a part of ``python -m bench``; needs the awa
CLI and Linux). On a throwaway server it builds a real cluster (``awa migrate``, then the
storage commands up to ``finalize``: queue storage active in ``awa_qs``, 8 claim slots and 16
queue slots), seeds a few receipts of every kind with SQL, and prints for each read, sent as
awa-sa sends it with psycopg 3, the backend's own CPU per call: on a new backend, on a warm one
(unprepared), and calls 1 to 14 on one new connection with psycopg's default preparing. CPU,
not wall time, because these reads are mostly planning and a loaded machine moved wall times
by 2x (docs/performance.md#open-receipts).
"""

from __future__ import annotations

import os
import statistics
import subprocess
from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from awa_sa.core.compiled import compile_statement
from awa_sa.settle.statements.job_receipts import open_claims
from awa_sa.settle.statements.listings import Filters, filter_binds, queue_storage_attempts
from awa_sa.testing.server import embedded_postgres
from bench.workload import awa_cli

QS = "awa_qs"
FLIP = (
    ("migrate",),
    ("storage", "prepare-queue-storage-schema", "--schema", QS),
    ("storage", "prepare", "--engine", "queue_storage", "--details", f'{{"schema": "{QS}"}}'),
    ("storage", "enter-mixed-transition", "--quiesced"),
    ("storage", "finalize"),
)
SEED = (
    # jobs 1-8 enqueued; row receipts for 1, 2, 3 and 7 (7 closed by a closure row)
    f"INSERT INTO {QS}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,"
    " priority, lane_seq) SELECT 0, 0, g, 'mail', 'mail', '{}', 2, g FROM generate_series(1, 8) g",
    f"INSERT INTO {QS}.lease_claims (claim_slot, job_id, run_lease, ready_slot, ready_generation,"
    " queue, priority, attempt, max_attempts, lane_seq, deadline_at) SELECT g % 2, g, 1, 0, 0,"
    " 'mail', 2, 1, 25, g, now() + interval '5 minutes' FROM unnest(ARRAY[1, 2, 3, 7]) g",
    f"INSERT INTO {QS}.lease_claim_closures (claim_slot, job_id, run_lease, outcome)"
    " VALUES (1, 7, 1, 'completed')",
    # a compact batch of 4, 5 and 8 (8 closed by a closure batch)
    f"INSERT INTO {QS}.lease_claim_batches (claim_slot, ready_slot, ready_generation, queue,"
    " priority, claimed_count, job_ids, run_leases, receipt_ids, receipt_ranges, lane_seqs,"
    " attempts, max_attempts) VALUES (0, 0, 0, 'mail', 2, 3, '{4,5,8}', '{1,1,1}',"
    " '{1001,1002,1003}', '{[1001,1004)}', '{4,5,8}', '{1,1,1}', '{25,25,25}')",
    f"INSERT INTO {QS}.lease_claim_closure_batches (claim_slot, outcome, closed_count,"
    " receipt_ids, receipt_ranges) VALUES (0, 'completed', 1, '{1003}', '{[1003,1004)}')",
    # job 6: a receipt a callback wait materialised, still running
    f"INSERT INTO {QS}.lease_claims (claim_slot, job_id, run_lease, ready_slot,"
    " ready_generation, queue, priority, attempt, max_attempts, lane_seq, deadline_at,"
    " materialized_at) VALUES (0, 6, 1, 0, 0, 'mail', 2, 1, 25, 6,"
    " now() + interval '5 minutes', now())",
    f"INSERT INTO {QS}.leases (lease_slot, lease_generation, ready_slot, ready_generation,"
    " job_id, queue, state, priority, lane_seq, run_lease, attempt, max_attempts)"
    " VALUES (0, 0, 0, 0, 6, 'mail', 'running', 2, 6, 1, 1, 25)",
    "ANALYZE",
)


def reads() -> dict[str, tuple[str, Mapping[str, Any]]]:
    """Each read's psycopg 3 text for ``awa_qs``, with the values it is timed with."""
    shapes: dict[str, tuple[Any, Mapping[str, Any]]] = {
        "open_claims, one pair": (open_claims(batch=False), {"guard_id": 1, "guard_lease": 1}),
        "open_claims, three pairs": (
            open_claims(batch=True),
            {"guard_id": [1, 4, 99], "guard_lease": [1, 1, 1]},
        ),
        "attempt_of's read": (queue_storage_attempts(by_job=True), filter_binds(Filters(job_id=4))),
        "every receipt": (queue_storage_attempts(by_job=False), filter_binds(Filters())),
    }
    dialect = psycopg_dialect.dialect()
    out: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for name, (statement, values) in shapes.items():
        text = compile_statement(statement, dialect, QS)
        out[name] = (text.sql, {**text.defaults, **values})
    return out


def cpu_ms(pid: int) -> float:
    """The backend's time on a CPU so far (``/proc/<pid>/schedstat``, in nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e6


def calls(
    url: str, sql: str, values: Mapping[str, Any], n: int, prepare: bool | None
) -> list[float]:
    """The backend CPU of each of *n* calls on one new connection."""
    with psycopg.connect(url, autocommit=True) as conn:
        pid = conn.info.backend_pid
        spent = []
        for _ in range(n):
            before = cpu_ms(pid)
            conn.execute(sql, values, prepare=prepare).fetchall()
            spent.append(cpu_ms(pid) - before)
    return spent


def main() -> None:
    cli = awa_cli()
    if cli is None:
        raise SystemExit("bench.open_receipts needs the awa CLI (pip install awa-cli==0.6.9)")
    with (
        embedded_postgres() as server,
        psycopg.connect(server.url.replace("+psycopg", "")) as admin,
    ):
        admin.autocommit = True
        admin.execute("CREATE DATABASE receipts")
        env = {**os.environ, "DATABASE_URL": server.database_url("receipts", "postgres")}
        for args in FLIP:
            subprocess.run([cli, *args], env=env, check=True, capture_output=True, timeout=600)
        url = server.database_url("receipts", "postgresql")
        with psycopg.connect(url, autocommit=True) as conn:
            for sql in SEED:
                conn.execute(sql)
        for name, (sql, values) in reads().items():
            new = statistics.median(calls(url, sql, values, 1, False)[0] for _ in range(3))
            warm = statistics.mean(calls(url, sql, values, 33, False)[3:])
            series = " ".join(f"{ms:.1f}" for ms in calls(url, sql, values, 14, None))
            print(f"{name}: new backend {new:.1f} ms, warm {warm:.1f} ms")
            print(f"  calls 1-14, psycopg's default preparing (ms): {series}")


if __name__ == "__main__":
    main()
