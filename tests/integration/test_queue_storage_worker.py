"""Queue-storage endings: what awa-pg 0.6.9's runtime writes, and awa-sa beside it (issue 25.2).

Two kinds of real cluster, each built by the published ``awa migrate``:

* ``awa``: the quick-start order, migrate, start an ``auto`` worker, then insert. The first
  runtime finds ``awa.jobs`` empty and no other runtime, and auto-finalizes the cluster to queue
  storage in schema ``awa`` (``storage_auto_finalize_if_fresh``), so every job is a receipt.
* ``awa_qs``: the real CLI's transition, ``storage prepare`` (schema ``awa_qs``),
  ``prepare-queue-storage-schema``, ``enter-mixed-transition --quiesced``, ``finalize``; then an
  ``auto`` worker starts and claims from ``awa_qs``.

On each, one real runtime start serves every case, one job at a time: the test enqueues a
job, waits for its handler to hold it, and lets the handler end it. Each job's kind names its
outcome (return None, ``awa.Cancel``, raise ``awa.TerminalError``, raise a plain exception with
attempts left or on the final attempt, ``awa.RetryAfter(3600)``, ``awa.Snooze(3600)``), its queue
its claim shape (``receipt_q`` has the default 300 s deadline, so a claim writes a
``lease_claims`` receipt; ``compact_q`` has ``deadline_duration_ms=0``, so it writes a compact
``lease_claim_batches`` position) and its insert options its shape (bare, tags, metadata,
metadata of Awa's own ``_awa_original_*`` keys only, handler progress, a unique key with either
mask, all at once, and the final attempt for the re-schedules). Every shape is run on
``receipt_q``; ``compact_q`` has two cases (:data:`COMPACT_CASES`), since awa-sa refuses to
settle a compact receipt.

A side session holds the maintenance-leader lock throughout, so no promotion, rescue, ring
rotation, prune or count rollup runs; heartbeats are ten minutes apart. What is left is each
claim and each ending. Before a job is enqueued, once its handler holds it, and once it is
settled, the test captures every row of every table of the cluster's planes (``awa`` and the
queue-storage schema; only the runtimes' own liveness and claimer bookkeeping left out) and
every sequence, in one snapshot. Compared are the changes of each step, and the end.

Normalisation (:class:`Clocks`): ids, leases, slots and sequence values are compared as they
are. A clock value is named at three levels, each compared before the next: ``steps``, the step
it was written in (the test reads the database clock before and after each step) and the offset
it is known to carry (``+300s`` deadline, ``+3600s`` delay; a backoff ``run_at`` as
``finalized_at + backoff(1)``); ``claims``, also which of the claim's clocks it is (its rank in
the claim step: the claim is the runtime's on both sides, so a settle that copies a claim time
must copy the same one); ``clocks``, also, in a settle step, which columns carry the very same
value (the runtime stamps with ``clock_timestamp()``, so one ending's rows hold several
clocks, and some columns share one). An error entry's text is compared with its traceback
frames made alike.

The awa-sa side: the same cases on another fresh cluster, the handler (while it holds the
attempt) calling ``awa_sa.settle(conn, awa_sa.attempt_of(conn, job), result, progress=...)``
in a transaction of its own, then returning None, so the runtime completes an attempt that is
already settled. On ``compact_q`` the handler's settle is refused (``CompactReceipt``) with
every row of the planes as it was and its transaction still usable, and the handler then
answers as on the runtime's side, so the runtime ends the job as in its own run. Its claim
steps (which follow the runtime's completion of the case before) and its shutdown must equal
the runtime run's, and so must its settle steps. On demand (``AWA_SA_RUNTIME_TWICE=1``) the
runtime is also compared with itself on a second cluster, which proves the capture and the
normalisation deterministic at every level.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime as dt
import itertools
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import awa
import pytest
import sqlalchemy as sa
from conftest import QUIESCED_FLIP, cloned, run_awa
from jobs import RUNTIME_CLOCK, SEQUENCE_VALUES, plane_tables
from runtimes import hold_leadership, pg_url, until_idle

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes (pyproject has no `real` marker)

WAIT_SECS = 60.0

DELAY = 3600
CANCEL_REASON = "cancelled by harness"
PROGRESS = {"percent": 40, "message": "step 2", "metadata": {"cursor": 7}}
BACKOFF_FIRST = (dt.timedelta(seconds=2), dt.timedelta(seconds=60))
"""``awa.backoff_duration(1, _)``: 2 s plus up to 25 % jitter, counted from a clock read after
``finalized_at``'s, which a loaded machine delayed by more than 2 s (a bound of 4 s failed in a
run beside other jobs); no other ending of these cases schedules a job within the minute (their
delays are an hour), so the bound says nothing about the machine."""
RETRYABLE_WITHIN = dt.timedelta(seconds=60)
"""A ``retryable`` row's ``run_at`` this close to its ``finalized_at``, either side, is the first
backoff too: the runtime's retry counts the backoff from a clock of its own, which a loaded
machine can also put before ``finalized_at``'s (seen: a runtime's ``run_at`` less than 2 s after
its ``finalized_at``, inside the next case's step, in a clean-clone CI run)."""
DEADLINE = dt.timedelta(seconds=300)
"""The SDK's default queue deadline."""

OUTCOMES = ("complete", "cancel", "terminal", "retry", "final", "retry_after", "snooze")
"""Each outcome is a kind of its own: return None, Cancel, raise TerminalError, raise with
attempts left, raise on the final attempt, RetryAfter(3600), Snooze(3600)."""
QUEUES: dict[str, dict[str, Any]] = {
    "receipt": {"name": "receipt_q", "max_workers": 2},
    "compact": {"name": "compact_q", "max_workers": 2, "deadline_duration_ms": 0},
}
"""Claim shapes: a queue with the default deadline claims into ``lease_claims`` receipts; one
with ``deadline_duration_ms=0`` into compact ``lease_claim_batches``."""
MASKS = {"default": None, "all": 0b0111_1111}
"""Unique modes: the SDK's default states (``11111000``), and ``11111110`` (failed and
cancelled too). The SDK takes the states as a bitmask, bit i for the mask's i-th character."""
MASK_TEXT = {"default": "11111000", "all": "11111110"}


