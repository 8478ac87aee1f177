"""Part ``handlers`` (issue 51): what the README's exactly-once recipe costs a real worker.

The recipe's statements were measured one attempt at a time on a quiet cluster; a service
moving its handlers to it meets them inside an awa-pg 0.6.9 worker under load, beside the
runtime's own statements, its partition rotation and a growing history. So each figure here
comes from a real worker process (:mod:`bench.handler_worker`, its CPU its own) running four
handlers on one queue: returns at once (the runtime completes), one business row in its own
transaction then returns (at least once), the README's recipe (the row, then ``settle`` of the
job, in one transaction) and the same by the attempt (``attempt_of``, the row, ``settle`` of
the attempt); psycopg 3 AsyncEngine, a pool as large as the concurrency.

Each plane gets its own copy of a freshly migrated cluster (``awa migrate``): on
``queue_storage`` the first worker starts on it empty and auto-finalizes it (the quick-start
order); on ``canonical`` a job is enqueued before the first worker starts, which keeps it
canonical. A run enqueues N jobs of one handler's kind up front with awa-pg's own COPY
(``enqueue_many_copy`` on queue storage, ``insert_many_copy`` on canonical) and times them from
the enqueue's commit until the worker has handled all N and holds none. The handlers' runs
alternate within each worker's life, a different one first each round, so that drift (a busy
machine, a growing history) lands on all alike and the ratios come from this one invocation.

The server's side is ``pg_stat_statements`` with ``track_planning`` on, reset before each run
and tracking only the measured database: the handlers connect as role ``bench_service``, the
runtime as the server's superuser, and the harness (enqueues, resets, reads) as
``bench_harness``, which is not tracked at all. ``--history N`` then grows each plane to N
finished jobs (the same COPY, the returns-at-once handler completing them) and measures the
recipe and the at-least-once handler again: a cost that grows with history shows here.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import awa
import sqlalchemy as sa

from awa_sa.testing.server import EmbeddedPostgres
from bench.handler_worker import HANDLERS, HISTORY_KIND, QUEUE, Worker
from bench.workload import create_database

PLANES = ("queue_storage", "canonical")
HARNESS, SERVICE = "bench_harness", "bench_service"
LABELS = {
    "instant": "returns at once",
    "at_least_once": "own transaction (at least once)",
    "recipe": "README recipe (exactly once)",
    "recipe_attempt": "recipe by attempt_of",
}
CHUNK = 20_000
"""Jobs per COPY when the history grows."""


def jobs_at(jobs: int, concurrency: int) -> int:
    """Jobs per run: *jobs* at concurrency 16 and above, fewer below (a single handler is slow,
    and a few hundred jobs already outlast a second's rotation many times)."""
    return (
        jobs if concurrency >= 16 else max(5, round(jobs * (0.15 + 0.85 * (concurrency - 1) / 15)))
    )


def run(server: EmbeddedPostgres, a: Any) -> dict[str, Any]:
    """The part: per plane, an empty cluster and then (with ``a.history``) a grown one, each
    concurrency in a worker of its own; every run's figures and their medians."""
    planes, concurrencies, rounds, history = (
        a.handlers_planes,
        a.handlers_concurrency,
        a.handlers_rounds,
        a.history,
    )
    names = _databases(server, planes)
    runs: list[dict[str, Any]] = []
    grown: dict[str, dict[str, float]] = {}
    for plane in planes:
        lab = Lab(server, names[plane], plane)
        try:
            for size in (0, history) if history else (0,):
                if size:
                    grown[plane] = lab.grow(size, max(concurrencies))
                kinds = HANDLERS if not size else ("at_least_once", "recipe", "recipe_attempt")
                for concurrency in concurrencies:
                    n = jobs_at(a.jobs, concurrency)
                    with lab.worker(concurrency) as worker:
                        for kind in kinds:  # untimed: the pool's connections, prepared plans
                            lab.measure(worker, kind, max(20, 5 * concurrency))
                        for round_ in range(rounds):
                            for kind in kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]:
                                row = lab.measure(worker, kind, n)
                                row |= {"plane": plane, "history": size, "round": round_}
                                runs.append(row | {"concurrency": concurrency})
        finally:
            lab.close()
    grew = {"history": history, "grown": grown}
    return {"jobs": a.jobs, "rounds": rounds, **grew, "runs": runs, "table": table(runs)}


