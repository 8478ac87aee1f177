"""A bounded soak that flaps the storage transition round and round under live callers.

Each cycle: canonical, prepare, enter mixed (held until a caller waits behind it), mixed,
then drain and abort in one transaction (also held until a caller waits). Single callers
(Engine form, Connection form) and a batch caller re-schedule running attempts throughout,
each allowed a few calls per phase, so every phase sees writes and both transitions see
waiters. On the fixture the transitions are emulated; on an ``awa migrate`` cluster they are
Awa's ``awa.storage_*`` functions.

Every write is checked against the phase committed at that moment: an AFTER INSERT trigger
on ``awa.scheduled_jobs`` (canonical writes) and ``awa_qs.deferred_jobs`` (queue-storage
writes) records the singleton and ``awa.active_storage_engine()``. The trigger function is
VOLATILE, so it reads with a fresh snapshot, and the writer holds the singleton share-locked
until it commits, so what it reads is what was committed then and until the write committed.
Afterwards: no canonical write while routing was queue storage, no queue-storage write while
it was canonical, every outcome backed by its write, and every job in exactly one place.
``AWA_SA_FLAP_CYCLES`` sets the number of cycles (default 8 per cluster).

Checked against a mutant that routes the same statement with the function call instead of the
locked row: it fails here with about five canonical writes per cycle under queue-storage
routing, one per caller that waited behind enter-mixed.
"""

from __future__ import annotations

import os
import queue
import random
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from conftest import Cluster
from jobs import insert_job
from racing import RealTransitions, Transitions, held, wait_until_blocked

from awa_sa import (
    Attempt,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    Snooze,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
)

pytestmark = pytest.mark.slow  # a bounded soak of flapping transitions, a few seconds per cluster

CYCLES = int(os.environ.get("AWA_SA_FLAP_CYCLES", "8"))
SCHEMA = "awa_qs"
CALLS_PER_PHASE = 3  # per caller
BATCH = 3

_AUDIT = f"""
CREATE TABLE public.flap_writes (
    tbl text NOT NULL, job_id bigint NOT NULL, state text, engine text NOT NULL,
    epoch bigint
);
CREATE TABLE public.flap_drained (job_id bigint PRIMARY KEY);
CREATE FUNCTION public.flap_audit() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    INSERT INTO public.flap_writes (tbl, job_id, state, engine, epoch)
    SELECT TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME,
           CAST(COALESCE(to_jsonb(NEW) ->> 'id', to_jsonb(NEW) ->> 'job_id') AS bigint),
           s.state, awa.active_storage_engine(), s.transition_epoch
    FROM (SELECT 1) AS one LEFT JOIN awa.storage_transition_state AS s ON s.singleton;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER flap_audit AFTER INSERT ON awa.scheduled_jobs
    FOR EACH ROW EXECUTE FUNCTION public.flap_audit();
CREATE TRIGGER flap_audit AFTER INSERT ON {SCHEMA}.deferred_jobs
    FOR EACH ROW EXECUTE FUNCTION public.flap_audit();
"""


class Callers:
    """Three callers, each taking one token per call from the controller's queue."""

    def __init__(self, engine: sa.Engine, jobs: list[int]) -> None:
        self.engine = engine
        self.jobs = jobs
        self.lock = threading.Lock()
        self.tokens: queue.Queue[None] = queue.Queue()
        self.stop = threading.Event()
        self.outcomes: list[tuple[int, Outcome]] = []
        self.problems: list[str] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(name, call), daemon=True)
            for name, call in (
                ("engine", self._engine),
                ("connection", self._connection),
                ("batch", self._batch),
            )
        ]

    def _take(self, count: int) -> list[int]:
        with self.lock:
            taken, self.jobs[:] = self.jobs[:count], self.jobs[count:]
        return taken

    def _engine(self, rng: random.Random) -> None:
        for job in self._take(1):
            kind = Snooze(30) if rng.random() < 0.5 else RetryAfter(5)
            self._record([job], [reschedule_canonical_attempt(self.engine, job, 1, kind)])

    def _connection(self, rng: random.Random) -> None:
        for job in self._take(1):
            with self.engine.begin() as conn:
                out = reschedule_canonical_attempt(conn, job, 1, Snooze(rng.choice([1, 60])))
            self._record([job], [out])

    def _batch(self, rng: random.Random) -> None:
        jobs = self._take(BATCH)
        if jobs:
            items = [Attempt(job, 1, RetryAfter(rng.choice([1, 60]))) for job in jobs]
            self._record(jobs, reschedule_canonical_attempts(self.engine, items))

    def _record(self, jobs: list[int], outcomes: list[Outcome]) -> None:
        with self.lock:
            self.outcomes += zip(jobs, outcomes, strict=True)

    def _loop(self, name: str, call: Callable[[random.Random], None]) -> None:
        rng = random.Random(name)
        while not self.stop.is_set():
            try:
                self.tokens.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                call(rng)
            except Exception as exc:  # every call must succeed: report, never hang
                self.problems.append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                self.tokens.task_done()

    def allow(self, calls: int) -> None:
        for _ in range(calls):
            self.tokens.put(None)

    def __enter__(self) -> Callers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def _held_until_someone_waits(
    engine: sa.Engine, callers: Callers, transition: Callable[[sa.Connection], None]
) -> int:
    """Run *transition* uncommitted, let the callers in, commit once one waits behind it."""
    with held(engine) as tx:
        transition(tx.conn)
        callers.allow(CALLS_PER_PHASE * len(callers.threads))
        try:
            waiting = len(wait_until_blocked(engine, tx.pid))
        except AssertionError as exc:
            state = (callers.problems[:5], len(callers.outcomes), callers.tokens.unfinished_tasks)
            raise AssertionError(f"{exc}; callers: {state}") from exc
        tx.commit()
    callers.tokens.join()
    return waiting