@dataclass(frozen=True)
class Shape:
    tags: tuple[str, ...] = ()
    metadata: dict[str, Any] | None = None
    unique: str | None = None
    progress: bool = False
    max_attempts: int | None = None


SHAPES = {
    "bare": Shape(),
    "tags": Shape(tags=("t1", "t2")),
    "metadata": Shape(metadata={"tenant": "acme"}),
    # Only Awa's own provenance keys: still "compact" metadata for the completion fast path.
    "awa_metadata": Shape(metadata={"_awa_original_priority": 3}),
    "progress": Shape(progress=True),
    "unique": Shape(unique="default"),
    "unique_all": Shape(unique="all"),
    "everything": Shape(
        tags=("t1", "t2"), metadata={"tenant": "acme"}, unique="default", progress=True
    ),
    "last": Shape(max_attempts=1),
}
FAST = {"bare", "awa_metadata", "progress"}
"""Shapes whose completion may take the runtime's fast path: no unique key, no tags, no errors,
and metadata of ``_awa_original_*`` keys only (awa-model ``receipt_fast_complete_candidate``)."""


@dataclass(frozen=True)
class Case:
    outcome: str
    claim: str
    shape: str

    @property
    def name(self) -> str:
        return f"{self.outcome}/{self.claim}/{self.shape}"

    @property
    def queue(self) -> str:
        return str(QUEUES[self.claim]["name"])

    @property
    def max_attempts(self) -> int:
        if self.outcome == "final":
            return 1
        return SHAPES[self.shape].max_attempts or 5

    def insert_options(self) -> dict[str, Any]:
        shape = SHAPES[self.shape]
        options: dict[str, Any] = {
            "kind": self.outcome,
            "queue": self.queue,
            "max_attempts": self.max_attempts,
        }
        if shape.tags:
            options["tags"] = list(shape.tags)
        if shape.metadata is not None:
            options["metadata"] = shape.metadata
        if shape.unique is not None:
            unique: dict[str, Any] = {"by_args": True}
            if MASKS[shape.unique] is not None:
                unique["states"] = MASKS[shape.unique]
            options["unique_opts"] = unique
        return options


COMPACT_CASES = [Case("complete", "compact", "bare"), Case("snooze", "compact", "everything")]
"""The compact receipt's cases: awa-sa refuses both (a completion that would take the fast path,
and a re-schedule of a job with every option), then the runtime ends them."""


def full_matrix() -> list[Case]:
    """Every outcome x job shape on ``receipt_q``; ``last`` (max_attempts 1) for the
    re-schedules; and the compact cases."""
    return [
        Case(outcome, "receipt", shape)
        for outcome in OUTCOMES
        for shape in SHAPES
        if shape != "last" or outcome in ("retry_after", "snooze")
    ] + COMPACT_CASES


def sampled_matrix() -> list[Case]:
    """Each outcome with ``bare`` and one other shape, rotating so that every shape is met,
    plus the fast-path boundary (``complete`` with every shape), and the compact cases."""
    others = [s for s in SHAPES if s not in ("bare", "last")]
    cases = list(COMPACT_CASES)
    for i, outcome in enumerate(OUTCOMES):
        cases.append(Case(outcome, "receipt", "bare"))
        cases.append(Case(outcome, "receipt", others[i % len(others)]))
    cases += [Case("complete", "receipt", s) for s in others]
    return sorted(set(cases), key=lambda c: (OUTCOMES.index(c.outcome), c.claim, c.shape))


MATRIX = {"awa": full_matrix(), "awa_qs": sampled_matrix()}


# ------------------------------------------------------------------------------------------
# What a handler answers


class HarnessRetryableError(Exception):
    """A plain exception: the runtime retries it, or fails the job on its last attempt."""


def answer(outcome: str) -> Any:
    """The handler's own ending, as awa-pg's SDK reads it: one function for both sides, so that
    the tracebacks of both sides' exceptions end in the same frame."""
    if outcome == "cancel":
        return awa.Cancel(CANCEL_REASON)
    if outcome == "terminal":
        raise awa.TerminalError("terminal (harness)")
    if outcome in ("retry", "final"):
        raise HarnessRetryableError("transient failure (harness)")
    if outcome == "retry_after":
        return awa.RetryAfter(DELAY)
    if outcome == "snooze":
        return awa.Snooze(DELAY)
    return None


AWA_SA_RESULTS: dict[str, awa_sa.Result] = {
    "complete": awa_sa.Complete(),
    "cancel": awa_sa.Cancel(CANCEL_REASON),
    "retry_after": awa_sa.RetryAfter(DELAY),
    "snooze": awa_sa.Snooze(DELAY),
}


def copy_of(job: Any) -> SimpleNamespace:
    """The attributes ``attempt_of`` reads, copied out of a runtime's ``Job`` in its loop."""
    return SimpleNamespace(
        id=job.id, attempt=job.attempt, kind=job.kind, queue=job.queue, created_at=job.created_at
    )


@dataclass(frozen=True)
class Refusal:
    """What a handler on ``compact_q`` met: awa-sa's error, whether every row of the planes
    read the same after as before, and whether its transaction went on."""

    error: BaseException | None
    unchanged: bool
    usable: bool


def refused(
    engine: sa.Engine, take: Capturer, job: SimpleNamespace, result: awa_sa.Result
) -> Refusal:
    """A handler's settle of a compact receipt, in its own transaction: refused before any
    statement, so the rows read back are those read before, and the transaction goes on."""

    def rows() -> Capture:  # a claimer's poll may move a sequence, never a row
        return {name: texts for name, texts in take().items() if name != "sequences"}

    before = rows()
    error: BaseException | None = None
    with engine.begin() as conn:
        attempt = awa_sa.attempt_of(conn, job)
        try:
            awa_sa.settle(conn, attempt, result)
        except awa_sa.AwaSAError as exc:
            error = exc
        usable = conn.execute(sa.text("SELECT count(*) FROM awa.jobs_hot")).scalar_one() == 0
    return Refusal(error, rows() == before, usable)


