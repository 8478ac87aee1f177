"""A reusable soak harness: many writers, rescues, double completions and a live transition.

What runs at once, against one database, for ``SoakConfig.seconds``:

* **sync workers** (threads) and **async tasks** (one event loop in its own thread) pick a
  running canonical attempt, read its ``(run_lease, attempt)``, and re-schedule it with a random
  kind, delay, error and progress, through every face of the API: ``Engine``, a caller's
  ``Connection`` (committed, or deliberately rolled back), ``AsyncEngine`` and
  ``AsyncConnection``. One call in ten is a *late completion*: a lease that can no longer match.
* **racers** pick one attempt and release two completions of it together (a barrier).
* a **rescuer** bumps ``run_lease`` (and ``attempt``) of running attempts, as a rescue followed
  by a new claim would; reschedules that were waiting on the row become Stale.
* a **claimer** promotes and claims canonical ``scheduled_jobs`` rows back into ``jobs_hot``
  (``attempt + 1``, ``run_lease + 1``), so attempts cycle; once routing has flipped it also
  completes callback-wired attempts (they stay canonical, and finalize needs the canonical
  backlog at zero).
* the **controller** moves the cluster canonical -> prepared(A) -> mixed_transition(A) -> abort
  -> canonical -> prepared(B) -> mixed_transition(B) -> drain -> active, with real locking:
  emulated on the fixture (:class:`racing.EmulatedTransitions`), Awa's ``awa.storage_*``
  functions on an ``awa migrate`` cluster (:class:`racing.RealTransitions`).

**Abort needs empty queue storage** (the real function counts the rows of fourteen tables,
the emulation counts the fixture's three). The choice made here: the mixed window that is
aborted admits no write. The controller closes a gate in front of the writers and waits until
none is in flight, commits the flip to A, takes the abort's lock (its emptiness check passes by
construction, not by luck), and only then reopens the gate. Every writer's first statement now
sees routing A committed, and queues behind the abort (the controller waits until the server
says so). When the abort commits they must all route canonical: the abort-first race with many
waiters, and precisely the window in which Awa 0.6's one-statement read would strand them in A
(a mutation run with that read fails the check with "rows stranded in aborted schema"). The
second mixed window is a real one: writers migrate into B while it lasts, and some wait behind
the flip itself and behind finalize.

Afterwards :func:`check` reads every row back and verifies the invariants; see its docstring.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from racing import (
    Transitions,
    backend_pid,
    blocked_by,
    canonical_backlog,
    in_thread,
    wait_for,
    wait_until_blocked,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import (
    AwaSAError,
    CancelledDuplicate,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    reschedule_canonical_attempt,
)
from awa_sa.settle.results import Kind
from awa_sa.tables.canonical import JOB_STATES

# --------------------------------------------------------------------------------------------
# Configuration and records


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 20.0
    jobs: int = 120
    sync_workers: int = 4
    async_tasks: int = 4
    racers: int = 1
    schema_a: str = "awa"
    """Routed to in the first mixed window, which is aborted."""
    schema_b: str = "awa_qs"
    """Routed to in the second mixed window, which is finalized."""
    seed: int = 6
    label: str = "soak"


QS_ID_BASE = 1_000_000
"""Schema A's ``job_id_seq`` starts at ``QS_ID_BASE``, B's at twice that: an id names its schema."""

HOLDER_MASK = "11111000"
OWN_MASKS = ("11111000", "11111111", "10001000", "01111111", "00100000", "11011000", "00000000")
"""Masks for attempts with a key of their own (some claim ``running``, some do not)."""
SHARED_MASKS = ("11000000", "11000010", "10001000", "10001010", "00001000", "10000010", "00000000")
"""Masks for attempts sharing a key: ``running`` (bit 2) is off, so seeding two is possible."""
DELAYS = (0.0, 0.25, 1.0, 5.0, 30.0, 3600.0)
SNOOZE_ONLY_FROM = 20
"""From this attempt on workers only snooze, which does not count, so attempts stay bounded."""
BACKOFF_OVERFLOWS_FROM = 43
IDLE_POLL = 0.02  # seconds a writer that found nothing running waits before its next call
"""``awa.backoff_duration`` overflows from attempt 44 (docs/contract.md#backoff), and at 43 whenever
its jitter is large enough (about four calls in five, on the real v040 function too). From 46
on, the wrapped interval sometimes lands ``run_at`` in a year PostgreSQL accepts but Python's
``datetime`` cannot hold (before year 1): the driver then fails to read the row back, and the
call is rolled back with a DatabaseError that has no SQLSTATE."""


def _overflow(sqlstate: str | None, message: str) -> bool:
    """Is this the database (or the driver reading its result) refusing a backoff overflow?"""
    return sqlstate in ("22008", "22003") or (sqlstate is None and "timestamp too" in message)


@dataclass(frozen=True)
class SeedJob:
    id: int
    category: str  # plain, own, shared, sibling, callback, overflow, holder
    unique_key: bytes | None
    mask: str | None
    attempt: int
    lease: int


@dataclass
class Call:
    """One reschedule call, as the caller saw it."""

    worker: str
    form: str  # engine, connection, rollback, async_engine, async_connection
    job_id: int
    lease: int
    read_attempt: int | None  # None for a late completion
    callback: bool
    kind: str
    late: bool
    t0: float
    t1: float = 0.0
    outcome: str = ""  # Rescheduled, Migrated, CancelledDuplicate, Stale, or error:<class>
    result_id: int | None = None
    result_attempt: int | None = None
    sqlstate: str | None = None
    message: str = ""
    seen_epoch: int | None = None  # connection forms: routing read in the same transaction
    seen_schema: str | None = None
    race: int | None = None

    @property
    def committed(self) -> bool:
        return self.form != "rollback"

    @property
    def won(self) -> bool:
        return self.committed and self.outcome in ("Rescheduled", "Migrated", "CancelledDuplicate")


@dataclass(frozen=True)
class Event:
    """A claim, rescue or completion made by the harness itself."""

    what: str
    job_id: int
    lease: int  # lease after the event (completion: the completed lease)
    attempt: int
    queue_marks: int = 0
    kind_marks: int = 0


@dataclass
class Transition:
    name: str
    t_begin: float
    t_commit: float = 0.0
    state: str | None = None
    epoch: int | None = None
    schema: str | None = None
    waiting_at_commit: int = 0
    error: str | None = None


@dataclass
class Report:
    config: dict[str, Any]
    kind: str
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# SQL used by the harness (never by the library)

_PICK_RUNNING = sa.text(
    "SELECT id, run_lease, attempt, callback_id IS NOT NULL AS cb FROM awa.jobs_hot "
    "WHERE state = 'running' ORDER BY random() LIMIT 1"
)
_WHERE_IS = sa.text(
    "SELECT state::text AS state, run_lease FROM awa.jobs_hot WHERE id = :i "
    "UNION ALL SELECT state::text, run_lease FROM awa.scheduled_jobs WHERE id = :i"
)
_SEEN = sa.text(
    "SELECT s.transition_epoch AS epoch, awa.active_queue_storage_schema() AS schema "
    "FROM (SELECT 1) AS one LEFT JOIN awa.storage_transition_state s ON s.singleton"
)
_CLAIM = sa.text(
    """
    WITH picked AS (
        SELECT id FROM awa.scheduled_jobs ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM awa.scheduled_jobs s USING picked WHERE s.id = picked.id RETURNING s.*
    )
    INSERT INTO awa.jobs_hot (
        id, kind, queue, args, state, priority, attempt, max_attempts, run_at, heartbeat_at,
        deadline_at, attempted_at, finalized_at, created_at, errors, metadata, tags, unique_key,
        unique_states, callback_id, callback_timeout_at, callback_filter, callback_on_complete,
        callback_on_fail, callback_transform, run_lease, progress)
    SELECT id, kind, queue, args, 'running', priority, attempt + 1, max_attempts, now(), now(),
        NULL, now(), finalized_at, created_at, errors, metadata, tags, unique_key,
        unique_states, callback_id, callback_timeout_at, callback_filter, callback_on_complete,
        callback_on_fail, callback_transform, run_lease + 1, progress
    FROM taken
    RETURNING id, run_lease, attempt
    """
)
_RESCUE = sa.text(
    """
    UPDATE awa.jobs_hot SET run_lease = run_lease + 1, attempt = attempt + 1,
        heartbeat_at = now(), attempted_at = now()
    WHERE id = (SELECT id FROM awa.jobs_hot WHERE state = 'running'
                ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id, run_lease, attempt
    """
)
_COMPLETE_CALLBACK = sa.text(
    """
    UPDATE awa.jobs_hot SET state = 'completed', finalized_at = now(), heartbeat_at = NULL
    WHERE id = (SELECT id FROM awa.jobs_hot WHERE state = 'running' AND callback_id IS NOT NULL
                ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id, run_lease, attempt
    """
)
_MY_MARKS = sa.text(
    "SELECT (SELECT count(*) FROM awa.admin_dirty_queue_marks "
    "        WHERE xmin = pg_current_xact_id()::xid),"
    "       (SELECT count(*) FROM awa.admin_dirty_kind_marks "
    "        WHERE xmin = pg_current_xact_id()::xid)"
)
_INSERT = sa.text(
    """
    INSERT INTO awa.jobs_hot (kind, queue, args, state, priority, attempt, max_attempts,
        run_at, heartbeat_at, attempted_at, finalized_at, errors, metadata, tags, unique_key,
        unique_states, callback_id, callback_timeout_at, run_lease)
    VALUES (:kind, :queue, CAST(:args AS jsonb), CAST(:state AS awa.job_state), :priority,
        :attempt, :max_attempts, now(), now(), now(),
        CASE WHEN :state = 'completed' THEN now() END,
        CAST(:errors AS jsonb[]), CAST(:metadata AS jsonb), CAST(:tags AS text[]), :key,
        CAST(:mask AS bit(8)), CASE WHEN :callback THEN gen_random_uuid() END,
        CASE WHEN :callback THEN now() + interval '1 hour' END, :lease)
    RETURNING id
    """
)


# --------------------------------------------------------------------------------------------
# The harness


class Soak:
    """One soak run against the database at *url*; :meth:`run` returns a checked :class:`Report`."""

    def __init__(self, url: str, transitions: Transitions, config: SoakConfig) -> None:
        if config.schema_a == config.schema_b:
            raise ValueError("the aborted and the finalized schema must differ")
        self.url = url
        self.config = config
        self.transitions = transitions
        self.engine = sa.create_engine(url, pool_size=24, max_overflow=16)
        self.seeds: list[SeedJob] = []
        self.calls: list[Call] = []
        self.events: list[Event] = []
        self.log: list[Transition] = []
        self.unexpected: list[str] = []
        self.races: Counter[str] = Counter()
        self.base_marks = (0, 0)
        self.qs_base = {config.schema_a: QS_ID_BASE, config.schema_b: 2 * QS_ID_BASE}
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._gate = threading.Event()
        self._gate.set()
        self._busy = 0
        self._busy_lock = threading.Condition()
        self._race_ids = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        self.t_start = 0.0

    # ---- seeding ---------------------------------------------------------------------------

    def seed(self) -> None:
        rng = random.Random(self.config.seed)
        rows: list[tuple[str, dict[str, Any]]] = []
        n = self.config.jobs
        cut = {"plain": 0.30, "own": 0.60, "shared": 0.80, "sibling": 0.92}
        for i in range(n):
            x = i / n
            if i < 2:
                cat = "overflow"
            elif x < cut["plain"]:
                cat = "plain"
            elif x < cut["own"]:
                cat = "own"
            elif x < cut["shared"]:
                cat = "shared"
            elif x < cut["sibling"]:
                cat = "sibling"
            else:
                cat = "callback"
            key: bytes | None = None
            mask: str | None = None
            if cat == "own":
                key, mask = b"own-%d" % i, rng.choice(OWN_MASKS)
            elif cat == "shared":
                group = i // 3
                key, mask = b"shared-%d" % group, rng.choice(SHARED_MASKS)
                if i % 3 == 0 or not any(r[1]["key"] == key for r in rows):
                    rows.append(
                        ("holder", self._row(rng, "holder", key, HOLDER_MASK, attempt=1, lease=0))
                    )
            elif cat == "sibling":
                key, mask = b"sibling-%d" % (i // 2), rng.choice(SHARED_MASKS)
            attempt = 45 if cat == "overflow" else rng.randint(1, 5)
            rows.append(
                (cat, self._row(rng, cat, key, mask, attempt=attempt, lease=rng.randint(1, 50)))
            )
        with self.engine.begin() as conn:
            for i, schema in enumerate((self.config.schema_a, self.config.schema_b)):
                start = (i + 1) * QS_ID_BASE
                conn.execute(
                    sa.text("SELECT setval(:s, :v, false)"),
                    {"s": f"{schema}.job_id_seq", "v": start},
                )
            for cat, params in rows:
                job_id = int(conn.execute(_INSERT, params).scalar_one())
                self.seeds.append(
                    SeedJob(
                        job_id,
                        cat,
                        params["key"],
                        params["mask"],
                        params["attempt"],
                        params["lease"],
                    )
                )
            q, k = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM awa.admin_dirty_queue_marks),"
                    "       (SELECT count(*) FROM awa.admin_dirty_kind_marks)"
                )
            ).one()
            self.base_marks = (int(q), int(k))

    @staticmethod
    def _row(
        rng: random.Random,
        cat: str,
        key: bytes | None,
        mask: str | None,
        *,
        attempt: int,
        lease: int,
    ) -> dict[str, Any]:
        holder = cat == "holder"
        return {
            "kind": "holder" if holder else f"soak_{cat}",
            "queue": rng.choice(("default", "mail", "reports")),
            "args": json.dumps({"n": rng.randint(0, 10**6), "s": "ünïcode ✓"}),
            "state": "completed" if holder else "running",
            "priority": rng.randint(1, 4),
            "attempt": attempt,
            "max_attempts": 1000 if cat == "overflow" else 25,
            "errors": rng.choice([None, [], ['{"error": "earlier", "attempt": 0}']]),
            "metadata": rng.choice(["{}", '{"tenant": "acme"}']),
            "tags": rng.choice([[], ["t1"], ["a", "b"]]),
            "key": key,
            "mask": mask,
            "callback": cat == "callback",
            "lease": lease,
        }

    # ---- bookkeeping -----------------------------------------------------------------------

    @contextmanager
    def _active(self) -> Iterator[bool]:
        """Count the caller as in flight, unless the gate is closed (then yield False)."""
        with self._busy_lock:
            self._busy += 1
        try:
            if not self._gate.is_set():
                yield False
            else:
                yield True
        finally:
            with self._busy_lock:
                self._busy -= 1
                self._busy_lock.notify_all()

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def _event(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def _problem(self, text: str) -> None:
        with self._lock:
            self.unexpected.append(text)

    def _idle(self) -> None:
        """A writer that found nothing running polls, as a worker does, rather than spin.

        Spinning writers hold the transition row's share lock back to back, and the
        controller's FOR UPDATE (the finalize) waited behind them for most of a minute.
        """
        self._stop.wait(IDLE_POLL)

    # ---- one call --------------------------------------------------------------------------

    def _choose(
        self, rng: random.Random, target: Any | None
    ) -> tuple[int, int, int | None, bool, bool]:
        """``(job_id, lease, read_attempt, callback, late)`` from a fresh read or a late one."""
        if target is not None and rng.random() >= 0.1:
            return (
                int(target.id),
                int(target.run_lease),
                int(target.attempt),
                bool(target.cb),
                False,
            )
        seed = rng.choice([s for s in self.seeds if s.category != "holder"])
        return seed.id, -1, None, seed.category == "callback", True

    @staticmethod
    def _late_lease(rows: Sequence[Any], seed_lease: int) -> int:
        """A lease that can never match again: the current one of a row that is not running
        (it must be claimed, which bumps it, before it can run), one below a running row's, or
        anything for an attempt that left the canonical plane."""
        if not rows:
            return seed_lease
        row = rows[0]
        return int(row.run_lease) - 1 if row.state == "running" else int(row.run_lease)

    @staticmethod
    def _kind(rng: random.Random, attempt: int | None) -> Kind:
        delay = rng.choice(DELAYS)
        if attempt is not None and attempt >= BACKOFF_OVERFLOWS_FROM:
            return rng.choice((Snooze(delay), RetryBackoff()))
        if attempt is not None and attempt >= SNOOZE_ONLY_FROM:
            return Snooze(delay)
        r = rng.random()
        return Snooze(delay) if r < 0.4 else RetryAfter(delay) if r < 0.7 else RetryBackoff()

    @staticmethod
    def _payloads(rng: random.Random, attempt: int | None) -> tuple[Any, Any]:
        error = (
            {"error": "handler failed: ☠", "attempt": attempt, "at": "2026-01-01T00:00:00+00:00"}
            if rng.random() < 0.4
            else None
        )
        progress = {"pct": rng.randint(0, 100), "msg": "half ½"} if rng.random() < 0.5 else None
        return error, progress

    def _finish(self, call: Call, out: Outcome | None, exc: BaseException | None) -> Call:
        call.t1 = time.monotonic()
        if exc is None:
            assert out is not None
            call.outcome = type(out).__name__
            if isinstance(out, Rescheduled | Migrated):
                call.result_id, call.result_attempt = out.job_id, out.attempt
            elif isinstance(out, CancelledDuplicate):
                call.result_id = out.job_id
        else:
            call.outcome = f"error:{type(exc).__name__}"
            call.sqlstate = getattr(exc, "sqlstate", None)
            call.message = str(exc)[:300]
            if not isinstance(exc, AwaSAError):
                self._problem(f"{call.worker}: non-AwaSAError {exc!r}")
        self._record(call)
        return call

    def sync_call(
        self,
        rng: random.Random,
        worker: str,
        *,
        form: str | None = None,
        fixed: tuple[int, int, int | None, bool] | None = None,
        race: int | None = None,
        barrier: threading.Barrier | None = None,
    ) -> Call | None:
        with self.engine.connect() as conn:
            idle = False
            if fixed is None:
                target = conn.execute(_PICK_RUNNING).first()
                idle = target is None
                job_id, lease, attempt, cb, late = self._choose(rng, target)
                if late:
                    lease = self._late_lease(conn.execute(_WHERE_IS, {"i": job_id}).all(), 1)
            else:
                (job_id, lease, attempt, cb), late = fixed, False
            conn.rollback()
            if idle:
                self._idle()
            kind = self._kind(rng, attempt)
            error, progress = self._payloads(rng, attempt)
            form = form or rng.choice(("engine", "engine", "connection", "rollback"))
            call = Call(
                worker, form, job_id, lease, attempt, cb, type(kind).__name__, late, 0.0, race=race
            )
            if barrier is not None:
                barrier.wait()
            call.t0 = time.monotonic()
            out: Outcome | None = None
            try:
                if form == "engine":
                    out = reschedule_canonical_attempt(
                        self.engine, job_id, lease, kind, error=error, progress=progress
                    )
                else:
                    with conn.begin() as tx:
                        out = reschedule_canonical_attempt(
                            conn, job_id, lease, kind, error=error, progress=progress
                        )
                        seen = conn.execute(_SEEN).one()
                        call.seen_epoch, call.seen_schema = seen.epoch, seen.schema
                        if form == "rollback":
                            tx.rollback()
            except Exception as exc:
                return self._finish(call, None, exc)
            return self._finish(call, out, None)

    async def async_call(self, aengine: AsyncEngine, rng: random.Random, worker: str) -> Call:
        async with aengine.connect() as conn:
            target = (await conn.execute(_PICK_RUNNING)).first()
            job_id, lease, attempt, cb, late = self._choose(rng, target)
            if late:
                lease = self._late_lease((await conn.execute(_WHERE_IS, {"i": job_id})).all(), 1)
            await conn.rollback()
            if target is None:
                await asyncio.sleep(IDLE_POLL)
            kind = self._kind(rng, attempt)
            error, progress = self._payloads(rng, attempt)
            form = rng.choice(("async_engine", "async_connection"))
            call = Call(
                worker,
                form,
                job_id,
                lease,
                attempt,
                cb,
                type(kind).__name__,
                late,
                time.monotonic(),
            )
            out: Outcome | None = None
            try:
                if form == "async_engine":
                    out = await awa_async.reschedule_canonical_attempt(
                        aengine, job_id, lease, kind, error=error, progress=progress
                    )
                else:
                    async with conn.begin():
                        out = await awa_async.reschedule_canonical_attempt(
                            conn, job_id, lease, kind, error=error, progress=progress
                        )
                        seen = (await conn.execute(_SEEN)).one()
                        call.seen_epoch, call.seen_schema = seen.epoch, seen.schema
            except Exception as exc:
                return self._finish(call, None, exc)
            return self._finish(call, out, None)

    # ---- actors ----------------------------------------------------------------------------

    def _worker(self, n: int) -> None:
        rng = random.Random(self.config.seed * 1000 + n)
        while not self._stop.is_set():
            with self._active() as go:
                if go:
                    self.sync_call(rng, f"sync-{n}")
                    continue
            self._gate.wait(0.05)

    def _racer(self, n: int) -> None:
        """Two completions of one attempt, released together: at most one may win."""
        rng = random.Random(self.config.seed * 2000 + n)
        while not self._stop.is_set():
            with self._active() as go:
                if go:
                    self._race_once(rng, n)
                    continue
            self._gate.wait(0.05)

    def _race_once(self, rng: random.Random, n: int) -> None:
        with self.engine.connect() as conn:
            target = conn.execute(_PICK_RUNNING).first()
        if target is None:
            self._stop.wait(0.005)
            return
        race = next(self._race_ids)
        fixed = (int(target.id), int(target.run_lease), int(target.attempt), bool(target.cb))
        barrier = threading.Barrier(2, timeout=30)
        plans = [(rng.randrange(1 << 30), rng.choice(("engine", "connection"))) for _ in range(2)]

        def contender(seed: int, form: str) -> Call | None:
            return self.sync_call(
                random.Random(seed),
                f"race-{n}",
                form=form,
                fixed=fixed,
                race=race,
                barrier=barrier,
            )

        futures = [
            in_thread(functools.partial(contender, seed, form), name=f"race-{race}")
            for seed, form in plans
        ]
        calls = [f.result(timeout=60) for f in futures]
        winners = sum(1 for c in calls if c is not None and c.won)
        self.races["won" if winners == 1 else "none" if winners == 0 else "DOUBLE"] += 1
        if winners > 1:
            self._problem(f"race {race}: two completions of {fixed} won")

    def _rescuer(self) -> None:
        while not self._stop.is_set():
            with self.engine.begin() as conn:
                row = conn.execute(_RESCUE).first()
                if row is not None:
                    q, k = conn.execute(_MY_MARKS).one()
                    self._event(
                        Event("rescue", int(row.id), int(row.run_lease), int(row.attempt), q, k)
                    )
            # Once the drain begins, rescue rarely: a rescue every 20 ms of the last few running
            # attempts bumps each lease faster than a call can read and settle it, and the
            # drain never ends (seen: the last attempt rescued 500 times, every call Stale).
            self._stop.wait(0.5 if self._drain.is_set() else 0.02)

    def _claimer(self) -> None:
        while not self._stop.is_set():
            did = False
            with self.engine.begin() as conn:
                row = conn.execute(_CLAIM).first()
                if row is not None:
                    q, k = conn.execute(_MY_MARKS).one()
                    self._event(
                        Event("claim", int(row.id), int(row.run_lease), int(row.attempt), q, k)
                    )
                    did = True
            if self._drain.is_set():
                with self.engine.begin() as conn:
                    row = conn.execute(_COMPLETE_CALLBACK).first()
                    if row is not None:
                        q, k = conn.execute(_MY_MARKS).one()
                        self._event(
                            Event(
                                "complete", int(row.id), int(row.run_lease), int(row.attempt), q, k
                            )
                        )
                        did = True
            if not did:
                self._stop.wait(0.003)

    def _async_loop(self) -> None:
        """The async writers: one event loop, ``async_tasks`` tasks sharing an AsyncEngine."""

        async def run() -> None:
            aengine = create_async_engine(self.url, pool_size=self.config.async_tasks + 2)

            async def task(n: int) -> None:
                rng = random.Random(self.config.seed * 3000 + n)
                while not self._stop.is_set():
                    with self._active() as go:
                        if go:
                            await self.async_call(aengine, rng, f"async-{n}")
                            continue
                    await asyncio.sleep(0.005)

            try:
                await asyncio.gather(*(task(n) for n in range(self.config.async_tasks)))
            finally:
                await aengine.dispose()

        asyncio.run(run())

    # ---- the controller --------------------------------------------------------------------

    def _routing(self, tr: Transition) -> None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT state, transition_epoch, awa.active_queue_storage_schema() AS s "
                    "FROM awa.storage_transition_state WHERE singleton"
                )
            ).one()
        tr.state, tr.epoch, tr.schema = row.state, int(row.transition_epoch), row.s

    def _simple(self, name: str, step: Callable[[sa.Connection], None]) -> Transition:
        tr = Transition(name, time.monotonic())
        with self.engine.begin() as conn:
            step(conn)
        tr.t_commit = time.monotonic()
        self._routing(tr)
        self.log.append(tr)
        return tr

    def _held(
        self, name: str, step: Callable[[sa.Connection], None], want_waiters: float
    ) -> Transition:
        """Run *step* in a transaction and keep it open until a writer waits on it (bounded)."""
        tr = Transition(name, time.monotonic())
        with self.engine.connect() as conn:
            tx = conn.begin()
            pid = backend_pid(conn)
            step(conn)
            deadline = time.monotonic() + want_waiters
            while time.monotonic() < deadline and not blocked_by(self.engine, pid):
                time.sleep(0.005)
            tr.waiting_at_commit = len(blocked_by(self.engine, pid))
            tx.commit()
        tr.t_commit = time.monotonic()
        self._routing(tr)
        self.log.append(tr)
        return tr

    def _gated_abort_window(self) -> None:
        """mixed_transition(A) that no write reaches, aborted with writers queued behind it.

        Writers are held at the gate while the flip to A commits and the abort takes the
        singleton; then they are let go, start their calls -- their first statements now see
        routing A committed -- and queue behind the abort. That is exactly the window in which
        Awa 0.6's one-statement read would migrate into A after the abort
        (docs/contract.md#routing-read).
        """
        a = self.config.schema_a
        self._simple(f"prepare {a}", lambda c: self.transitions.prepare(c, a))
        self._gate.clear()
        with self._busy_lock:
            if not self._busy_lock.wait_for(lambda: self._busy == 0, timeout=60):
                raise AssertionError("writers did not go idle at the gate")
        self._simple(f"enter_mixed {a}", self.transitions.enter_mixed)
        abort = Transition("abort", time.monotonic())
        with self.engine.connect() as conn:
            tx = conn.begin()
            pid = backend_pid(conn)
            self.transitions.abort(conn)  # locked, checked (queue storage empty), written
            self._gate.set()
            wait_until_blocked(self.engine, pid, count=2)  # writers queue behind the abort
            abort.waiting_at_commit = len(blocked_by(self.engine, pid))
            tx.commit()
        abort.t_commit = time.monotonic()
        self._routing(abort)
        self.log.append(abort)

    def _wait_until(self, t: float) -> None:
        self._stop.wait(max(0.0, t - time.monotonic()))

    def _control(self, start: float) -> None:
        d = self.config.seconds
        b = self.config.schema_b
        self._wait_until(start + 0.3 * d)
        self._gated_abort_window()
        self._wait_until(start + 0.55 * d)
        self._simple(f"prepare {b}", lambda c: self.transitions.prepare(c, b))
        self._held(f"enter_mixed {b}", self.transitions.enter_mixed, want_waiters=3.0)
        self._drain.set()
        with self.engine.connect() as conn:
            wait_for(lambda: _backlog(conn) == 0, timeout=max(60.0, d), what="canonical drain")
        self._held("finalize", self.transitions.finalize, want_waiters=2.0)
        self._wait_until(max(start + d, time.monotonic() + 0.05 * d))

    # ---- run -------------------------------------------------------------------------------

    def run(self) -> Report:
        self.seed()
        threads = [
            threading.Thread(target=self._worker, args=(n,), daemon=True)
            for n in range(self.config.sync_workers)
        ]
        threads += [
            threading.Thread(target=self._racer, args=(n,), daemon=True)
            for n in range(self.config.racers)
        ]
        threads += [
            threading.Thread(target=self._rescuer, daemon=True),
            threading.Thread(target=self._claimer, daemon=True),
        ]
        if self.config.async_tasks:
            threads.append(threading.Thread(target=self._async_loop, daemon=True))
        start = self.t_start = time.monotonic()
        for t in threads:
            t.start()
        try:
            self._control(start)
        except Exception as exc:
            self._problem(f"controller: {exc!r}")
        finally:
            self._stop.set()
            self._gate.set()
            for t in threads:
                t.join(timeout=60)
                if t.is_alive():
                    self._problem(f"thread {t.name} did not stop")
        duration = time.monotonic() - start
        report = check(self, duration)
        self.engine.dispose()
        return report


def _backlog(conn: sa.Connection) -> int:
    n = canonical_backlog(conn)
    conn.rollback()
    return n


# --------------------------------------------------------------------------------------------
# Invariants


def _claims(mask: str | None, state: str) -> bool:
    bit = JOB_STATES.index(state)
    return mask is not None and len(mask) > bit and mask[bit] == "1"


def check(soak: Soak, duration: float) -> Report:
    """Read every row back and check what must hold whatever the interleaving was.

    1. Every seeded attempt is in exactly one place: its canonical row (``jobs_hot`` running or
       completed, or ``scheduled_jobs``), or -- once migrated -- one successor in ``B``'s
       ``deferred_jobs`` or one cancelled row in ``B``'s ``done_entries``, and then no canonical
       row. No row exists that no call or seed explains.
    2. Nothing sits in a schema that was not active when it was written: schema A (aborted)
       holds nothing; every queue-storage id names schema B; every call whose routing is known
       (read in its own transaction, or made entirely between two transitions) wrote where that
       routing says.
    3. Unique claims: every claim points at a live row whose state its mask claims, every row
       that claims holds its claim, and no key is claimed twice.
    4. Attempts follow the kinds: a winner reports the attempt it read, less one for a Snooze;
       every row's attempt, state and lease are those of the event that produced it.
    5. Tallies: rows per table, terminal-count deltas and dirty marks match the outcomes.
    6. Two completions of one ``(id, run_lease)`` never both win, and late completions are Stale.
    """
    cfg = soak.config
    a, b = cfg.schema_a, cfg.schema_b
    problems = list(soak.unexpected)
    calls = soak.calls
    events = soak.events
    with soak.engine.connect() as conn:
        hot = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, state::text AS state, run_lease, attempt, unique_key, "
                    "unique_states::text AS mask, callback_id IS NOT NULL AS cb FROM awa.jobs_hot"
                )
            )
        }
        sched = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, state::text AS state, run_lease, attempt, run_at, unique_key, "
                    "unique_states::text AS mask FROM awa.scheduled_jobs"
                )
            )
        }
        deferred: dict[str, dict[int, Any]] = {}
        done: dict[str, dict[int, Any]] = {}
        deltas: dict[str, list[Any]] = {}
        for s in (a, b):
            deferred[s] = {
                r.job_id: r
                for r in conn.execute(
                    sa.text(
                        f"SELECT job_id, state::text AS state, attempt, run_lease, unique_key, "
                        f"unique_states AS mask FROM {s}.deferred_jobs"
                    )
                )
            }
            done[s] = {
                r.job_id: r
                for r in conn.execute(
                    sa.text(
                        f"SELECT job_id, state::text AS state, attempt, run_lease, unique_key, "
                        f"unique_states AS mask, lane_seq FROM {s}.done_entries"
                    )
                )
            }
            deltas[s] = list(
                conn.execute(
                    sa.text(
                        "SELECT counter_bucket, terminal_delta "
                        f"FROM {s}.queue_terminal_count_deltas"
                    )
                )
            )
        claims = list(conn.execute(sa.text("SELECT unique_key, job_id FROM awa.job_unique_claims")))
        marks = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM awa.admin_dirty_queue_marks),"
                "       (SELECT count(*) FROM awa.admin_dirty_kind_marks)"
            )
        ).one()
        final = conn.execute(
            sa.text(
                "SELECT state, awa.active_queue_storage_schema() AS s "
                "FROM awa.storage_transition_state WHERE singleton"
            )
        ).one()

    seeds = {s.id: s for s in soak.seeds}
    winners = [c for c in calls if c.won]
    by_outcome = Counter(c.outcome for c in calls if c.committed)

    # 6. one winner per attempt; late completions stale
    per_attempt = Counter((c.job_id, c.lease) for c in winners)
    per_attempt.update((e.job_id, e.lease) for e in events if e.what == "complete")
    problems += [f"attempt {k} completed {n} times" for k, n in per_attempt.items() if n > 1]
    problems += [
        f"late completion {c.job_id}/{c.lease} was {c.outcome}"
        for c in calls
        if c.late and c.outcome != "Stale"
    ]

    # 2. schema A untouched; ids name schema B
    if deferred[a] or done[a] or deltas[a]:
        problems.append(f"rows stranded in aborted schema {a}")
    lo, hi = soak.qs_base[b], soak.qs_base[b] + QS_ID_BASE
    migrated = {c.job_id: c for c in winners if c.outcome in ("Migrated", "CancelledDuplicate")}
    for c in migrated.values():
        if not (c.result_id is not None and lo <= c.result_id < hi):
            problems.append(f"successor id {c.result_id} of {c.job_id} is not from schema {b}")
    if (final.state, final.s) != ("active", b):
        problems.append(f"final routing {tuple(final)} is not active/{b}")
    problems += _routing_problems(soak, calls, b)

    # 1. one place per seeded attempt; nothing unexplained
    mig_ids = {
        c.result_id
        for c in migrated.values()
        if c.outcome == "Migrated" and c.result_id is not None
    }
    can_ids = {
        c.result_id
        for c in migrated.values()
        if c.outcome == "CancelledDuplicate" and c.result_id is not None
    }
    if set(deferred[b]) != mig_ids:
        problems.append(f"deferred rows {sorted(set(deferred[b]) ^ mig_ids)[:10]} unexplained")
    if set(done[b]) != can_ids:
        problems.append(f"done rows {sorted(set(done[b]) ^ can_ids)[:10]} unexplained")
    for sid, seed in seeds.items():
        places = (sid in hot) + (sid in sched)
        if seed.category == "holder":
            if not (sid in hot and hot[sid].state == "completed" and places == 1):
                problems.append(f"holder {sid} moved")
            continue
        if sid in migrated:
            if places:
                problems.append(f"job {sid} migrated but still canonical")
        elif places != 1:
            problems.append(f"job {sid} is in {places} canonical places")
        elif sid in hot and hot[sid].state not in ("running", "completed"):
            problems.append(f"job {sid} in jobs_hot as {hot[sid].state}")
    for cid in set(hot) | set(sched):
        if cid not in seeds:
            problems.append(f"canonical row {cid} was never seeded")
    n_migrating = Counter(
        c.job_id for c in winners if c.outcome in ("Migrated", "CancelledDuplicate")
    )
    problems += [
        f"job {j} left the canonical plane {n} times" for j, n in n_migrating.items() if n > 1
    ]

    # 3. claims
    rows_by_id: dict[int, tuple[str, bytes | None, str | None]] = {}
    for r in hot.values():
        rows_by_id[r.id] = (r.state, r.unique_key, r.mask)
    for r in sched.values():
        rows_by_id[r.id] = (r.state, r.unique_key, r.mask)
    for r in deferred[b].values():
        rows_by_id[r.job_id] = (r.state, r.unique_key, r.mask)
    for r in done[b].values():
        rows_by_id[r.job_id] = (r.state, r.unique_key, r.mask)
    keys = Counter(bytes(k) for k, _ in claims)
    problems += [f"key {k!r} claimed {n} times" for k, n in keys.items() if n > 1]
    held = {(bytes(k), j) for k, j in claims}
    for held_key, jid in held:
        row = rows_by_id.get(jid)
        if (
            row is None
            or row[1] is None
            or bytes(row[1]) != held_key
            or not _claims(row[2], row[0])
        ):
            problems.append(f"claim ({held_key!r}, {jid}) points at {row}")
    for jid, (state, row_key, mask) in rows_by_id.items():
        if row_key is not None and _claims(mask, state) and (bytes(row_key), jid) not in held:
            problems.append(f"row {jid} ({state}, {mask}) claims {row_key!r} but holds no claim")

    # 4. attempts
    for c in winners:
        if c.read_attempt is not None and c.result_attempt is not None:
            want = c.read_attempt - (1 if c.kind == "Snooze" else 0)
            if c.result_attempt != want:
                problems.append(
                    f"{c.kind} of {c.job_id} at attempt {c.read_attempt} -> {c.result_attempt}"
                )
    made: dict[tuple[int, int], Any] = {}
    for e in events:
        if e.what in ("claim", "rescue"):
            made[(e.job_id, e.lease)] = e
    winner_at = {(c.job_id, c.lease): c for c in winners}
    for r in hot.values():
        seeded = seeds[r.id]
        if seeded.category == "holder" or r.state != "running":
            continue
        maker = made.get((r.id, r.run_lease))
        expected = (
            maker.attempt
            if maker is not None
            else seeded.attempt
            if r.run_lease == seeded.lease
            else None
        )
        if expected != r.attempt:
            problems.append(
                f"running {r.id} lease {r.run_lease} attempt {r.attempt}, expected {expected}"
            )
    for r in sched.values():
        by = winner_at.get((r.id, r.run_lease))
        state = "scheduled" if by is not None and by.kind == "Snooze" else "retryable"
        if (
            by is None
            or by.outcome != "Rescheduled"
            or by.result_attempt != r.attempt
            or state != r.state
        ):
            problems.append(
                f"scheduled {r.id} ({r.state}, {r.attempt}) not made by its winner {by}"
            )
    for r in deferred[b].values():
        by = next((x for x in migrated.values() if x.result_id == r.job_id), None)
        state = "scheduled" if by is not None and by.kind == "Snooze" else "retryable"
        if (
            by is None
            or by.result_attempt != r.attempt
            or r.state != state
            or r.run_lease != by.lease
        ):
            problems.append(f"deferred {r.job_id} ({r.state}, {r.attempt}) not made by {by}")
    for r in done[b].values():
        if r.state != "cancelled" or r.lane_seq != -r.job_id:
            problems.append(f"done row {r.job_id} is {r.state}, lane_seq {r.lane_seq}")

    # 5. tallies
    n_res = by_outcome["Rescheduled"]
    n_mig = by_outcome["Migrated"]
    n_can = by_outcome["CancelledDuplicate"]
    claims_n = sum(1 for e in events if e.what == "claim")
    completes = [e for e in events if e.what == "complete"]
    if len(sched) != n_res - claims_n:
        problems.append(f"{len(sched)} scheduled rows, but {n_res} Rescheduled - {claims_n} claims")
    seeded_running = sum(1 for s in soak.seeds if s.category != "holder")
    running = sum(1 for r in hot.values() if r.state == "running")
    want_running = seeded_running + claims_n - n_res - n_mig - n_can - len(completes)
    if running != want_running:
        problems.append(f"{running} running rows, expected {want_running}")
    if len(deltas[b]) != n_can or any(d.terminal_delta != 1 for d in deltas[b]):
        problems.append(f"{len(deltas[b])} terminal deltas for {n_can} cancelled rows")
    bq, bk = soak.base_marks
    ev_q = sum(e.queue_marks for e in events)
    ev_k = sum(e.kind_marks for e in events)
    want_q = bq + 2 * n_res + n_mig + n_can + ev_q
    want_k = bk + 2 * n_res + n_mig + n_can + ev_k
    if (marks[0], marks[1]) != (want_q, want_k):
        problems.append(f"dirty marks {tuple(marks)}, expected {(want_q, want_k)}")

    # errors that are allowed, and only where allowed
    for c in calls:
        if not c.outcome.startswith("error:"):
            continue
        target = seeds.get(c.job_id)
        if (
            c.outcome == "error:UniqueConflict"
            and target
            and target.category in ("shared", "sibling")
        ):
            continue
        if (
            c.outcome == "error:DatabaseError"
            and c.kind == "RetryBackoff"
            and _overflow(c.sqlstate, c.message)
            and (c.read_attempt or 0) >= BACKOFF_OVERFLOWS_FROM
        ):
            continue
        problems.append(f"unexpected {c.outcome} [{c.sqlstate}] {c.message} ({c.form} {c.job_id})")

    won_races = {c.race for c in calls if c.race is not None and c.won}
    figures = {
        "label": cfg.label,
        "duration_s": round(duration, 2),
        "calls": len(calls),
        "calls_per_s": round(len(calls) / duration, 1) if duration else None,
        "outcomes": dict(Counter(c.outcome for c in calls)),
        "rolled_back": dict(Counter(c.outcome for c in calls if not c.committed)),
        "by_form": dict(Counter(c.form for c in calls)),
        "by_kind": dict(Counter(c.kind for c in calls)),
        "late_completions": sum(1 for c in calls if c.late),
        "double_completion_races": dict(soak.races),
        "race_calls": sum(1 for c in calls if c.race is not None),
        "race_calls_won": sum(1 for c in calls if c.race is not None and c.won),
        "race_calls_lost": sum(
            1 for c in calls if c.race in won_races and c.outcome == "Stale" and c.committed
        ),
        "rescues": sum(1 for e in events if e.what == "rescue"),
        "claims": claims_n,
        "callback_completions": len(completes),
        "transitions": [
            asdict(t)
            | {
                "t_begin": round(t.t_begin - soak.t_start, 3),
                "t_commit": round(t.t_commit - soak.t_start, 3),
            }
            for t in soak.log
        ],
        "final_rows": {
            "jobs_hot_running": running,
            "jobs_hot_completed": sum(1 for r in hot.values() if r.state == "completed"),
            "scheduled_jobs": len(sched),
            f"{b}.deferred_jobs": len(deferred[b]),
            f"{b}.done_entries": len(done[b]),
            "unique_claims": len(claims),
        },
        "seeded": dict(Counter(s.category for s in soak.seeds)),
    }
    return Report(asdict(cfg), soak.transitions.kind, figures, problems)


def _routing_problems(soak: Soak, calls: list[Call], b: str) -> list[str]:
    """Each call whose routing is known must have written where that routing points."""
    problems: list[str] = []
    log = sorted(soak.log, key=lambda t: t.t_begin)
    windows: list[tuple[float, float, str | None]] = []
    prev_commit, prev_schema = float("-inf"), None
    for t in log:
        windows.append((prev_commit, t.t_begin, prev_schema))
        prev_commit, prev_schema = t.t_commit, t.schema
    windows.append((prev_commit, float("inf"), prev_schema))
    lo, hi = soak.qs_base[b], soak.qs_base[b] + QS_ID_BASE
    for c in calls:
        if c.outcome.startswith("error") or c.outcome == "Stale":
            continue
        routed: str | None
        if c.seen_epoch is not None:  # read in the call's own transaction, under its lock
            known, routed = True, c.seen_schema
        else:  # made entirely between two transitions?
            hit = [w for w in windows if w[0] <= c.t0 and c.t1 <= w[1]]
            known, routed = bool(hit), hit[0][2] if hit else None
        if not known:
            continue
        if routed is None and c.outcome != "Rescheduled":
            problems.append(f"{c.form} call on {c.job_id} routed canonical but {c.outcome}")
        if routed is not None:
            if c.outcome == "Rescheduled" and not c.callback:
                problems.append(f"{c.form} call on {c.job_id} routed {routed} but Rescheduled")
            if c.outcome in ("Migrated", "CancelledDuplicate") and (
                routed != b or c.result_id is None or not lo <= c.result_id < hi
            ):
                problems.append(
                    f"{c.form} call on {c.job_id} routed {routed}: {c.outcome} {c.result_id}"
                )
    return problems


def write_report(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str))


def format_report(report: Report) -> str:
    f = report.figures
    lines = [
        f"soak [{report.kind}] {f['duration_s']} s: {f['calls']} calls ({f['calls_per_s']}/s)",
        f"  outcomes: {f['outcomes']}",
        f"  rolled back (not committed): {f['rolled_back']}",
        f"  forms: {f['by_form']}  kinds: {f['by_kind']}",
        f"  double-completion races: {f['double_completion_races']} (calls won "
        f"{f['race_calls_won']}, lost {f['race_calls_lost']})  late completions: "
        f"{f['late_completions']}",
        f"  rescues {f['rescues']}  claims {f['claims']}  callback completions "
        f"{f['callback_completions']}",
        f"  final rows: {f['final_rows']}",
        "  transitions: "
        + "; ".join(
            f"{t['name']} -> {t['state']}/{t['schema']} (epoch {t['epoch']}, "
            f"{t['waiting_at_commit']} waiting)"
            for t in f["transitions"]
        ),
    ]
    return "\n".join(lines)