def _databases(server: EmbeddedPostgres, planes: list[str]) -> dict[str, str]:
    """A freshly migrated cluster per plane, with the service's table, and the roles."""
    create_database(server, "handlers_template", "awa", "canonical")
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    names = {plane: f"handlers_{plane}" for plane in planes}
    with admin.connect() as conn:
        for role in (HARNESS, SERVICE):
            if (
                conn.execute(
                    sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}
                ).first()
                is None
            ):
                # The server's password is URL-safe: no quote in it.
                password = f"PASSWORD '{server.password}'"
                conn.execute(sa.text(f"CREATE ROLE {role} SUPERUSER LOGIN {password}"))
        # A role's setting overrides a database's: the harness is never tracked.
        conn.execute(sa.text(f"ALTER ROLE {HARNESS} SET pg_stat_statements.track = 'none'"))
    template = sa.create_engine(server.database_url("handlers_template"), poolclass=sa.NullPool)
    with template.begin() as conn:
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        conn.execute(sa.text("CREATE TABLE bench_rows (order_id bigint, job_id bigint)"))
    template.dispose()
    with admin.connect() as conn:
        for name in names.values():
            conn.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE handlers_template'))
            for setting in ("track = 'top'", "track_planning = on"):
                conn.execute(sa.text(f'ALTER DATABASE "{name}" SET pg_stat_statements.{setting}'))
    admin.dispose()
    return names


def _as(server: EmbeddedPostgres, name: str, role: str, scheme: str) -> str:
    url = sa.make_url(server.database_url(name, scheme)).set(username=role)
    return url.render_as_string(hide_password=False)