def settle_in_own_transaction(
    engine: sa.Engine, job: SimpleNamespace, result: awa_sa.Result, progress: Any
) -> awa_sa.Ending:
    """What a handler beside the runtime does: find its attempt and settle it, one transaction."""
    with engine.begin() as conn:
        attempt = awa_sa.attempt_of(conn, job)
        return awa_sa.settle(conn, attempt, result, progress=progress)


# ------------------------------------------------------------------------------------------
# Capture


Capture = dict[str, tuple[str, ...]]
"""Per table, its rows as ``to_jsonb`` text, sorted; ``sequences``: ``[name, last_value]``."""


class Capturer:
    """Captures of one cluster, each row's text held once however many captures show it.

    Every capture is a transaction of its own on one connection held for the run, where its
    read is a prepared statement: the read names some 400 relations (partitions included),
    and planning it cost the server some 20 ms a capture, most of this module's CPU (issue 39).
    PostgreSQL plans it again whenever a relation it reads has changed its definition.
    """

    def __init__(self, engine: sa.Engine, schemas: list[str]) -> None:
        self.engine = engine
        self.schemas = schemas
        self.pool: dict[str, str] = {}
        self.reads: dict[tuple[str, ...], str] = {}
        """Each list of tables' statement, by the name it is prepared under."""
        self.conn: sa.Connection | None = None
        self.lock = threading.Lock()  # a handler's thread captures too (:func:`refused`)

    def _read(self, conn: sa.Connection, tables: tuple[str, ...]) -> str:
        """One statement for every table, prepared on the held connection: a capture is taken
        many times a case, and a statement per table made it a hundred round trips."""
        if tables not in self.reads:
            legs = [
                f"SELECT '{table}', ARRAY(SELECT to_jsonb(t)::text FROM {table} AS t ORDER BY 1)"
                for table in tables
            ]
            name = f"qsw_capture_{len(self.reads)}"
            conn.exec_driver_sql(f"PREPARE {name} AS {' UNION ALL '.join(legs)}")
            self.reads[tables] = name
        return f"EXECUTE {self.reads[tables]}"

    def __call__(self) -> Capture:
        """Every row of every table of the planes, and every sequence, in one snapshot."""
        pool = self.pool
        with self.lock:
            if self.conn is None:
                self.conn = self.engine.connect()
            conn = self.conn
            try:
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                binds = {"schemas": self.schemas}
                tables = tuple(plane_tables(conn, self.schemas, RUNTIME_CLOCK))
                out: Capture = {
                    name: tuple(pool.setdefault(t, t) for t in texts)
                    for name, texts in conn.exec_driver_sql(self._read(conn, tables)).all()
                }
                sequences = conn.execute(sa.text(SEQUENCE_VALUES), binds).all()
            finally:
                conn.rollback()
        out["sequences"] = tuple(json.dumps([name, value]) for name, value in sequences)
        return out

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def rows_of(cap: Capture, table: str) -> list[dict[str, Any]]:
    return [json.loads(text) for text in cap[table]]


def db_clock(engine: sa.Engine) -> dt.datetime:
    with engine.connect() as conn:
        stamp: dt.datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        return stamp


# ------------------------------------------------------------------------------------------
# Normalisation

STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)\Z")
FRAME = re.compile(r'  File "[^"]*", line \d+, in \S+\n    [^\n]*\n(    [ ~^]*[~^][ ~^]*\n)?')


def parse_stamp(text: str) -> dt.datetime:
    """RFC 3339 as PostgreSQL's JSON and the worker's error entries write it (ns truncated)."""
    match = re.match(r"(.*?)(\.\d+)?(Z|[+-]\d\d:\d\d)\Z", text)
    assert match, text
    head, frac, zone = match.groups()
    frac = (frac or ".0")[:7].ljust(7, "0")
    return dt.datetime.fromisoformat(f"{head}{frac}{'+00:00' if zone == 'Z' else zone}")


def traceback_shape(text: str) -> str:
    """An error text with each traceback frame (file, line, function, source) made alike."""
    return FRAME.sub("  File <frame>\n", text + "\n").removesuffix("\n")


@dataclass
class Window:
    """A step of the run, between two readings of the database clock."""

    name: str
    start: dt.datetime
    end: dt.datetime


Level = Literal["steps", "claims", "clocks"]
"""How finely clocks are named: by step; and which of the claim's clocks (its rank in the
claim step); and, in a settle step, which columns share one clock (see :class:`Clocks`)."""

OFFSETS = (
    (dt.timedelta(0), ""),
    (DEADLINE, "+300s"),
    (dt.timedelta(seconds=DELAY), f"+{DELAY}s"),
)


