"""The ``awa-sa demo`` walk-through: every outcome, with real rows, on a database it owns.

It shows rather than tells: jobs are enqueued and claimed the way a worker's claim leaves them,
the public :func:`awa_sa.reschedule_canonical_attempt` does the work, and each row is then read
back from wherever it landed. Nothing is faked for display.

The demo always works in a database it created itself, on a throwaway server or on one the user
names, and removes it on every way out (success, error, Ctrl-C, SIGTERM): a demo that leaves
debris behind is not one people run twice. Output goes through the ``emit`` callable, so this
module never prints.
"""

from __future__ import annotations

import hashlib
import importlib
import textwrap
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import ModuleType

import sqlalchemy as sa

from awa_sa import reschedule_canonical_attempt
from awa_sa.settle.results import (
    Kind,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
)
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import job_unique_claims, jobs_hot
from awa_sa.testing import locate, running_attempt, set_phase
from awa_sa.testing.errors import EmbeddedPostgresError
from awa_sa.testing.server import embedded_postgres
from awa_sa.tools.errors import DemoUnavailable
from awa_sa.tools.scratch import fresh_database
from awa_sa.tools.status import read_status_in

Emit = Callable[[str], None]

QS_SCHEMA = "awa_qs"
"""A named queue-storage schema, so the output shows that routing follows the transition row."""

QUEUE = "demo"
DUPLICATE_MASK = "11001000"
"""Unique while scheduled, available or retryable, but not while running: the running attempt
holds no claim, so a newer duplicate can take the key meanwhile (the real race behind
CancelledDuplicate), and the retry's successor would need the key back."""


WORKER_ADVICE = {
    "Rescheduled": "done; the same id runs again at run_at (its next claim brings a new lease)",
    "Migrated": "done; the job continues in queue storage under the new id (log both ids)",
    "CancelledDuplicate": "done; report the attempt as ignored: no retry event, no follow-up",
    "Stale": "someone else already settled this attempt; drop the result (nothing was written)",
}
"""What the caller of reschedule_canonical_attempt should do next (docs/contract.md#outcomes)."""


def _fixture_builder() -> ModuleType:
    # Imported late on purpose: the fixture needs Alembic, which `awa-sa status` and `sql`
    # (and the library) do not, so a missing Alembic must only cost the demo.
    try:
        return importlib.import_module("awa_sa_schema")
    except ImportError as exc:
        raise DemoUnavailable(
            f"the demo builds its schema with Alembic, which is not installed ({exc}); "
            "run `./dev demo` from a checkout, or `pip install awa-sa[demo]`"
        ) from exc


@dataclass(frozen=True)
class JobSpec:
    """A job the story claims: a kind plus the few columns the story varies."""

    kind: str
    attempt: int = 1
    unique_key: bytes | None = None
    unique_states: str | None = None
    callback: bool = False


_DUPLICATE = JobSpec(
    "sync_invoice",
    unique_key=hashlib.sha256(b"invoice:42").digest(),
    unique_states=DUPLICATE_MASK,
)
"""Claimed before the flip; a newer sync_invoice takes its key while it runs."""


@dataclass(frozen=True)
class Claimed:
    """A running canonical attempt as the worker that claimed it knows it."""

    name: str
    job_id: int
    run_lease: int
    attempt: int


def _claim(engine: sa.Engine, specs: Sequence[JobSpec]) -> list[Claimed]:
    """Running attempts exactly as a worker's claim leaves them (the testing kit's helper)."""
    claimed = []
    with engine.begin() as conn:
        for spec in specs:
            job_id, lease = running_attempt(
                conn,
                kind=spec.kind,
                queue=QUEUE,
                args={"demo": spec.kind},
                attempt=spec.attempt,
                metadata={"source": "awa-sa demo"},
                tags=["demo"],
                unique_key=spec.unique_key,
                unique_states=spec.unique_states,
                callback_id=uuid.uuid4() if spec.callback else None,
            )
            claimed.append(Claimed(spec.kind, job_id, lease, spec.attempt))
    return claimed


@dataclass(frozen=True)
class Row:
    """One line of a step's table."""

    job: str
    asks: str
    outcome: str
    ids: str
    state: str
    attempt: str
    run_at: str
    lives_in: str


_HEADER = Row(
    "job",
    "handler asks",
    "outcome",
    "id before -> after",
    "state",
    "attempt",
    "run_at",
    "row now in",
)


def _table(rows: Sequence[Row]) -> Iterator[str]:
    cells = [list(vars(r).values()) for r in (_HEADER, *rows)]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(cells[0]))]
    for n, line in enumerate(cells):
        yield "  " + "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        if n == 0:
            yield "  " + "  ".join("-" * w for w in widths)


def _describe(kind: Kind) -> str:
    if isinstance(kind, Snooze):
        return f"Snooze({kind.delay_secs:g} s)"
    if isinstance(kind, RetryAfter):
        return f"RetryAfter({kind.delay_secs:g} s)"
    return "RetryBackoff"