class Lab:
    """One plane's database: the harness's connection, the producer, the jobs enqueued so far."""

    def __init__(self, server: EmbeddedPostgres, name: str, plane: str) -> None:
        self.server, self.name, self.plane = server, name, plane
        self.harness = sa.create_engine(
            _as(server, name, HARNESS, "postgresql+psycopg"),
            pool_size=1,
            isolation_level="AUTOCOMMIT",
        )
        self.producer = awa.Client(_as(server, name, HARNESS, "postgresql"))
        self.enqueued = 0
        self.started = False

    def close(self) -> None:
        self.producer.close()
        self.harness.dispose()

    def worker(self, concurrency: int) -> Worker:
        if not self.started and self.plane == "canonical":
            self._enqueue(HISTORY_KIND, 1)  # before the first runtime: the cluster stays canonical
        self.started = True
        config = {
            "runtime_url": self.server.database_url(self.name, "postgresql"),
            "service_url": _as(self.server, self.name, SERVICE, "postgresql+psycopg"),
            "concurrency": concurrency,
        }
        worker = Worker(config)
        routing = sa.text("SELECT awa.active_queue_storage_schema()")
        deadline = time.monotonic() + 60
        while True:  # the first runtime on an empty cluster finalizes it as it starts
            with self.harness.connect() as conn:
                schema = conn.execute(routing).scalar_one()
            if (schema is not None) == (self.plane == "queue_storage"):
                return worker
            if time.monotonic() > deadline:
                worker.__exit__()
                raise RuntimeError(f"{self.name}: routing {schema!r}, not {self.plane}")
            time.sleep(0.1)

    def _enqueue(self, kind: str, n: int) -> None:
        args = [{"n": self.enqueued + i} for i in range(n)]
        if self.plane == "queue_storage":
            self.producer.enqueue_many_copy(args, kind=kind, queue=QUEUE)
        else:
            self.producer.insert_many_copy(args, kind=kind, queue=QUEUE)
        self.enqueued += n

    def measure(self, worker: Worker, kind: str, n: int) -> dict[str, Any]:
        """One run: *n* jobs of *kind* enqueued at once, timed until the worker is done with
        them; its CPU over the run, the server's statements, what the database holds after."""
        worker.arm(kind, n)
        with self.harness.connect() as conn:
            rows_before = conn.execute(sa.text("SELECT count(*) FROM bench_rows")).scalar_one()
            conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        cpu = worker.cpu()
        self._enqueue(kind, n)
        enqueued = time.monotonic()
        done, errors = worker.done()
        unfinished, end = self._settled(done)
        cpu = worker.cpu() - cpu
        statements = self._statements()
        with self.harness.connect() as conn:
            rows = conn.execute(sa.text("SELECT count(*) FROM bench_rows")).scalar_one()
        seconds = end - enqueued
        groups = groups_of(statements, n)
        return {
            "handler": kind,
            "jobs": n,
            "seconds": seconds,
            "jobs_per_s": n / seconds,
            "worker_cpu_ms_per_job": cpu * 1000 / n,
            "awa_sa_ms_per_job": groups["awa-sa"]["ms_per_job"],
            "runtime_ms_per_job": groups["runtime"]["ms_per_job"],
            "service_ms_per_job": groups["service"]["ms_per_job"],
            "groups": groups,
            "statements": statements,
            "handler_errors": errors,
            "rows_written": rows - rows_before,
            "unfinished_after": unfinished,
            "settled_after_done_s": end - done,
        }

    def _statements(self) -> list[dict[str, Any]]:
        """Every statement tracked since the reset: its group, counts and times."""
        with self.harness.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT r.rolname, s.query, s.calls, s.plans, s.total_plan_time,"
                    " s.total_exec_time FROM pg_stat_statements s"
                    " JOIN pg_roles r ON r.oid = s.userid WHERE s.dbid ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            ).all()
        out = []
        for role, query, calls, plans, plan_ms, exec_ms in found:
            group = group_of(role, query, self.server.user)
            if group:
                out.append(
                    {
                        "group": group,
                        "query": " ".join(query.split())[:160],
                        "calls": calls,
                        "plans": plans,
                        "plan_ms": plan_ms,
                        "exec_ms": exec_ms,
                    }
                )
        return sorted(out, key=lambda s: -(s["plan_ms"] + s["exec_ms"]))

    def _settled(self, done: float) -> tuple[int, float]:
        """The worker's word (none in flight, at *done*) checked with awa-pg's own queue
        counts: the jobs of the queue still unfinished, and when they were all seen finished
        (the runtime's completions are batched, and now and then lag its in-flight count).
        Not ``awa.jobs``: on queue storage its count takes minutes once psycopg prepares it;
        and on canonical the counts lag by up to a second (the leader's recompute)."""
        canonical = sa.text(
            "SELECT (SELECT count(*) FROM awa.jobs_hot WHERE queue = :q AND state <> 'completed')"
            " + (SELECT count(*) FROM awa.scheduled_jobs WHERE queue = :q)"
        )
        end = done
        while True:
            if self.plane == "canonical":
                with self.harness.connect() as conn:
                    left = int(conn.execute(canonical, {"q": QUEUE}).scalar_one())
            else:
                [stat] = [q for q in self.producer.queue_stats() if q.queue == QUEUE]
                left = stat.available + stat.running + stat.retryable + stat.scheduled
            if not left or time.monotonic() - done > 30:
                return left, end
            time.sleep(0.01)
            end = time.monotonic()

    def grow(self, size: int, concurrency: int) -> dict[str, float]:
        """Up to *size* finished jobs, by the quickest faithful way: awa-pg's COPY and the
        worker's returns-at-once handler completing them, a chunk at a time."""
        start = time.monotonic()
        with self.worker(concurrency) as worker:
            while self.enqueued < size:
                n = min(CHUNK, size - self.enqueued)
                worker.arm(HISTORY_KIND, n)
                self._enqueue(HISTORY_KIND, n)
                worker.done()
        seconds = time.monotonic() - start
        with self.harness.connect() as conn:
            conn.execute(sa.text("ANALYZE"))  # as autovacuum would have, in time
            # What the cluster still holds: queue storage prunes a ring's slot as it rotates.
            schema = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
            table = f"{schema}.done_entries" if schema else "awa.jobs_hot WHERE state = 'completed'"
            held = conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
            live = sa.text("SELECT sum(n_live_tup) FROM pg_stat_user_tables WHERE schemaname = :s")
            rows = conn.execute(live, {"s": schema or "awa"}).scalar_one()
        return {"finished": self.enqueued, "held": held, "rows": rows, "seconds": seconds}


def group_of(role: str, query: str, runtime: str) -> str | None:
    """Whose a statement is: awa-sa's, the service's INSERT, the handlers' BEGIN and COMMIT
    (``transaction``), or the runtime's; None for anything else."""
    if role == runtime:
        return "runtime"
    if role != SERVICE:
        return None
    if query.lstrip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK")):
        return "transaction"
    return "service" if "bench_rows" in query else "awa-sa"