class Clocks:
    """Names every clock value of a run by the step that wrote it (see the module docstring).

    The fine names: within a claim step (the runtime's, on both sides) a value's rank among the
    step's distinct values; within a settle step the columns that carry the same value
    (``lease_claim_closures.closed_at=lease_claims.closed_at``), so that one clock written to
    two columns is told from two clocks, whichever was read first.
    """

    def __init__(self, windows: list[Window], rows: set[tuple[str, str]]) -> None:
        self.windows = windows
        self.starts = [w.start for w in windows]
        assert self.starts == sorted(self.starts)
        bases: dict[str, set[dt.datetime]] = {}
        where: dict[tuple[str, dt.datetime], set[str]] = {}
        for table, text in rows:
            row = json.loads(text)
            if backoff(row):  # a retry's run_at is named by its relation, and ranks nothing
                row = {k: v for k, v in row.items() if k != "run_at"}
            for path, stamp in stamps_in(row, table.rsplit(".", 1)[-1]):
                placed = self._place(stamp)
                if placed is not None:
                    window, base, suffix = placed
                    bases.setdefault(window.name, set()).add(base)
                    at = f"{path}-{suffix[1:]}" if suffix else path  # run_at-3600s: the clock
                    where.setdefault((window.name, base), set()).add(at)
        self.fine = {
            (name, value): f"#{i}"
            if name.startswith("claim")
            else "=" + "=".join(sorted(where[(name, value)]))
            for name, values in bases.items()
            for i, value in enumerate(sorted(values))
        }

    def _window(self, stamp: dt.datetime) -> Window | None:
        i = bisect.bisect_right(self.starts, stamp) - 1
        if i >= 0 and stamp <= self.windows[i].end:
            return self.windows[i]
        return None

    def _place(self, stamp: dt.datetime) -> tuple[Window, dt.datetime, str] | None:
        for offset, suffix in OFFSETS:
            window = self._window(stamp - offset)
            if window is not None:
                return window, stamp - offset, suffix
        return None

    def name(self, stamp: dt.datetime, level: Level) -> str:
        placed = self._place(stamp)
        if placed is None:
            i = bisect.bisect_right(self.starts, stamp) - 1
            return f"after {self.windows[i].name}" if i >= 0 else "before the run"
        window, base, suffix = placed
        detail = self.fine[(window.name, base)]
        if level == "steps" or (level == "claims" and not window.name.startswith("claim")):
            detail = ""
        return f"{window.name}{detail}{suffix}"