def _drain_and_abort(moves: Transitions) -> Callable[[sa.Connection], None]:
    def step(conn: sa.Connection) -> None:
        # The abort's own lock first: from here no caller can write into queue storage.
        conn.execute(
            sa.text("SELECT 1 FROM awa.storage_transition_state WHERE singleton FOR UPDATE")
        )
        conn.execute(
            sa.text(
                f"WITH gone AS (DELETE FROM {SCHEMA}.deferred_jobs RETURNING job_id) "
                "INSERT INTO public.flap_drained SELECT job_id FROM gone"
            )
        )
        moves.abort(conn)

    return step


def _phase_writes(callers: Callers) -> None:
    callers.allow(CALLS_PER_PHASE * len(callers.threads))
    callers.tokens.join()


def _flap(cluster: Cluster) -> None:
    engine = cluster.engine
    moves = RealTransitions(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(_AUDIT)
        per_cycle = 5 * CALLS_PER_PHASE * (2 + BATCH)  # five phases, each job taken once
        jobs = [insert_job(conn) for _ in range(CYCLES * per_cycle + 20)]
    waits: Counter[str] = Counter()
    with Callers(engine, list(jobs)) as callers:
        for _ in range(CYCLES):
            _phase_writes(callers)  # canonical
            with engine.begin() as conn:
                moves.prepare(conn, SCHEMA)
            _phase_writes(callers)  # prepared
            waits["enter_mixed"] += _held_until_someone_waits(engine, callers, moves.enter_mixed)
            _phase_writes(callers)  # mixed_transition
            waits["abort"] += _held_until_someone_waits(engine, callers, _drain_and_abort(moves))
    assert not callers.problems, "\n".join(callers.problems[:20])
    _check(engine, jobs, callers.outcomes)
    assert waits["enter_mixed"] >= CYCLES
    assert waits["abort"] >= CYCLES


def _check(engine: sa.Engine, jobs: list[int], outcomes: list[tuple[int, Outcome]]) -> None:
    with engine.connect() as conn:
        writes = conn.execute(sa.text("SELECT tbl, job_id, state, engine FROM flap_writes")).all()
        places: Counter[int] = Counter()
        for table, column in (("awa.jobs_hot", "id"), ("awa.scheduled_jobs", "id")):
            for (job,) in conn.execute(sa.text(f"SELECT {column} FROM {table}")):
                places[job] += 1
        fresh = {
            int(r[0])
            for r in conn.execute(
                sa.text(
                    f"SELECT job_id FROM {SCHEMA}.deferred_jobs "
                    "UNION ALL SELECT job_id FROM flap_drained"
                )
            )
        }
    wrong = [
        w
        for w in writes
        if (w.tbl == "awa.scheduled_jobs") == (w.engine == "queue_storage")
        or (w.tbl != "awa.scheduled_jobs" and w.state != "mixed_transition")
    ]
    assert not wrong, f"{len(wrong)} writes against the committed phase: {wrong[:10]}"
    written = Counter((w.tbl, int(w.job_id)) for w in writes)
    kinds: Counter[str] = Counter()
    for job, outcome in outcomes:
        kinds[type(outcome).__name__] += 1
        if isinstance(outcome, Rescheduled):
            assert written[("awa.scheduled_jobs", job)] == 1, (job, outcome)
        elif isinstance(outcome, Migrated):
            assert written[(f"{SCHEMA}.deferred_jobs", outcome.job_id)] == 1, (job, outcome)
            assert outcome.job_id in fresh
            places[job] += 1
        else:
            raise AssertionError(f"job {job}: {outcome} (every call names a running attempt)")
    assert sum(written.values()) == len(outcomes)  # no write without its outcome
    # Every job in exactly one place: running, scheduled canonically, or migrated (deferred
    # or drained after the migration).
    misplaced = {job: places[job] for job in jobs if places[job] != 1}
    assert not misplaced, misplaced
    assert kinds["Rescheduled"] > 0, kinds
    assert kinds["Migrated"] > 0, kinds


def test_flapping_transitions_never_write_against_the_committed_phase(cluster: Cluster) -> None:
    _flap(cluster)