def _error_entry(job: Claimed, kind: Kind) -> dict[str, object] | None:
    """What Awa's executor appends for a failed handler; snoozes and retry-afters add none."""
    if not isinstance(kind, RetryBackoff):
        return None
    return {
        "error": "renderer crashed",
        "attempt": job.attempt,
        "at": datetime.now(UTC).isoformat(),
    }


def _in_seconds(run_at: datetime | None, now: datetime) -> str:
    if run_at is None:
        return "-"
    secs = (run_at - now).total_seconds()
    return f"in {secs:.0f} s" if secs >= 0 else f"{-secs:.0f} s ago"


class Walkthrough:
    """The four steps of the story, sharing one engine and the jobs it claimed."""

    def __init__(self, engine: sa.Engine, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit

    def run(self) -> None:
        self.emit(f"cluster: {self._status_line()}")
        first = self.canonical_routing()
        moved, duplicate = self.routing_flipped()
        self.newer_duplicate(duplicate)
        self.late_completions(first, moved)
        self.emit("")
        self.emit(f"cluster: {self._status_line()}")
        self.emit(
            "  (finalize waits until the canonical backlog is 0: "
            "run `awa-sa status --url ...` on a real cluster)"
        )

    def canonical_routing(self) -> Claimed:
        """Step 1; returns the snoozed job, completed late in step 4."""
        snoozer, retrier, backer = _claim(
            self.engine,
            [JobSpec("send_email"), JobSpec("charge_card"), JobSpec("render_pdf", attempt=3)],
        )
        self._step(
            "1. Routing is canonical: three claimed attempts are re-scheduled in place.",
            "Each running row leaves awa.jobs_hot and lands in awa.scheduled_jobs under the SAME "
            "id. A snooze does not count the attempt; retries do. run_at comes from the "
            "database clock (RetryBackoff: awa.backoff_duration, with jitter).",
            [(snoozer, Snooze(30)), (retrier, RetryAfter(45)), (backer, RetryBackoff())],
        )
        return snoozer

    def routing_flipped(self) -> tuple[Claimed, Claimed]:
        """Step 2: attempts claimed before the flip end after it.

        Returns one that migrated (completed late in step 4) and the unique job of step 3,
        which is claimed before the flip too.
        """
        mover_a, mover_b, mover_c, callback_job = _claim(
            self.engine,
            [
                JobSpec("send_email"),
                JobSpec("charge_card"),
                JobSpec("render_pdf", attempt=3),
                JobSpec("await_webhook", callback=True),
            ],
        )
        duplicate = _claim(self.engine, [_DUPLICATE])[0]
        with self.engine.begin() as conn:
            set_phase(conn, "mixed_transition", QS_SCHEMA)
        self.emit("")
        # One step from canonical: the rows `awa storage prepare` then `enter-mixed-transition`
        # leave, written at once by the testing kit.
        self.emit(
            f"-- storage transition: canonical -> mixed_transition into schema {QS_SCHEMA} "
            "(as prepare + enter-mixed-transition leave it)"
        )
        self.emit(f"cluster: {self._status_line()}")
        self._step(
            f"2. Routing flipped to {QS_SCHEMA}: attempts claimed before the flip migrate.",
            "The canonical row is deleted and its successor is written to "
            f"{QS_SCHEMA}.deferred_jobs under a FRESH id from {QS_SCHEMA}.job_id_seq (an "
            "independent sequence, so ids may repeat across planes). A job with callback wiring "
            "never migrates (deferred_jobs cannot carry it): it is re-scheduled canonically.",
            [
                (mover_a, Snooze(30)),
                (mover_b, RetryAfter(45)),
                (mover_c, RetryBackoff()),
                (callback_job, Snooze(10)),
            ],
        )
        return mover_a, duplicate

    def newer_duplicate(self, duplicate: Claimed) -> None:
        """Step 3: the job claimed before the flip loses its unique key to a newer one."""
        newer_id = self._enqueue_newer_duplicate(duplicate)
        self._step(
            "3. A newer duplicate owns the unique key: the retry is recorded as cancelled.",
            f"sync_invoice is unique in states {DUPLICATE_MASK} (scheduled, available, retryable "
            "but not running), so while it ran, a newer sync_invoice "
            f"(id {newer_id} in {QS_SCHEMA}.deferred_jobs) took the key. The retry must not "
            f"run as well: it is recorded as a cancelled row in {QS_SCHEMA}.done_entries "
            "and the newer job keeps the key.",
            [(duplicate, RetryAfter(60))],
        )

    def late_completions(self, *settled: Claimed) -> None:
        """Step 4: attempts that were already settled are completed again."""
        self._step(
            "4. Late completions of attempts that already moved are Stale: nothing changes.",
            "The (id, running, run_lease) guard matches no row, so the call writes nothing, takes "
            "no sequence value and touches no claim. The worker drops the result.",
            list(zip(settled, (RetryBackoff(), Snooze(5)), strict=True)),
        )

    def _step(self, title: str, explain: str, jobs: Sequence[tuple[Claimed, Kind]]) -> None:
        """Re-schedule *jobs* through the public API and print where each row landed."""
        rows = []
        for job, kind in jobs:
            outcome = reschedule_canonical_attempt(
                self.engine, job.job_id, job.run_lease, kind, error=_error_entry(job, kind)
            )
            rows.append(self._read_back(job, kind, outcome))
        self.emit("")
        self.emit(title)
        for line in textwrap.wrap(explain, width=94):
            self.emit(f"  {line}")
        self.emit("")
        for line in _table(rows):
            self.emit(line)
        for outcome_name in dict.fromkeys(r.outcome for r in rows):
            self.emit(f"  worker, on {outcome_name}: {WORKER_ADVICE[outcome_name]}")

    def _read_back(self, job: Claimed, kind: Kind, outcome: Outcome) -> Row:
        """The successor, read back from the table the outcome says it is in."""
        asks, name = _describe(kind), type(outcome).__name__
        with self.engine.connect() as conn:
            now: datetime = conn.execute(sa.select(sa.func.now())).scalar_one()
            if isinstance(outcome, Stale):
                ids = f"{job.job_id} -> -"
                return Row(job.name, asks, name, ids, "-", "-", "-", "nothing changed")
            schema = None if isinstance(outcome, Rescheduled) else QS_SCHEMA
            found = locate(conn, outcome, schema=schema)
        assert found is not None, f"{outcome} names a row that is not there"
        return Row(
            job.name,
            asks,
            name,
            f"{job.job_id} -> {outcome.job_id}",
            found.state,
            str(found.attempt),
            _in_seconds(found.run_at, now),
            found.relation,
        )

    def _status_line(self) -> str:
        with self.engine.connect() as conn:
            st = read_status_in(conn)
            conn.rollback()
        routing = st.routing_schema or "canonical"
        return (
            f"phase {st.phase} (epoch {st.epoch}), new writes -> {routing}, "
            f"canonical live backlog {st.canonical_live_backlog}"
        )

    def _enqueue_newer_duplicate(self, job: Claimed) -> int:
        """A producer after the flip: the job goes to queue storage and claims the key there."""
        with self.engine.begin() as raw:
            conn = raw.execution_options(schema_translate_map=qs.translate_map(QS_SCHEMA))
            key = conn.execute(
                sa.select(jobs_hot.c.unique_key).where(jobs_hot.c.id == job.job_id)
            ).scalar_one()
            new_id = int(conn.execute(sa.select(qs.job_id_seq.next_value())).scalar_one())
            conn.execute(
                sa.insert(qs.deferred_jobs).values(
                    job_id=new_id,
                    kind=job.name,
                    queue=QUEUE,
                    args={"demo": job.name},
                    state="scheduled",
                    priority=2,
                    attempt=0,
                    run_lease=0,
                    max_attempts=25,
                    run_at=sa.func.now() + sa.text("interval '10 minutes'"),
                    created_at=sa.func.now(),
                    unique_key=key,
                    unique_states=DUPLICATE_MASK,
                )
            )
            conn.execute(sa.insert(job_unique_claims).values(unique_key=key, job_id=new_id))
        return new_id


def _walk(engine: sa.Engine, emit: Emit) -> None:
    fixture = _fixture_builder()
    with engine.begin() as conn:
        version = str(conn.execute(sa.text("SHOW server_version")).scalar_one()).split()[0]
        fixture.build(conn, queue_storage_schemas=("awa", QS_SCHEMA))
    emit(f"schema: Awa v040 fixture built by Alembic on PostgreSQL {version}; queue storage in")
    emit(f"        schemas awa and {QS_SCHEMA}. Every row below is read back from the database.")
    Walkthrough(engine, emit).run()


def run(emit: Emit, server: sa.URL | None = None) -> None:
    """Run the walk-through on a throwaway server, or in a fresh database on *server*."""
    _fixture_builder()  # fail before starting anything if the demo cannot run at all
    if server is not None:
        plain = server.set(drivername=server.get_backend_name())
        shown = plain.render_as_string(hide_password=True)
        emit(f"server: {shown} (a demo database is created there and dropped after)")
        with fresh_database(server) as engine:
            _walk(engine, emit)
        return
    try:
        with embedded_postgres() as pg:
            emit(f"server: throwaway PostgreSQL in {pg.root}, port {pg.port} (removed after)")
            # The whole server is deleted afterwards: its own database is as fresh as any.
            engine = sa.create_engine(pg.url, poolclass=sa.NullPool)
            try:
                _walk(engine, emit)
            finally:
                engine.dispose()
    except EmbeddedPostgresError as exc:
        raise DemoUnavailable(f"cannot start a throwaway PostgreSQL: {exc}") from exc