def stamps_in(value: Any, path: str) -> Iterator[tuple[str, dt.datetime]]:
    """Every clock value in *value*, with where it is (``table.column.key``, ``[]`` a list)."""
    if isinstance(value, str):
        if STAMP.match(value):
            yield path, parse_stamp(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from stamps_in(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            yield from stamps_in(item, f"{path}[]")


def normal_value(value: Any, clocks: Clocks, level: Level) -> Any:
    if isinstance(value, str):
        if STAMP.match(value):
            return clocks.name(parse_stamp(value), level)
        if "Traceback (most recent call last)" in value or "frames truncated" in value:
            return traceback_shape(value)
        return value
    if isinstance(value, dict):
        return {k: normal_value(v, clocks, level) for k, v in value.items()}
    if isinstance(value, list):
        return [normal_value(v, clocks, level) for v in value]
    return value


def backoff(row: Any) -> bool:
    """Whether *row* is re-scheduled by Awa's first backoff: ``run_at`` some seconds after
    ``finalized_at`` (BACKOFF_FIRST), in any later step, so it is named by that relation."""
    if not (isinstance(row, dict) and row.get("run_at") and row.get("finalized_at")):
        return False
    delay = parse_stamp(row["run_at"]) - parse_stamp(row["finalized_at"])
    if row.get("state") == "retryable":
        return abs(delay) <= RETRYABLE_WITHIN
    return BACKOFF_FIRST[0] <= delay <= BACKOFF_FIRST[1]


def normal_row(text: str, clocks: Clocks, level: Level) -> str:
    """One row as canonical JSON text: clocks named, a backoff ``run_at`` as its relation."""
    row = json.loads(text)
    if not backoff(row):
        return json.dumps(normal_value(row, clocks, level), sort_keys=True)
    out = normal_value({k: v for k, v in row.items() if k != "run_at"}, clocks, level)
    out["run_at"] = "finalized_at + backoff(1)"
    return json.dumps(out, sort_keys=True)


Normal = dict[str, Counter[str]]

Delta = dict[str, tuple[list[str], list[str]]]
"""Per table: rows removed, rows added (an UPDATE is one of each)."""


def delta(before: Normal, after: Normal) -> Delta:
    out: Delta = {}
    for table in sorted(before.keys() | after.keys()):
        old, new = before.get(table, Counter()), after.get(table, Counter())
        if old != new:
            out[table] = (sorted((old - new).elements()), sorted((new - old).elements()))
    return out


# ------------------------------------------------------------------------------------------
# A run: one cluster, one runtime start, every case one at a time


@dataclass
class Held:
    """The job being run: its handler's progress through the step."""

    holding: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    job: SimpleNamespace | None = None
    outcome: awa_sa.Ending | None = None
    error: BaseException | None = None
    refusal: Refusal | None = None


@dataclass
class Run:
    schema: str
    cases: list[Case]
    steps: list[tuple[str, Capture]]
    """``start`` (once the runtime is up), then per case ``claim <case>`` (its handler holds
    it) and ``settle <case>``, then ``shutdown``."""
    windows: list[Window]
    storage: dict[str, Any]
    """``awa.storage_transition_state`` once the runtime has started."""
    runs: Counter[str]
    """How many times each case's handler ran."""
    jobs: dict[str, SimpleNamespace]
    outcomes: dict[str, awa_sa.Ending]
    """awa-sa's answer for each case (the awa-sa side only)."""
    healthy: bool
    refusals: dict[str, Refusal] = field(default_factory=dict)
    """The awa-sa side: what each compact case's settle met (:func:`refused`)."""
    sealed: set[int] = field(default_factory=set)
    """The awa-sa side: jobs whose fast-path receipt awa-sa sealed (:func:`unsealed`)."""

    _normal: dict[str, list[tuple[str, Normal]]] = field(default_factory=dict)
    _deltas: dict[str, list[tuple[str, Delta]]] = field(default_factory=dict)

    def normal(self, level: Level) -> list[tuple[str, Normal]]:
        """Each step's capture, normalised (each distinct row once)."""
        if level not in self._normal:
            located = {
                (t, text) for _, cap in self.steps for t, rows in cap.items() for text in rows
            }
            clocks = Clocks(self.windows, located)
            texts = {text for _, text in located}
            memo = {text: normal_row(text, clocks, level) for text in texts}
            self._normal[level] = [
                (name, {table: Counter(memo[t] for t in rows) for table, rows in cap.items()})
                for name, cap in self.steps
            ]
        return self._normal[level]

    def deltas(self, level: Level) -> list[tuple[str, Delta]]:
        """Each step's changes at *level*, worked out once: every comparison of the run reads
        them again, and working them out afresh was most of the comparisons' CPU."""
        if level not in self._deltas:
            normal = self.normal(level)
            self._deltas[level] = [
                (name, delta(prev, cur)) for (_, prev), (name, cur) in itertools.pairwise(normal)
            ]
        return self._deltas[level]

    @property
    def final(self) -> Capture:
        return self.steps[-1][1]

    def rows(self, table: str) -> list[dict[str, Any]]:
        """*table*'s rows at the end of the run."""
        return rows_of(self.final, table)


def storage_state(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT state, current_engine, details, awa.active_queue_storage_schema() AS qs"
                " FROM awa.storage_transition_state"
            )
        ).one()
        return dict(row._mapping)


def settled_capture(take: Capturer, claimed: Capture | None) -> Capture:
    """The capture once its rows differ from *claimed* (when given: the runtime has written its
    ending, in one transaction) and two reads 30 ms apart agree (it has written all of it).

    Rows, not sequences: the runtime's claimers poll every 20 ms and a poll can move a sequence
    without writing a row. A capture that differed from the claim's by such a tick alone, and
    then read the same twice, closed the step before the runtime's ending, when the machine was
    loaded and its ending came later: the whole ending then showed in the next case's claim step
    (issue 39, seen on ``terminal/compact/*`` and ``cancel/compact/*``)."""
    deadline = time.monotonic() + WAIT_SECS
    last: Capture | None = None

    def rows(cap: Capture) -> Capture:
        return {name: texts for name, texts in cap.items() if name != "sequences"}

    while time.monotonic() < deadline:
        cap = take()
        if cap == last and (claimed is None or rows(cap) != rows(claimed)):
            return cap
        last = cap
        time.sleep(0.03)
    raise AssertionError("the attempt was not settled, or its rows kept changing, for 60 s")


def drive(url: str, engine: sa.Engine, schema: str, cases: list[Case], by_awa_sa: bool) -> Run:
    """Start one real runtime and run *cases* through it one by one (see the module docstring).

    By the runtime: the handler answers as the SDK reads it. By awa-sa: the handler settles its
    attempt through awa-sa and returns None. The first exception awa-sa raises ends the run and
    is raised here, after the runtime is shut down.
    """
    take = Capturer(engine, sorted({"awa", schema}))
    by_name = {case.name: case for case in cases}
    runs: Counter[str] = Counter()
    jobs: dict[str, SimpleNamespace] = {}
    outcomes: dict[str, awa_sa.Ending] = {}
    refusals: dict[str, Refusal] = {}
    steps: list[tuple[str, Capture]] = []
    windows: list[Window] = []
    current = Held()

    async def handle(job: Any) -> Any:
        case = by_name[job.args["case"]]
        held = current
        runs[case.name] += 1
        jobs[case.name] = held.job = copy_of(job)
        if SHAPES[case.shape].progress:
            job.set_progress(PROGRESS["percent"], PROGRESS["message"])
            job.update_metadata(PROGRESS["metadata"])
        held.holding.set()
        await held.go.wait()
        if by_awa_sa and case.claim == "compact":
            asked = AWA_SA_RESULTS[case.outcome]
            held.refusal = await asyncio.to_thread(refused, engine, take, held.job, asked)
        if not by_awa_sa or case.claim == "compact":
            reply = answer(case.outcome)
            return reply
        result: awa_sa.Result
        try:
            reply = answer(case.outcome)
            result = AWA_SA_RESULTS[case.outcome]
        except awa.TerminalError as exc:
            result = awa_sa.Fail.of(exc, terminal=True)
        except HarnessRetryableError as exc:
            result = awa_sa.Fail.of(exc)
        progress = PROGRESS if SHAPES[case.shape].progress else None
        try:
            held.outcome = await asyncio.to_thread(
                settle_in_own_transaction, engine, held.job, result, progress
            )
        except Exception as exc:  # reported by the test, once the runtime has stopped
            held.error = exc
        held.settled.set()
        await held.release.wait()
        return None

    async def run() -> Run:
        nonlocal current
        leader = await asyncio.to_thread(hold_leadership, engine)
        client = awa.AsyncClient(pg_url(url))
        for outcome in OUTCOMES:
            client.task(dict, kind=outcome, queue=QUEUES["receipt"]["name"])(handle)
        error: BaseException | None = None
        try:
            # The quick-start order: the runtime starts, then the jobs are enqueued.
            await client.start(
                list(QUEUES.values()),
                poll_interval_ms=20,
                heartbeat_interval_ms=600_000,
                queue_storage_schema=None if schema == "awa" else schema,
            )
            storage = await asyncio.to_thread(storage_state, engine)
            steps.append(("start", await asyncio.to_thread(take)))
            for case in cases:
                current = Held()
                began = await asyncio.to_thread(db_clock, engine)
                await client.insert({"case": case.name}, **case.insert_options())
                await asyncio.wait_for(current.holding.wait(), WAIT_SECS)
                steps.append((f"claim {case.name}", await asyncio.to_thread(take)))
                claimed = await asyncio.to_thread(db_clock, engine)
                windows.append(Window(f"claim {case.name}", began, claimed))
                current.go.set()
                settles = by_awa_sa and case.claim != "compact"
                if settles:
                    await asyncio.wait_for(current.settled.wait(), WAIT_SECS)
                    if current.error is not None:
                        error = current.error
                        break
                    assert current.outcome is not None
                    outcomes[case.name] = current.outcome
                else:
                    await until_idle(client, WAIT_SECS)
                    if current.refusal is not None:
                        refusals[case.name] = current.refusal
                claimed_rows = None if settles else steps[-1][1]
                steps.append(
                    (
                        f"settle {case.name}",
                        await asyncio.to_thread(settled_capture, take, claimed_rows),
                    )
                )
                windows.append(
                    Window(
                        f"settle {case.name}", claimed, await asyncio.to_thread(db_clock, engine)
                    )
                )
                current.release.set()
                await until_idle(client, WAIT_SECS)
            healthy = (await client.health_check()).healthy
        finally:
            current.go.set()
            current.release.set()
            await client.shutdown()  # drains in-flight completions
            await client.close()
            leader.close()
        if error is not None:
            raise error
        steps.append(("shutdown", await asyncio.to_thread(take)))
        return Run(schema, cases, steps, windows, storage, runs, jobs, outcomes, healthy, refusals)

    try:
        return asyncio.run(run())
    finally:
        take.close()


# ------------------------------------------------------------------------------------------
# Clusters


class Lab:
    """Fresh real clusters on the session's server, and the runtime's runs on them, cached.

    Each cluster is a clone of the session's ``awa migrate`` template (which the real CLI's
    ``prepare-queue-storage-schema`` has also given schema ``awa_qs``): a template of the
    module's own cost a second ``awa migrate``, some 2.4 CPU-s (issue 39). On ``awa`` the
    prepared ``awa_qs`` is left unused: the first runtime's auto-finalize asks only that
    ``awa.jobs`` be empty and no runtime be live, and the captures read ``awa`` alone.
    """

    def __init__(self, pg: EmbeddedPostgres, databases: Databases, template: str) -> None:
        self.pg = pg
        self.databases = databases
        self.template = template
        self.made = ExitStack()
        self.runs: dict[tuple[str, str], Run] = {}

    def cluster(self, schema: str) -> str:
        """A fresh ``awa migrate`` cluster; for ``awa_qs`` transitioned there by the real CLI."""
        url = self.made.enter_context(cloned(self.pg, self.databases, self.template))
        name = sa.make_url(url).database or ""
        if schema != "awa":
            assert schema == "awa_qs", "the template prepared awa_qs alone"
            details = json.dumps({"schema": schema})
            run_awa(
                self.pg,
                name,
                "storage",
                "prepare",
                "--engine",
                "queue_storage",
                "--details",
                details,
            )
            run_awa(self.pg, name, *QUIESCED_FLIP)
            run_awa(self.pg, name, "storage", "finalize")
        return url

    def run(self, schema: str, side: str) -> Run:
        """The run of ``MATRIX[schema]`` by *side* (``runtime``, ``runtime again``, ``awa-sa``)."""
        key = (schema, side)
        if key not in self.runs:
            url = self.cluster(schema)
            engine = sa.create_engine(url, pool_size=4)
            try:
                run = drive(url, engine, schema, MATRIX[schema], side == "awa-sa")
                self.runs[key] = unsealed(run) if side == "awa-sa" else run
            finally:
                engine.dispose()
        return self.runs[key]

    def close(self) -> None:
        self.made.close()


def unsealed(run: Run) -> Run:
    """*run* with awa-sa's one deliberate difference taken out, once proven exact.

    A fast-path completion of a ``lease_claims`` receipt: the runtime leaves ``closed_at`` NULL,
    awa-sa seals it with the very clock of the receipt's closure batch (docs/contract.md,
    "Sealed receipts"). Each such row is set back to NULL in every capture, and the jobs whose
    receipts were sealed are kept in ``run.sealed``, so the comparisons stay exact about the rest.
    """
    s = run.schema
    steps = []
    for name, cap in run.steps:
        closures = {
            (r["claim_slot"], r["job_id"], r["run_lease"])
            for r in rows_of(cap, f"{s}.lease_claim_closures")
        }
        batches = rows_of(cap, f"{s}.lease_claim_closure_batches")
        texts = []
        for text in cap[f"{s}.lease_claims"]:
            row = json.loads(text)
            key = (row["claim_slot"], row["job_id"], row["run_lease"])
            if row["closed_at"] is not None and key not in closures:
                slot, receipt = row["claim_slot"], row["receipt_id"]
                [batch] = [
                    b for b in batches if b["claim_slot"] == slot and receipt in b["receipt_ids"]
                ]
                assert (batch["outcome"], batch["closed_at"]) == ("completed", row["closed_at"])
                run.sealed.add(row["job_id"])
                texts.append(json.dumps({**row, "closed_at": None}))
            else:
                texts.append(text)
        steps.append((name, {**cap, f"{s}.lease_claims": tuple(texts)}))
    run.steps = steps
    return run


@pytest.fixture(scope="module")
def lab(pg: EmbeddedPostgres, awa_databases: Databases, real_template: str) -> Iterator[Lab]:
    lab = Lab(pg, awa_databases, real_template)
    try:
        yield lab
    finally:
        lab.close()


SCHEMAS = ("awa", "awa_qs")


# ------------------------------------------------------------------------------------------
# Comparison


def differences(
    left: Run, right: Run, level: Level, names: tuple[str, str], steps: str = ""
) -> list[str]:
    """The rows only one side wrote, step by step (those whose name starts with *steps*)."""
    out = []
    for (step, a), (step_b, b) in zip(left.deltas(level), right.deltas(level), strict=True):
        assert step == step_b
        if not step.startswith(steps):
            continue
        for table in sorted(a.keys() | b.keys()):
            if a.get(table) == b.get(table):
                continue
            (a_gone, a_new), (b_gone, b_new) = a.get(table, ([], [])), b.get(table, ([], []))
            for label, rows in (
                (f"{names[0]} removed", Counter(a_gone) - Counter(b_gone)),
                (f"{names[1]} removed", Counter(b_gone) - Counter(a_gone)),
                (f"{names[0]} added", Counter(a_new) - Counter(b_new)),
                (f"{names[1]} added", Counter(b_new) - Counter(a_new)),
            ):
                out += [f"{step} | {table} | {label}: {row}" for row in rows.elements()]
    return out


def assert_same(
    left: Run, right: Run, names: tuple[str, str], level: Level, steps: str = ""
) -> None:
    """Every step's changes (and the end state) alike at *level*, coarser levels first."""
    assert [s for s, _ in left.steps] == [s for s, _ in right.steps]
    for at in LEVELS[: LEVELS.index(level) + 1]:
        found = differences(left, right, at, names, steps)
        assert not found, f"rows differ, clocks named by {at}:\n" + "\n".join(found)
    if not steps:
        assert left.normal(level)[-1][1] == right.normal(level)[-1][1]


LEVELS: tuple[Level, ...] = ("steps", "claims", "clocks")


# ------------------------------------------------------------------------------------------
# What the runtime wrote, per case, read from the rows


def ending_of(run: Run, case: Case) -> dict[str, Any]:
    """One case's ending, summarised from the run's rows: where the closure is, what holds the
    terminal or re-scheduled row, and what the settle step changed."""
    job_id = run.jobs[case.name].id
    s = run.schema

    def rows(table: str, **match: Any) -> list[dict[str, Any]]:
        return [r for r in run.rows(table) if all(r.get(k) == v for k, v in match.items())]

    def holding(table: str, column: str, value: Any) -> list[dict[str, Any]]:
        return [r for r in run.rows(table) if value in r[column]]

    receipt = rows(f"{s}.lease_claims", job_id=job_id)
    batch = holding(f"{s}.lease_claim_batches", "job_ids", job_id)
    receipt_id = receipt[0]["receipt_id"] if receipt else batch[0]["receipt_ids"][0]
    closures = [r["outcome"] for r in rows(f"{s}.lease_claim_closures", job_id=job_id)]
    closure_batches = [
        r["outcome"] for r in holding(f"{s}.lease_claim_closure_batches", "receipt_ids", receipt_id)
    ]
    completions = holding(f"{s}.receipt_completion_batches", "job_ids", job_id)
    done = rows(f"{s}.done_entries", job_id=job_id)
    deferred = rows(f"{s}.deferred_jobs", job_id=job_id)
    landed = done[0] if done else deferred[0] if deferred else None
    payload = (landed or {}).get("payload") or {}
    errors = payload.get("errors", [])
    step = dict(run.deltas("steps"))[f"settle {case.name}"]
    claim_key = rows(f"{s}.ready_entries", job_id=job_id)[0]["unique_key"]
    claims = rows("awa.job_unique_claims", job_id=job_id)
    return {
        "claim": "receipt" if receipt else "compact",
        "closed_at set": bool(receipt and receipt[0]["closed_at"]),
        "closure": closures[0] if closures else None,
        "closure batch": closure_batches[0] if closure_batches else None,
        "completion batch": len(completions),
        "done": done[0]["state"] if done else None,
        "deferred": (deferred[0]["state"], deferred[0]["attempt"], deferred[0]["run_lease"])
        if deferred
        else None,
        "terminal delta": f"{s}.queue_terminal_count_deltas" in step,
        "payload keys": sorted(payload) if landed else None,
        "error terminal": [e.get("terminal", "absent") for e in errors],
        "unique claim": None if claim_key is None else ("kept" if claims else "released"),
        "tables": sorted(t for t in step if t != "sequences"),
    }


STATES = {
    "complete": "completed",
    "cancel": "cancelled",
    "terminal": "failed",
    "final": "failed",
    "retry": "retryable",
    "retry_after": "retryable",
    "snooze": "scheduled",
}
RESCHEDULES = ("retry", "retry_after", "snooze")


def expected_ending(case: Case, schema: str) -> dict[str, Any]:
    """What awa-pg 0.6.9 was observed to write for *case* (the facts table of issue 25).

    * The claim shape decides where the closure goes: a ``lease_claims`` receipt gets a
      ``lease_claim_closures`` row and ``closed_at``; a compact receipt gets a
      ``lease_claim_closure_batches`` row, whatever the outcome.
    * A completion of a job with no unique key, no tags and metadata of ``_awa_original_*``
      keys only (handler progress does not matter) takes the fast path, on either claim shape:
      ``receipt_completion_batches`` plus a ``completed`` closure batch; no ``done_entries`` row,
      no terminal count delta, ``closed_at`` left NULL.
    * Any other ending writes ``done_entries`` plus a terminal count delta, and a re-schedule
      ``deferred_jobs`` under the same id and lease (Snooze: attempt 0) and no delta.
    * The payload keeps tags, metadata, handler progress (not on completion) and errors; the
      exhausted retry's error entry says ``"terminal": true``, as TerminalError's does.
    * A unique claim is kept by completion and every re-schedule, released by the other
      endings unless the mask holds failed and cancelled (``11111110``).
    """
    shape = SHAPES[case.shape]
    receipt = case.claim == "receipt"
    fast = case.outcome == "complete" and case.shape in FAST
    state = STATES[case.outcome]
    rescheduled = case.outcome in RESCHEDULES
    payload = set()
    if shape.tags:
        payload.add("tags")
    if shape.metadata is not None:
        payload.add("metadata")
    if case.outcome in ("cancel", "terminal", "final", "retry"):
        payload.add("errors")
    if shape.progress and case.outcome != "complete":
        payload.add("progress")
    kept = case.outcome == "complete" or rescheduled or shape.unique == "all"
    tables = set()
    if fast:
        tables |= {"lease_claim_closure_batches", "receipt_completion_batches"}
    else:
        tables |= (
            {"lease_claim_closures", "lease_claims"} if receipt else {"lease_claim_closure_batches"}
        )
        tables |= (
            {"deferred_jobs"} if rescheduled else {"done_entries", "queue_terminal_count_deltas"}
        )
    written = {f"{schema}.{table}" for table in tables}
    if shape.unique is not None and not kept:
        written.add("awa.job_unique_claims")
    return {
        "claim": case.claim,
        "closed_at set": receipt and not fast,
        "closure": state if receipt and not fast else None,
        "closure batch": "completed" if fast else None if receipt else state,
        "completion batch": 1 if fast else 0,
        "done": None if rescheduled or fast else state,
        "deferred": (state, 0 if case.outcome == "snooze" else 1, 1) if rescheduled else None,
        "terminal delta": not rescheduled and not fast,
        "payload keys": None if fast else sorted(payload),
        "error terminal": {
            "cancel": ["absent"],
            "terminal": [True],
            "final": [True],
            "retry": ["absent"],
        }.get(case.outcome, []),
        "unique claim": None if shape.unique is None else "kept" if kept else "released",
        "tables": sorted(written),
    }


# ------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_runtime_writes_each_ending_as_observed(lab: Lab, schema: str) -> None:
    """The runtime's rows per case match the facts table (issue 25; differences noted there)."""
    run = lab.run(schema, "runtime")
    assert run.storage["state"] == "active"
    assert run.storage["current_engine"] == "queue_storage"
    assert run.storage["qs"] == schema
    if schema == "awa":
        assert run.storage["details"] == {"schema": "awa", "auto_finalized": True}
    assert run.healthy
    got = {case.name: ending_of(run, case) for case in run.cases}
    want = {case.name: expected_ending(case, schema) for case in run.cases}
    wrong = {name: (got[name], want[name]) for name in got if got[name] != want[name]}
    assert not wrong, json.dumps(wrong, indent=1, default=str)
    # The fast path's boundary is crossed in this run, both ways.
    assert {c.name for c in run.cases if got[c.name]["completion batch"]} == {
        c.name for c in run.cases if c.outcome == "complete" and c.shape in FAST
    }
    # Nothing canonical moved: no job, claim or dirty mark outside the queue-storage plane.
    for table in ("awa.jobs_hot", "awa.scheduled_jobs", "awa.admin_dirty_queue_marks"):
        assert run.final[table] == (), table


@pytest.mark.skipif(
    not os.environ.get("AWA_SA_RUNTIME_TWICE"),
    reason="the harness's own check, on demand (AWA_SA_RUNTIME_TWICE=1)",
)
@pytest.mark.parametrize("schema", ["awa_qs"])
def test_the_runtime_writes_the_same_rows_twice(lab: Lab, schema: str) -> None:
    """Two runs of the runtime on two fresh clusters compare equal at every level: the capture
    and the normalisation leave nothing to timing, so a difference against awa-sa is awa-sa's.
    On the sampled cluster only (every value of every dimension). Not in the suite: the awa-sa
    runs compare their claim and shutdown steps, the runtime's own rows, with the runtime run's
    at every level already, so a capture that timing could change fails there too; this tells
    the harness's fault from awa-sa's when one does."""
    first, again = lab.run(schema, "runtime"), lab.run(schema, "runtime again")
    assert_same(first, again, ("run 1", "run 2"), "clocks")
    assert first.runs == again.runs == Counter({case.name: 1 for case in first.cases})


@pytest.mark.parametrize("schema", SCHEMAS)
def test_awa_sa_beside_the_runtime_leaves_each_attempt_settled(lab: Lab, schema: str) -> None:
    """A handler settles its own attempt through awa-sa, in its own transaction, and returns:
    the runtime's completion of the attempt afterwards changes nothing. Every claim step (which
    holds whatever the runtime wrote after the previous case) and the shutdown are the same as
    in the runtime's own run, every handler ran once, and the runtime stayed healthy. A compact
    receipt's settle was refused with ``CompactReceipt``, every row as it was and the handler's
    transaction usable; the runtime then ended the job as in its own run (the settle steps
    compare it)."""
    runtime, kit = lab.run(schema, "runtime"), lab.run(schema, "awa-sa")
    assert kit.runs == Counter({case.name: 1 for case in kit.cases})
    assert kit.healthy
    # Every fast-path completion of a lease_claims receipt, and no other, sealed its receipt.
    assert kit.sealed == {
        kit.jobs[c.name].id
        for c in kit.cases
        if c.outcome == "complete" and c.shape in FAST and c.claim == "receipt"
    }
    for steps in ("claim", "shutdown"):
        assert_same(runtime, kit, ("runtime", "awa-sa"), "clocks", steps)
    for case in kit.cases:
        job = kit.jobs[case.name]
        if case.claim == "compact":
            refusal = kit.refusals[case.name]
            assert isinstance(refusal.error, awa_sa.CompactReceipt), (case.name, refusal)
            assert (refusal.error.job_id, refusal.error.queue) == (job.id, case.queue)
            assert refusal.unchanged, (case.name, refusal)
            assert refusal.usable, (case.name, refusal)
            continue
        outcome = kit.outcomes[case.name]
        if case.outcome in RESCHEDULES:
            [row] = [r for r in kit.rows(f"{schema}.deferred_jobs") if r["job_id"] == job.id]
            want: awa_sa.Ending = awa_sa.Rescheduled(
                job.id, parse_stamp(row["run_at"]), row["attempt"]
            )
        else:
            endings: dict[str, awa_sa.Ending] = {
                "complete": awa_sa.Completed(job.id),
                "cancel": awa_sa.Cancelled(job.id),
                "terminal": awa_sa.Failed(job.id, terminal=True),
                # awa-sa answers terminal=False for an exhausted retry; the row's error entry
                # says "terminal": true, as the runtime's does (compared below).
                "final": awa_sa.Failed(job.id, terminal=False),
            }
            want = endings[case.outcome]
        assert outcome == want, case.name


@pytest.mark.parametrize("schema", SCHEMAS)
def test_awa_sa_settles_into_the_runtimes_rows(lab: Lab, schema: str) -> None:
    """Each settle step's rows, clocks named by step and by which claim clock they copy."""
    runtime, kit = lab.run(schema, "runtime"), lab.run(schema, "awa-sa")
    assert_same(runtime, kit, ("runtime", "awa-sa"), "claims")


@pytest.mark.parametrize("schema", SCHEMAS)
def test_awa_sa_settles_with_the_runtimes_clocks(lab: Lab, schema: str) -> None:
    """The same, and within each settle step the same columns share one clock."""
    runtime, kit = lab.run(schema, "runtime"), lab.run(schema, "awa-sa")
    assert_same(runtime, kit, ("runtime", "awa-sa"), "clocks")