def groups_of(statements: list[dict[str, Any]], jobs: int) -> dict[str, dict[str, float]]:
    out = {}
    for group in ("awa-sa", "runtime", "service", "transaction"):
        mine = [s for s in statements if s["group"] == group]
        plan, execute = sum(s["plan_ms"] for s in mine), sum(s["exec_ms"] for s in mine)
        out[group] = {
            "calls": sum(s["calls"] for s in mine),
            "plans": sum(s["plans"] for s in mine),
            "plan_ms": plan,
            "exec_ms": execute,
            "ms_per_job": (plan + execute) / jobs,
        }
    return out


FIELDS = ("jobs_per_s", "worker_cpu_ms_per_job", "awa_sa_ms_per_job", "runtime_ms_per_job")


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per plane, history and concurrency: each handler's figures, median and range over the
    rounds, and the recipe's jobs/s over the at-least-once handler's of the same round."""
    parts: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in runs:
        parts.setdefault((r["plane"], r["history"], r["concurrency"]), []).append(r)
    out: list[dict[str, Any]] = []
    for (plane, history, concurrency), same in sorted(
        parts.items(), key=lambda item: (PLANES.index(item[0][0]), *item[0][1:])
    ):
        by = {kind: [r for r in same if r["handler"] == kind] for kind in HANDLERS}
        ratios = [
            rec["jobs_per_s"] / alo["jobs_per_s"]
            for rec, alo in zip(by["recipe"], by["at_least_once"], strict=True)
        ]
        out.append(
            {
                **{"plane": plane, "history": history, "concurrency": concurrency},
                "jobs": same[0]["jobs"],
                "handlers": {
                    kind: {f: _spread([r[f] for r in mine]) for f in FIELDS}
                    for kind, mine in by.items()
                    if mine
                },
                "recipe_over_at_least_once": _spread(ratios) if ratios else None,
            }
        )
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(result: dict[str, Any]) -> str:
    """The issue's table per plane, history and concurrency with the ratio, then the
    recipe's statements in its last run at each."""
    lines = [f"handlers: a real awa-pg worker, {result['rounds']} interleaved rounds"]
    for plane, grown in result["grown"].items():
        lines.append(
            f"  {plane}: {grown['finished']:,} jobs finished in {grown['seconds']:.0f} s,"
            f" {grown['held']:,} of them held as completed, {grown['rows']:,} rows in its schema"
        )
    last: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in result["runs"]:
        if r["handler"] == "recipe":
            last[r["plane"], r["history"], r["concurrency"]] = r
    for part in result["table"]:
        lines += [
            f"{part['plane']}, {part['history']:,} finished jobs before, concurrency"
            f" {part['concurrency']}, {part['jobs']} jobs a run (median [range]):",
            "  handler                          |            jobs/s | worker CPU/job"
            " | awa-sa ms/job | runtime ms/job",
        ]
        for kind, row in part["handlers"].items():
            rate, cpu = row["jobs_per_s"], row["worker_cpu_ms_per_job"]["median"]
            spread = f"{rate['median']:.0f} [{rate['min']:.0f}-{rate['max']:.0f}]"
            lines.append(
                f"  {LABELS[kind]:32} | {spread:>17} | {cpu:>11.2f} ms"
                f" | {row['awa_sa_ms_per_job']['median']:13.3f}"
                f" | {row['runtime_ms_per_job']['median']:14.3f}"
            )
        if ratio := part["recipe_over_at_least_once"]:
            lines.append(
                f"  recipe / at least once: {ratio['median']:.2f}x"
                f" [{ratio['min']:.2f}-{ratio['max']:.2f}] (target 0.8x)"
            )
    for (plane, history, concurrency), r in last.items():
        lines += [
            f"recipe's statements, {plane}, {history:,} before, concurrency {concurrency}"
            f" (last round, {r['jobs']} jobs): calls, plans, ms a plan, ms a call",
        ]
        shown = [s for s in r["statements"] if s["group"] != "runtime"]
        for s in shown + [s for s in r["statements"] if s["group"] == "runtime"][:4]:
            plan = s["plan_ms"] / s["plans"] if s["plans"] else 0.0
            lines.append(
                f"  {s['group']:11} {s['calls']:6} {s['plans']:6} {plan:8.3f}"
                f" {s['exec_ms'] / max(1, s['calls']):8.3f}  {s['query'][:60]}"
            )
    return "\n".join(lines)
