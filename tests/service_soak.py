"""Proof III: a service's whole traffic through awa-sa beside three real runtimes and a transition.

What runs at once against one ``awa migrate`` cluster, which starts canonical:

* **three awa-pg 0.6.9 runtimes**, each a process of its own (service_runtime.py), whose
  handlers settle every attempt with awa-sa in the transaction of their business row;
* **producers** (threads): ``enqueue`` and ``enqueue_many`` in a transaction that writes the
  request's rows (``svc_requests``), one in ten rolled back; unique jobs and deliberate
  duplicates (``DuplicateJob``, and ``on_duplicate="skip"`` in batches), scheduled jobs,
  batches of 1 to ``max_batch``;
* **receivers** (threads, service_receiver.py): a share of the jobs (``callbacks``) park on a
  callback; the receivers end the waits with ``complete_external``, ``fail_external`` and
  ``retry_external``, each in a transaction with its row (``svc_receipts``), racing each other
  (a webhook delivered twice) and the runtimes' callback-timeout rescue;
* an **admin** (a thread): ``cancel_job``, ``retry_job``, ``retry_failed`` of jobs in every
  state, ``pause_queue``/``resume_queue``, ``get_job`` and ``jobs_view`` reads, each committed
  with its business row (``svc_admin``);
* the **operator** (a thread): the real ``awa`` CLI moves the cluster through ``storage
  prepare``, starts the queue-storage target runtime, ``enter-mixed-transition`` (retried while
  the gate refuses), ``finalize`` (retried while the canonical backlog drains), then restarts
  the two canonical runtimes, which now resolve queue storage.

Every write to Awa is awa-sa's; the runtimes claim, rescue, promote and complete. Once the
producers are done, the cluster is finalized and nothing is live, the runtimes stop and
service_checks.py reads the rows. ``python tests/service_soak.py --jobs N [--pooler]`` (``./dev
soak``) runs it on a throwaway server; through PgBouncer (transaction pooling) every awa-sa
connection goes through the pooler, the runtimes' and the CLI's direct (awa-pg keeps prepared
statements, which PgBouncer 1.18 cannot pool).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from runtimes import STILL_RINGS, pg_url, rows
from service_checks import Figures, check, lanes_moved_past_awas_wedge, live_count
from service_receiver import Receivers
from service_runtime import KIND, PLANS, QS_ID_BASE, TABLES

import awa_sa
from awa_sa import Duplicate, DuplicateJob, NewJob, QueueStorageJobs, UniqueConflict

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SoakConfig:
    jobs: int = 400
    producers: int = 3
    max_batch: int = 1000
    seed: int = 56
    schema: str = "awa_qs"
    prepare_at: float = 0.25
    """Share of the jobs committed when the operator prepares (the flip follows at once)."""
    mixed_by: float = 0.5
    """Share of the jobs past which the producers wait for the mixed transition: however fast
    the runtimes drain, the rest of the run is enqueued onto queue storage."""
    wait_secs: float = 900.0
    callbacks: float = 0.1
    """Share of the jobs of the ``callback`` plan (service_runtime.py): they park on callbacks
    the receivers resolve."""
    receivers: int = 3
    engine_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tally:
    """What the callers saw, beside the rows: answers by verb, tokens rolled back."""

    answers: Counter[str] = field(default_factory=Counter)
    rolled_tokens: set[str] = field(default_factory=set)
    rolled_ids: set[int] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    transitions: list[tuple[str, float, int]] = field(default_factory=list)
    lost_callbacks: list[str] = field(default_factory=list)
    """The callbacks a receiver was answered None for (another ender won)."""


class Soak:
    def __init__(self, sa_url: str, direct_url: str, config: SoakConfig, workdir: Path) -> None:
        self.cfg, self.sa_url, self.direct_url, self.workdir = config, sa_url, direct_url, workdir
        self.engine = sa.create_engine(sa_url, pool_size=8, max_overflow=4, **config.engine_options)
        self.direct = sa.create_engine(direct_url, pool_size=2, max_overflow=2)
        self.tally = Tally()
        self.lock = threading.Lock()
        self.committed = 0
        self.ended = 0
        self.known: list[int] = []
        self.uniques: list[dict[str, Any]] = []
        self.tokens = iter(range(1, 1 << 62))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Path] = []
        self.stop = threading.Event()
        self.mixed = threading.Event()
        self.t0 = 0.0
        self.receivers = Receivers(self.engine, config.receivers, self.tally, self.lock)

    # ---- the runtimes -------------------------------------------------------------------

    def start_runtime(self, name: str, role: str) -> None:
        log = self.workdir / f"{name}-{len(self.logs)}.jsonl"
        self.logs.append(log)
        start: dict[str, Any] = {**STILL_RINGS, "promote_interval_ms": 100}
        start |= {"poll_interval_ms": 50, "deadline_rescue_interval_ms": 100}
        start |= {"leader_election_interval_ms": 100, "storage_transition_role": role}
        start |= {"callback_rescue_interval_ms": 100}
        start |= {"queue_storage_schema": self.cfg.schema}
        config: dict[str, Any] = {"name": name, "awa_url": pg_url(self.direct_url)}
        config |= {
            "sa_url": self.sa_url,
            "log": str(log),
            "start": start,
            "engine_options": self.cfg.engine_options,
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        env.setdefault("RUST_LOG", "error")
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "service_runtime.py"), json.dumps(config)],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != b"started":
            proc.kill()
            raise RuntimeError(f"runtime {name} ({role}) did not start: {line!r}")
        self.procs[name] = proc

    def stop_runtime(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.terminate()
        code = proc.wait(timeout=60)
        assert proc.stdout is not None
        proc.stdout.close()
        if code != 0:
            self.tally.unexpected.append(f"runtime {name} exited {proc.returncode}")

    # ---- the operator -------------------------------------------------------------------

    def awa(self, *args: str) -> bool:
        env = {**os.environ, "DATABASE_URL": pg_url(self.direct_url), "RUST_LOG": "error"}
        binary = Path(sys.executable).with_name("awa")
        proc = subprocess.run(
            [str(binary), *args], check=False, env=env, capture_output=True, text=True, timeout=300
        )
        self.tally.answers[f"cli {args[1]} {'ok' if proc.returncode == 0 else 'refused'}"] += 1
        return proc.returncode == 0

    def until(self, *args: str) -> None:
        deadline = time.monotonic() + 300
        while not self.awa(*args):
            if time.monotonic() > deadline:
                raise RuntimeError(f"awa {' '.join(args)} kept refusing for 300 s")
            time.sleep(0.5)  # the gate re-reads the runtimes' snapshots and the backlog
        self.tally.transitions.append((args[1], time.monotonic() - self.t0, self.committed))

    def operator(self) -> None:
        while self.committed < self.cfg.prepare_at * self.cfg.jobs:
            if self.stop.is_set():  # a thread failed: the run ends and reports it
                return
            time.sleep(0.05)
        details = json.dumps({"schema": self.cfg.schema})
        self.until("storage", "prepare", "--engine", "queue_storage", "--details", details)
        self.start_runtime("r3", "queue_storage_target")
        self.until("storage", "enter-mixed-transition")
        self.mixed.set()
        self.until("storage", "finalize")
        for name in ("r1", "r2"):  # drain-only now: restarted, they resolve queue storage
            self.procs[name].terminate()
        for name in ("r1", "r2"):
            self.stop_runtime(name)
            self.start_runtime(name, "auto")

    # ---- producers ----------------------------------------------------------------------

    def new_job(self, rng: random.Random) -> NewJob:
        plan = rng.choices(list(PLANS), weights=[p[1] for p in PLANS.values()])[0]
        if rng.random() < self.cfg.callbacks:
            plan = "callback"
        _, _, queue, attempts = PLANS[plan]
        args = {"t": f"p{next(self.tokens)}", "plan": plan}
        run_at = None
        if rng.random() < 0.1:  # scheduled: due within the run
            run_at = datetime.now(UTC) + timedelta(seconds=rng.uniform(0.5, 3))
        # Not a callback job: its wait releases the key (the default states leave out
        # waiting_external), a duplicate may take it, and ending the wait is then refused
        # (UniqueConflict, as awa-pg); test_callbacks.py checks that, not the soak.
        unique: dict[str, Any] | None = {} if rng.random() < 0.1 and plan != "callback" else None
        return NewJob(
            args, kind=KIND, queue=queue, max_attempts=attempts, run_at=run_at, unique_opts=unique
        )

    def duplicate(self, rng: random.Random, batch: list[NewJob]) -> NewJob | None:
        """A job of the same unique key as one committed, or one of *batch*'s own: never one
        another producer has yet to commit (two batches each inserting the other's pending key
        wait on each other: PostgreSQL's deadlock, awa-pg's inserts' too)."""
        with self.lock:
            keys = self.uniques + [j.args for j in batch if j.unique_opts is not None]
            if not keys:
                return None
            args = rng.choice(keys)
        _, _, queue, attempts = PLANS[args["plan"]]
        return NewJob(args, kind=KIND, queue=queue, max_attempts=attempts, unique_opts={})

    def produce(self, seed: int, once: bool = False) -> None:
        rng = random.Random(seed)
        while self.committed < self.cfg.jobs and not self.stop.is_set():
            if self.committed - self.ended > max(40, self.cfg.jobs // 10) and not once:
                time.sleep(0.05)  # a service's pace: the runtimes keep up, the run spans the move
                continue
            past_half = self.committed >= self.cfg.mixed_by * self.cfg.jobs and not once
            if past_half and not self.mixed.wait(0.05):  # both planes take jobs, at any pace
                continue
            # Batches of 1 to max_batch, but none above a twentieth of the run, so that the
            # transition comes between batches.
            most = max(1, min(self.cfg.max_batch, self.cfg.jobs // 20))
            size = round(math.exp(rng.uniform(0, math.log(most)))) if rng.random() < 0.3 else 1
            jobs = [self.new_job(rng) for _ in range(max(size, 1))]
            dup = self.duplicate(rng, jobs) if rng.random() < 0.15 else None
            if dup is not None:
                jobs.insert(rng.randrange(len(jobs) + 1), dup)
            self.transaction(rng, jobs)
            if once:
                return

    def transaction(self, rng: random.Random, jobs: list[NewJob]) -> None:
        rollback = rng.random() < 0.1
        with self.engine.connect() as conn, conn.begin() as tx:
            try:
                verb = "enqueue" if len(jobs) == 1 and rng.random() < 0.7 else "enqueue_many"
                made: list[Any]
                if verb == "enqueue":
                    made = [awa_sa.enqueue(conn, jobs[0].args, **_options(jobs[0]))]
                elif rng.random() < 0.5:  # a duplicate skipped, the others written
                    made = list(awa_sa.enqueue_many(conn, jobs, on_duplicate="skip"))
                else:  # a duplicate anywhere refuses the batch
                    made = list(awa_sa.enqueue_many(conn, jobs))
            except DuplicateJob:
                self.tally.answers[f"{verb} DuplicateJob"] += 1
                tx.rollback()  # the service gives up the request: nothing of it is left
                with self.lock:
                    self.tally.rolled_tokens.update(j.args["t"] for j in jobs)
                return
            rows = [
                {"token": j.args["t"], "job_id": m.id, "how": verb}
                for j, m in zip(jobs, made, strict=True)
                if not isinstance(m, Duplicate)
            ]
            for m in made:
                self.tally.answers[f"{verb} {type(m).__name__}"] += 1
            if rows:
                conn.execute(sa.text(_REQUEST), rows)
            if rollback:
                tx.rollback()
                self.tally.answers[f"{verb} rolled back"] += len(rows)
                with self.lock:
                    self.tally.rolled_tokens.update(r["token"] for r in rows)
                    self.tally.rolled_ids.update(r["job_id"] for r in rows)
                return
        with self.lock:
            self.committed += len(rows)
            self.known.extend(r["job_id"] for r in rows)
            self.uniques.extend(
                j.args
                for j, m in zip(jobs, made, strict=True)
                if j.unique_opts is not None and not isinstance(m, Duplicate)
            )

    # ---- the admin ----------------------------------------------------------------------

    def admin(self) -> None:
        rng = random.Random(self.cfg.seed + 7)
        verbs = {"cancel": 30, "retry": 25, "get": 25, "view": 10, "pause": 3, "retry_failed": 2}
        wedges_looked_at = time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() - wedges_looked_at > 1:  # as an operator would, docs say
                wedges_looked_at = time.monotonic()
                moved = lanes_moved_past_awas_wedge(self.direct, self.cfg.schema)
                self.tally.answers["lanes moved past Awa's wedge"] += moved
            verb = rng.choices(list(verbs), weights=list(verbs.values()))[0]
            with self.lock:
                if not self.known:
                    continue
                recent = self.known[-200:] if rng.random() < 0.7 else self.known
                job_id = rng.choice(recent)
            try:
                self.administer(verb, job_id)
            except (QueueStorageJobs, UniqueConflict) as exc:
                self.tally.answers[f"{verb} {type(exc).__name__}"] += 1
            time.sleep(0.01)  # an operator's pace, not a race: the races are the runtimes'

    def administer(self, verb: str, job_id: int) -> None:
        if verb == "pause":
            with self.engine.begin() as conn:
                awa_sa.pause_queue(conn, "svc", paused_by="soak")
            self.tally.answers["pause_queue None"] += 1
            time.sleep(0.2)  # the queue stays paused a while
            with self.engine.begin() as conn:
                awa_sa.resume_queue(conn, "svc")
            self.tally.answers["resume_queue None"] += 1
            return
        with self.engine.begin() as conn:
            if verb == "get":
                row = awa_sa.get_job(conn, job_id)
                self.tally.answers[f"get_job {row.state if row else None}"] += 1
                return
            if verb == "view":
                jobs = awa_sa.jobs_view(self.cfg.schema).subquery("job")
                query = sa.select(jobs.c.state, sa.func.count()).where(jobs.c.queue == "slow")
                for state, n in conn.execute(query.group_by(jobs.c.state)):
                    self.tally.answers[f"jobs_view {state}"] += n
                return
            if verb == "retry_failed":
                found = awa_sa.retry_failed(conn, kind=KIND).jobs
            else:
                one = (awa_sa.cancel_job if verb == "cancel" else awa_sa.retry_job)(conn, job_id)
                found = [] if one is None else [one]
                if one is None:
                    conn.execute(sa.text(_ADMIN), _admin_row(verb, job_id, None))
            self.tally.answers[f"{verb} {'JobRow' if found else None}"] += len(found) or 1
            for row in found:
                conn.execute(sa.text(_ADMIN), _admin_row(verb, row.id, row))

    def follow(self) -> None:
        """How many jobs ended, as the service's own rows say (the producers' pace)."""
        ended = "SELECT (SELECT count(*) FROM svc_effects WHERE state IN ('completed', 'failed', "
        ended += "'cancelled')) + (SELECT count(*) FROM svc_receipts WHERE state IN "
        ended += "('completed', 'failed')) AS n"
        while not self.stop.is_set():
            self.ended = int(rows(self.direct, ended)[0]["n"])
            time.sleep(0.25)

    # ---- the run ------------------------------------------------------------------------

    def run(self) -> Figures:
        with self.direct.begin() as conn:
            conn.exec_driver_sql(TABLES)
            conn.execute(
                sa.text("SELECT setval(:s, :v, false)"),
                {"s": f"{self.cfg.schema}.job_id_seq", "v": QS_ID_BASE},
            )
        self.t0 = time.monotonic()
        self.produce(self.cfg.seed, once=True)  # a job first: the runtimes then stay canonical
        self.start_runtime("r1", "auto")
        self.start_runtime("r2", "auto")
        threads = [threading.Thread(target=self.guard(self.admin), name="admin")]
        operator = threading.Thread(target=self.guard(self.operator), name="operator")
        producers = [
            threading.Thread(target=self.guard(self.produce), args=(self.cfg.seed + i,))
            for i in range(self.cfg.producers)
        ]
        threads.append(threading.Thread(target=self.guard(self.follow), name="follow"))
        receivers = [
            threading.Thread(
                target=self.guard(self.receivers.receive), args=(i,), name=f"r{i}", daemon=True
            )
            for i in range(self.cfg.receivers)
        ]
        for t in [*threads, *receivers, operator, *producers]:
            t.start()
        try:
            for t in [*producers, operator]:
                t.join()
            produced = time.monotonic() - self.t0
        finally:
            self.stop.set()
            for t in threads:
                t.join()
        deadline = time.monotonic() + self.cfg.wait_secs
        while (live := live_count(self.direct, self.cfg.schema)) != 0:
            self.tally.answers["lanes moved past Awa's wedge"] += lanes_moved_past_awas_wedge(
                self.direct, self.cfg.schema
            )
            if time.monotonic() > deadline:
                self.tally.unexpected.append(f"{live} jobs still live after the wait")
                break
            time.sleep(0.5)
        settled = time.monotonic() - self.t0
        self.receivers.stop.set()  # the waits all ended: the receivers have nothing to answer
        for t in receivers:
            t.join()
        for name in list(self.procs):
            self.stop_runtime(name)
        runs = [json.loads(line) for log in self.logs for line in log.read_text().splitlines()]
        figures = check(self.direct, self.cfg.schema, self.tally, runs)
        figures.seconds = {"produced": produced, "settled": settled}
        self.engine.dispose()
        self.direct.dispose()
        return figures

    def guard(self, target: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                target(*args)
            except Exception as exc:  # every thread's failure is a finding, not a hang
                self.tally.unexpected.append(f"{target.__name__}: {type(exc).__name__}: {exc}")
                self.stop.set()

        return run


_REQUEST = "INSERT INTO svc_requests (token, job_id, how) VALUES (:token, :job_id, :how)"
_ADMIN = (
    "INSERT INTO svc_admin (verb, job_id, answer, state, run_lease, storage) "
    "VALUES (:verb, :job_id, :answer, :state, :run_lease, :storage)"
)


def _admin_row(verb: str, job_id: int, row: Any) -> dict[str, Any]:
    return {
        "verb": verb,
        "job_id": job_id,
        "answer": "None" if row is None else "JobRow",
        "state": None if row is None else row.state,
        "run_lease": None if row is None else row.run_lease,
        "storage": None if row is None else row.storage,
    }


def _options(job: NewJob) -> dict[str, Any]:
    return {
        "kind": job.kind,
        "queue": job.queue,
        "max_attempts": job.max_attempts,
        "run_at": job.run_at,
        "unique_opts": job.unique_opts,
    }


if __name__ == "__main__":  # ./dev soak
    from service_cluster import main

    sys.exit(main())
