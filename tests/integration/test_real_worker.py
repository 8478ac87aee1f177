"""awa-sa re-schedules a running attempt into the rows the installed release's own worker writes.

On an ``awa migrate`` cluster, the published worker (awa-pg, the same release as the awa-cli that
built the cluster: 0.6.9 in the whole suite, 0.6.6 in CI's awa066 job) claims two jobs, and their
handlers return ``awa.Snooze`` and ``awa.RetryAfter``. On a second clone, awa-sa re-schedules the
same attempts (``running_attempt`` writes a claim's row; tests/integration/
test_testing_real_claim.py compares it with a real claim) with :class:`awa_sa.Snooze` and
:class:`awa_sa.RetryAfter`. The rows the re-schedule leaves must be the same column by column, and
so must the dirty marks its transaction writes: appended rows in ``admin_dirty_*_marks`` on
0.6.9, keys in ``admin_dirty_queues``/``admin_dirty_kinds`` on 0.6.6 (docs/contract.md#awa-cli-066).

The marks are emptied just before each re-schedule (on the worker's side while its handlers still
hold the attempts), so what is there afterwards is what the re-schedule wrote.

The endings are compared the same way, cell by cell: five outcomes (complete, cancel, terminal
failure, a retryable failure on the final attempt, one with attempts left) in each phase a
canonical attempt can still be running in (canonical, prepared, mixed_transition, active) and
each unique mode (no key, the SDK's default mask, a mask holding failed and cancelled). One
worker run per phase and mode serves its five outcomes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import awa_release
from racing import CANONICAL_TABLES, QS_TABLES, RealTransitions
from runtimes import hold_leadership, pg_url
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa
import awa_sa.asyncio as awa_sa_asyncio
from awa_sa import Rescheduled
from awa_sa.testing import running_attempt
from awa_sa.tools.status import PATCHED_FAMILY, UNPATCHED_FAMILY, read_status

pytestmark = pytest.mark.slow  # real awa-pg runtimes of the release installed

SNOOZE = 30.0
RETRY_AFTER = 45.0
SAME = (
    "kind",
    "queue",
    "args",
    "state",
    "priority",
    "attempt",
    "max_attempts",
    "run_lease",
    "errors",
    "metadata",
    "tags",
    "unique_key",
    "unique_states",
    "progress",
    "callback_id",
    "callback_timeout_at",
    "heartbeat_at",
    "deadline_at",
)


@dataclass
class Snoozes:
    n: int


@dataclass
class Retries:
    n: int


Marks = Counter[tuple[str, str]]


def mark_tables(conn: sa.Connection) -> list[tuple[str, str]]:
    """The release's dirty-mark tables: append-only ``*_marks`` (0.6.9) or keyed sets (0.6.6).

    Both pairs of tables exist on 0.6.9; the trigger function says which one is written.
    """
    function = conn.execute(
        sa.text("SELECT prosrc FROM pg_proc WHERE proname = 'mark_dirty_keys_update'")
    ).scalar_one()
    return [
        (appended if appended in function else keyed, column)
        for appended, keyed, column in (
            ("admin_dirty_queue_marks", "admin_dirty_queues", "queue"),
            ("admin_dirty_kind_marks", "admin_dirty_kinds", "kind"),
        )
    ]


def clear_marks(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for table, _ in mark_tables(conn):
            conn.execute(sa.text(f"DELETE FROM awa.{table}"))


def read_marks(engine: sa.Engine) -> tuple[Marks, dict[str, set[dt.datetime]]]:
    """The marks as ``(table, queue-or-kind)`` counts, and each key's ``touched_at`` values."""
    marks: Marks = Counter()
    stamps: dict[str, set[dt.datetime]] = {}
    with engine.connect() as conn:
        for table, column in mark_tables(conn):
            for value, at in conn.execute(sa.text(f"SELECT {column}, touched_at FROM awa.{table}")):
                marks[(table, value)] += 1
                stamps.setdefault(value, set()).add(at)
    return marks, stamps


def scheduled(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM awa.scheduled_jobs")).mappings()
        return {row["kind"]: dict(row) for row in rows}


class Worker:
    """A real awa-pg worker whose handlers hold their attempts until released, then answer."""

    def __init__(self, url: str) -> None:
        self.client = awa.AsyncClient(url)
        self.holding = {"snoozes": asyncio.Event(), "retries": asyncio.Event()}
        self.release = asyncio.Event()
        self.client.task(Snoozes, queue="q")(self.snoozes)
        self.client.task(Retries, queue="q")(self.retries)

    async def snoozes(self, job: Any) -> Any:
        self.holding["snoozes"].set()
        await self.release.wait()
        return awa.Snooze(SNOOZE)

    async def retries(self, job: Any) -> Any:
        self.holding["retries"].set()
        await self.release.wait()
        return awa.RetryAfter(RETRY_AFTER)


def reschedule_for_real(url: str, engine: sa.Engine) -> None:
    """Let the worker claim both jobs, empty the marks, then let its handlers answer.

    No runtime leads (:func:`hold_leadership`): a leader's dirty-mark recompute could drain
    the marks between the re-schedule and their read, which a loaded shutdown keeps apart.
    """

    async def run() -> None:
        leader = await asyncio.to_thread(hold_leadership, engine)
        worker = Worker(pg_url(url))
        client = worker.client
        await client.insert(Snoozes(1), queue="q", tags=["t"], metadata={"m": 1})
        await client.insert(Retries(1), queue="q", priority=3, max_attempts=5)
        await client.start([("q", 2)], promote_interval_ms=600_000, heartbeat_interval_ms=600_000)
        try:
            for event in worker.holding.values():
                await asyncio.wait_for(event.wait(), 60)
            assert not (await client.health_check()).leader
            await asyncio.to_thread(clear_marks, engine)
            worker.release.set()
            for _ in range(600):
                if len(await asyncio.to_thread(scheduled, engine)) == 2:
                    return
                await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
            raise AssertionError("the worker did not re-schedule both jobs within 30 s")
        finally:
            worker.release.set()
            await client.shutdown()
            await client.close()
            leader.close()

    asyncio.run(run())


@pytest.fixture
def two_clusters(
    clone_database: Callable[[str], str], real_template: str
) -> Iterator[tuple[tuple[str, sa.Engine], tuple[str, sa.Engine]]]:
    urls = [clone_database(real_template) for _ in range(2)]
    engines = [sa.create_engine(url) for url in urls]
    yield (urls[0], engines[0]), (urls[1], engines[1])
    for engine in engines:
        engine.dispose()


def test_a_reschedule_writes_what_the_releases_own_worker_writes(
    two_clusters: tuple[tuple[str, sa.Engine], tuple[str, sa.Engine]],
) -> None:
    (real_url, real_engine), (_, kit_engine) = two_clusters
    reschedule_for_real(real_url, real_engine)
    real_rows = scheduled(real_engine)
    real_marks, real_stamps = read_marks(real_engine)

    with kit_engine.begin() as conn:
        snoozes = running_attempt(
            conn, kind="snoozes", queue="q", args={"n": 1}, tags=["t"], metadata={"m": 1}
        )
        retries = running_attempt(
            conn, kind="retries", queue="q", args={"n": 1}, priority=3, max_attempts=5
        )
    clear_marks(kit_engine)
    # Each in its own transaction, as the worker answers each job.
    outcomes = [
        awa_sa.reschedule_canonical_attempt(kit_engine, *snoozes, awa_sa.Snooze(SNOOZE)),
        awa_sa.reschedule_canonical_attempt(kit_engine, *retries, awa_sa.RetryAfter(RETRY_AFTER)),
    ]
    assert all(isinstance(outcome, Rescheduled) for outcome in outcomes), outcomes
    kit_rows = scheduled(kit_engine)
    kit_marks, kit_stamps = read_marks(kit_engine)

    assert set(kit_rows) == set(real_rows) == {"snoozes", "retries"}
    for kind, real in real_rows.items():
        assert {c: kit_rows[kind][c] for c in SAME} == {c: real[c] for c in SAME}, kind
    assert kit_marks == real_marks
    assert kit_marks, "the comparison above is not vacuous"
    # A kind's mark carries the now() of the transaction that re-scheduled that job, and run_at
    # is that plus the delay, on both sides.
    for rows, stamps in ((real_rows, real_stamps), (kit_rows, kit_stamps)):
        for kind, delay in (("snoozes", SNOOZE), ("retries", RETRY_AFTER)):
            (now,) = stamps[kind]
            assert rows[kind]["run_at"] - now == dt.timedelta(seconds=delay), kind


def test_status_names_the_release_family_that_built_the_cluster(
    real_engine: sa.Engine, engine: sa.Engine
) -> None:
    patched = tuple(int(part) for part in awa_release().split(".")) >= (0, 6, 8)
    assert read_status(real_engine).release_family == (
        PATCHED_FAMILY if patched else UNPATCHED_FAMILY
    )
    # The Alembic fixture is v040 as 0.6.9 leaves it.
    assert read_status(engine).release_family == PATCHED_FAMILY


# ------------------------------------------------------------------------------------------
# Every ending, in every phase and unique mode, against the real worker
#
# One real worker run per phase and unique mode serves all five outcomes: five jobs, one per
# outcome, each of its own kind, all held by their handlers until every one is claimed. A side
# session holds Awa's maintenance-leader advisory lock for the whole run, so no promotion,
# rescue or dirty-mark recompute can touch the rows between the release and the read.

OUTCOMES = ("complete", "cancel", "terminal", "final", "retry")
"""Returns None, returns Cancel, raises TerminalError, raises on its last attempt, raises with
attempts left: each outcome's kind, in the order the jobs are inserted (so ids match)."""
ENDING_PHASES = ("canonical", "prepared", "mixed_transition", "active")
UNIQUE_MODES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "default_mask": {"by_args": True},  # the SDK's default states: 11111000
    # The SDK takes the states as a bitmask, bit i for the mask's i-th character: 0b1111111
    # is scheduled, available, running, completed, retryable, failed and cancelled.
    "failed_and_cancelled": {"by_args": True, "states": 0b0111_1111},
}
MASKS = {"none": None, "default_mask": "11111000", "failed_and_cancelled": "11111110"}
PROGRESS = {"percent": 40, "message": "step 2", "metadata": {"cursor": 7}}
CANCEL_REASON = "cancelled by harness"
QS_SCHEMA = "awa_qs"
BACKOFF_FIRST = (dt.timedelta(seconds=2), dt.timedelta(seconds=2.5))
"""``awa.backoff_duration(1, _)``: 2 s plus up to 25 % random jitter."""


class HarnessRetryableError(Exception):
    """A plain exception: the worker retries it, or fails the job on its last attempt."""


def raised(exc: BaseException) -> BaseException:
    """*exc* after a real raise, so that it carries a traceback as a handler's would."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def retryable() -> HarnessRetryableError:
    return HarnessRetryableError("transient failure (harness)")


def terminal() -> awa.TerminalError:
    return awa.TerminalError("terminal (harness)")


def max_attempts_of(outcome: str) -> int:
    return 1 if outcome == "final" else 5


class Endings:
    """A real awa-pg worker with one handler per outcome, each held until released."""

    def __init__(self, url: str) -> None:
        self.client = awa.AsyncClient(url)
        self.holding = {outcome: asyncio.Event() for outcome in OUTCOMES}
        self.release = asyncio.Event()
        for outcome in OUTCOMES:
            self.client.task(dict, kind=outcome, queue="q")(self.handler(outcome))

    def handler(self, outcome: str) -> Callable[[Any], Any]:
        async def handle(job: Any) -> Any:
            job.set_progress(PROGRESS["percent"], PROGRESS["message"])
            job.update_metadata(PROGRESS["metadata"])
            self.holding[outcome].set()
            await self.release.wait()
            if outcome == "cancel":
                return awa.Cancel(CANCEL_REASON)
            if outcome == "terminal":
                raise terminal()
            if outcome in ("final", "retry"):
                raise retryable()
            return None

        return handle


def enter_phase(engine: sa.Engine, phase: str) -> None:
    """From ``prepared``, move on to *phase* as it would be reached with attempts still running.

    The flip is Awa's own ``storage_enter_mixed_transition()`` (racing.RealTransitions, which
    registers the live queue-storage target runtime it asks for). ``storage_finalize()``
    refuses while canonical attempts are running, so ``active`` is the row it would write.
    """
    if phase in ("mixed_transition", "active"):
        with engine.begin() as conn:
            RealTransitions(engine).enter_mixed(conn)
    if phase == "active":
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE awa.storage_transition_state SET current_engine = prepared_engine,"
                    " prepared_engine = NULL, state = 'active',"
                    " transition_epoch = transition_epoch + 1, entered_at = now(),"
                    " updated_at = now(), finalized_at = now() WHERE singleton"
                )
            )


def prepare(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        RealTransitions(engine).prepare(conn, QS_SCHEMA)


def unfinished(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM awa.jobs_hot WHERE state = 'running'")
            ).scalar_one()
        )


def end_for_real(url: str, engine: sa.Engine, phase: str, mode: str) -> None:
    """Insert the five jobs, let the worker claim and hold them, reach *phase*, empty the marks,
    then let every handler answer and wait until no attempt is running."""

    async def run() -> None:
        if phase != "canonical":
            await asyncio.to_thread(prepare, engine)
        leader = await asyncio.to_thread(hold_leadership, engine)
        worker = Endings(pg_url(url))
        client = worker.client
        try:
            for n, outcome in enumerate(OUTCOMES, 1):
                await client.insert(
                    {"n": n},
                    kind=outcome,
                    queue="q",
                    priority=3,
                    max_attempts=max_attempts_of(outcome),
                    tags=["t1", "t2"],
                    metadata={"tenant": "acme"},
                    unique_opts=UNIQUE_MODES[mode],
                )
            await client.start(
                [("q", len(OUTCOMES))],
                heartbeat_interval_ms=600_000,
                queue_storage_schema=QS_SCHEMA,
            )
            try:
                for event in worker.holding.values():
                    await asyncio.wait_for(event.wait(), 60)
                assert not (await client.health_check()).leader
                await asyncio.to_thread(enter_phase, engine, phase)
                await asyncio.to_thread(clear_marks, engine)
                worker.release.set()
                for _ in range(600):
                    if await asyncio.to_thread(unfinished, engine) == 0:
                        break
                    await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
                else:
                    raise AssertionError("the worker did not end all five attempts within 30 s")
            finally:
                worker.release.set()
                await client.shutdown()
        finally:
            await client.close()
            leader.close()

    asyncio.run(run())


def end_with_awa_sa(engine: sa.Engine, phase: str, mode: str, keys: dict[str, Any]) -> None:
    """The same five attempts written by the kit, the same phase, then settled by awa-sa."""
    with engine.begin() as conn:
        attempts = {
            outcome: running_attempt(
                conn,
                kind=outcome,
                queue="q",
                args={"n": n},
                priority=3,
                max_attempts=max_attempts_of(outcome),
                tags=["t1", "t2"],
                metadata={"tenant": "acme"},
                unique_key=keys[outcome],
                unique_states=MASKS[mode],
            )
            for n, outcome in enumerate(OUTCOMES, 1)
        }
    if phase != "canonical":
        prepare(engine)
    enter_phase(engine, phase)
    clear_marks(engine)
    results: dict[str, awa_sa.Result] = {
        "complete": awa_sa.Complete(),
        "cancel": awa_sa.Cancel(CANCEL_REASON),
        "terminal": awa_sa.Fail.of(raised(terminal()), terminal=True),
        "final": awa_sa.Fail.of(raised(retryable())),
        "retry": awa_sa.Fail.of(raised(retryable())),
    }
    moved = awa_sa.Rescheduled if phase in ("canonical", "prepared") else awa_sa.Migrated
    for outcome, (job_id, lease) in attempts.items():
        # Each in its own transaction, as the worker ends each job.
        ended = awa_sa.settle_canonical_attempt(
            engine, job_id, lease, results[outcome], progress=PROGRESS
        )
        assert {
            "complete": ended == awa_sa.Completed(job_id),
            "cancel": ended == awa_sa.Cancelled(job_id),
            "terminal": ended == awa_sa.Failed(job_id, terminal=True),
            "final": ended == awa_sa.Failed(job_id, terminal=False),
            "retry": isinstance(ended, moved),
        }[outcome], (outcome, ended)


TIMESTAMPS = (
    "run_at",
    "heartbeat_at",
    "deadline_at",
    "attempted_at",
    "finalized_at",
    "created_at",
    "callback_timeout_at",
)
AT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)\Z")


def entry_shape(entry: Any) -> Any:
    """An error entry with its clock replaced by its shape (RFC 3339 text), and its text by
    its first line and the traceback header after it: the frames differ between the worker's
    handler and the test's raise."""
    assert isinstance(entry, dict), entry
    shaped = {key: type(value).__name__ for key, value in entry.items()}
    assert AT.match(entry["at"]), entry["at"]
    shaped["error"] = entry["error"].split("\n")[:2]
    shaped["attempt"] = entry["attempt"]
    shaped["terminal"] = entry.get("terminal", "absent")
    return shaped


def comparable(
    row: dict[str, Any], clocked: Callable[[dt.datetime], bool | None]
) -> dict[str, Any]:
    """Every column of *row*: equal values compared as they are, the clock's as relations.

    ``clocked(finalized_at)`` says whether a dirty mark carries that transaction's clock (None
    where the marks cannot tell).
    """
    out = {c: v for c, v in row.items() if c not in TIMESTAMPS and c not in ("errors", "payload")}
    if "errors" in row:
        out["errors"] = [entry_shape(e) for e in row["errors"]]
    if "payload" in row:
        payload = dict(row["payload"])
        payload["errors"] = [entry_shape(e) for e in payload.get("errors", [])]
        out["payload"] = payload
    at: dict[str, Any] = {c: row.get(c) for c in TIMESTAMPS}
    out["null timestamps"] = sorted(c for c, v in at.items() if c in row and v is None)
    finalized, attempted = at["finalized_at"], at["attempted_at"]
    if at["heartbeat_at"] is not None:
        out["heartbeat_at is attempted_at"] = at["heartbeat_at"] == attempted
    if at["deadline_at"] is not None and attempted is not None:
        out["deadline_at - attempted_at"] = at["deadline_at"] - attempted
    if finalized is not None:
        # The ending's (or the retry's) transaction wrote both the row and a dirty mark.
        out["finalized_at is a mark's clock"] = clocked(finalized)
        out["claimed <= finalized_at"] = attempted <= finalized
    if row["state"] in ("retryable", "scheduled"):
        delay = at["run_at"] - finalized
        out["run_at - finalized_at"] = (
            "backoff(1)" if BACKOFF_FIRST[0] <= delay <= BACKOFF_FIRST[1] else delay
        )
    else:
        out["created <= run_at <= claimed"] = at["created_at"] <= at["run_at"] <= attempted
    return out


def ended_rows(engine: sa.Engine) -> dict[str, Any]:
    """Where each job ended up, every column, plus the unique claims and the dirty marks."""
    marks, stamps = read_marks(engine)
    every_stamp: set[dt.datetime] = set().union(*stamps.values())
    out: dict[str, Any] = {"marks": marks}
    with engine.connect() as conn:
        appended = mark_tables(conn)[0][0].endswith("_marks")

    def clocked(finalized: dt.datetime) -> bool | None:
        # Appended marks (0.6.8 on) keep every transaction's clock. A keyed set (0.6.6, 0.6.7:
        # ON CONFLICT DO NOTHING) keeps the clock of whichever concurrent transaction's insert
        # came first, which the worker's concurrent endings make a matter of timing: no relation.
        return finalized in every_stamp if appended else None

    with engine.connect() as conn:
        for name, sql in (
            ("awa.jobs_hot", "SELECT *, state::text AS state FROM awa.jobs_hot"),
            ("awa.scheduled_jobs", "SELECT *, state::text AS state FROM awa.scheduled_jobs"),
            (
                f"{QS_SCHEMA}.deferred_jobs",
                f"SELECT *, state::text AS state FROM {QS_SCHEMA}.deferred_jobs",
            ),
        ):
            for row in conn.execute(sa.text(sql)).mappings():
                out[row["kind"]] = (name, comparable(dict(row), clocked))
        out["claims"] = sorted(
            (bytes(key), job)
            for key, job in conn.execute(
                sa.text("SELECT unique_key, job_id FROM awa.job_unique_claims")
            )
        )
        # Nothing else of Awa's job tables, canonical or queue-storage (in awa_qs, where
        # routing points, and in awa, the default substrate), gained or lost a row. (The
        # marks, compared above, are in tables of their own on each release.)
        tables = [f"awa.{t}" for t in CANONICAL_TABLES if not t.startswith("admin_dirty_")]
        tables += [f"{schema}.{t}" for schema in (QS_SCHEMA, "awa") for t in QS_TABLES]
        out["row counts"] = {
            table: conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in tables
        }
    return out


def unique_keys(engine: sa.Engine) -> dict[str, bytes | None]:
    """Each kind's unique key as Awa hashed it, wherever its row now is."""
    keys: dict[str, bytes | None] = {}
    with engine.connect() as conn:
        for table in ("awa.jobs_hot", "awa.scheduled_jobs", f"{QS_SCHEMA}.deferred_jobs"):
            for kind, key in conn.execute(sa.text(f"SELECT kind, unique_key FROM {table}")):
                keys[kind] = None if key is None else bytes(key)
    return keys


def where_each_ended(rows: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Each outcome's relation, state and number of error entries."""
    out = {}
    for outcome in OUTCOMES:
        relation, row = rows[outcome]
        errors = row["errors"] if "errors" in row else row["payload"]["errors"]
        out[outcome] = (relation, row["state"], len(errors))
    return out


@pytest.mark.parametrize("mode", list(UNIQUE_MODES))
@pytest.mark.parametrize("phase", ENDING_PHASES)
def test_every_ending_writes_what_the_real_worker_writes(
    two_clusters: tuple[tuple[str, sa.Engine], tuple[str, sa.Engine]], phase: str, mode: str
) -> None:
    """Five outcomes in one phase and unique mode: the real worker's rows, then awa-sa's."""
    (real_url, real_engine), (_, kit_engine) = two_clusters
    end_for_real(real_url, real_engine, phase, mode)
    real = ended_rows(real_engine)
    end_with_awa_sa(kit_engine, phase, mode, unique_keys(real_engine))
    kit = ended_rows(kit_engine)

    assert kit == real
    # What was compared is what the cell is about, so the equality above is not vacuous.
    for engine in (real_engine, kit_engine):
        assert read_status(engine).phase == phase
    retry_relation = (
        "awa.scheduled_jobs" if phase in ("canonical", "prepared") else f"{QS_SCHEMA}.deferred_jobs"
    )
    assert where_each_ended(real) == {
        "complete": ("awa.jobs_hot", "completed", 0),
        "cancel": ("awa.jobs_hot", "cancelled", 1),
        "terminal": ("awa.jobs_hot", "failed", 1),
        "final": ("awa.jobs_hot", "failed", 1),
        "retry": (retry_relation, "retryable", 1),
    }
    mask = MASKS[mode]
    claimed = {
        kind for kind, key in unique_keys(real_engine).items() if key in dict(real["claims"])
    }
    if mask is None:
        assert claimed == set()
    else:
        assert real["complete"][1]["unique_states"] == mask
        kept = {"complete", "retry"} | (set(OUTCOMES) if mask[5:7] == "11" else set())
        assert claimed == kept
    assert real["marks"], "the marks were compared"


FRAME = re.compile(r'  File "[^"]*", line \d+, in \S+\n    [^\n]*\n')


def traceback_shape(text: str) -> str:
    """An error text with each traceback frame (file, line, function, source) made alike."""
    return FRAME.sub("  File <frame>\n    <source>\n", text + "\n").removesuffix("\n")


def deep(depth: int) -> None:
    """Raise from *depth* calls down: a traceback longer than the worker keeps."""
    if depth == 0:
        raise retryable()
    deep(depth - 1)


def failing_deep() -> BaseException:
    try:
        deep(8)
    except HarnessRetryableError as exc:
        return exc
    raise AssertionError("deep() raises")


def error_texts_for_real(url: str, engine: sa.Engine) -> dict[str, str]:
    """The error text the worker writes for a shallow and a deep traceback (final attempts)."""

    async def run() -> None:
        client = awa.AsyncClient(pg_url(url))

        async def shallow(job: Any) -> None:
            raise retryable()

        async def deeply(job: Any) -> None:
            deep(8)

        client.task(dict, kind="shallow", queue="q")(shallow)
        client.task(dict, kind="deep", queue="q")(deeply)
        for kind in ("shallow", "deep"):
            await client.insert({}, kind=kind, queue="q", max_attempts=1)
        await client.start([("q", 2)], heartbeat_interval_ms=600_000)
        try:
            for _ in range(600):
                if await asyncio.to_thread(unfinished_or_waiting, engine) == 0:
                    return
                await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
            raise AssertionError("the worker did not fail both jobs within 30 s")
        finally:
            await client.shutdown()
            await client.close()

    asyncio.run(run())
    with engine.connect() as conn:
        return dict(
            conn.execute(sa.text("SELECT kind, errors[1]->>'error' FROM awa.jobs_hot")).all()
        )


def unfinished_or_waiting(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM awa.jobs_hot WHERE state <> 'failed'")
            ).scalar_one()
        )


def test_fail_of_writes_the_workers_error_text(real_engine: sa.Engine, real_db_url: str) -> None:
    """The whole error text, frames aside, as the worker writes it for a raised exception.

    awa-pg 0.6.9 writes ``"<qualname>: <message>\n"`` and then the traceback without its
    exception line: in full (``Traceback (most recent call last):`` and the frames, ending in
    a newline) or, when longer than 10 lines, ``... (N frames truncated, full trace in logs)``
    and its last 10 lines, with no newline at the end.
    """
    real = error_texts_for_real(real_db_url, real_engine)
    kit = {
        "shallow": awa_sa.Fail.of(raised(retryable())).error,
        "deep": awa_sa.Fail.of(failing_deep()).error,
    }
    assert "frames truncated" in real["deep"]
    assert {k: traceback_shape(v) for k, v in kit.items()} == {
        k: traceback_shape(v) for k, v in real.items()
    }


# ------------------------------------------------------------------------------------------
# A handler that settles through awa-sa, driven by a real worker with a real leader


@dataclass
class SettleRun:
    runs: dict[str, list[int]]
    """Each kind's handler runs, by the attempt it was given."""
    settled: dict[str, list[awa_sa.Ending]]
    after_settle: dict[str, dict[str, Any]]
    """Each job's row as the handler's own last settle left it, read right after its commit."""
    after_shutdown: dict[str, dict[str, Any]]
    """The same rows once the runtime has shut down, its own completions flushed."""


def job_row(engine: sa.Engine, kind: str) -> dict[str, Any]:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.text(
                    "SELECT *, state::text AS state FROM awa.jobs_hot WHERE kind = :k"
                    " UNION ALL SELECT *, state::text FROM awa.scheduled_jobs WHERE kind = :k"
                ),
                {"k": kind},
            )
            .mappings()
            .one()
        )


def settle_in_handlers(url: str, engine: sa.Engine, max_attempts: int) -> SettleRun:
    """Two jobs whose handlers settle through awa-sa and then return normally: one always
    fails (``Fail.of``), one completes (``Complete()``). The leader promotes every 100 ms, so
    each retry is claimed again as soon as its backoff is over."""
    runs: dict[str, list[int]] = {"always_fails": [], "completes": []}
    settled: dict[str, list[awa_sa.Ending]] = {"always_fails": [], "completes": []}
    after: dict[str, dict[str, Any]] = {}

    async def run() -> SettleRun:
        async_engine = create_async_engine(url, poolclass=sa.NullPool)
        ended = {kind: asyncio.Event() for kind in runs}
        client = awa.AsyncClient(pg_url(url))

        async def settle(job: Any, result: awa_sa.Result) -> None:
            async with async_engine.connect() as conn:
                mine = await conn.run_sync(awa_sa.attempt_of, job)
                outcome = await awa_sa_asyncio.settle(conn, mine, result)
                await conn.commit()
            settled[job.kind].append(outcome)
            if isinstance(outcome, awa_sa.Failed | awa_sa.Completed):
                after[job.kind] = await asyncio.to_thread(job_row, engine, job.kind)
                ended[job.kind].set()

        async def always_fails(job: Any) -> None:
            runs["always_fails"].append(job.attempt)
            try:
                raise retryable()
            except HarnessRetryableError as exc:
                await settle(job, awa_sa.Fail.of(exc))
            # Returning normally: the runtime then completes an attempt that is no longer running.

        async def completes(job: Any) -> None:
            runs["completes"].append(job.attempt)
            await settle(job, awa_sa.Complete())

        client.task(dict, kind="always_fails", queue="q")(always_fails)
        client.task(dict, kind="completes", queue="q")(completes)
        try:
            await client.insert({"n": 1}, kind="always_fails", queue="q", max_attempts=max_attempts)
            await client.insert({"n": 2}, kind="completes", queue="q", max_attempts=max_attempts)
            await client.start(
                [("q", 2)],
                promote_interval_ms=100,
                leader_election_interval_ms=100,
                heartbeat_interval_ms=600_000,
            )
            try:
                for event in ended.values():
                    await asyncio.wait_for(event.wait(), 60)
            finally:
                await client.shutdown()  # waits for the runtime's in-flight completions
        finally:
            await client.close()
            await async_engine.dispose()
        rows = {kind: await asyncio.to_thread(job_row, engine, kind) for kind in runs}
        return SettleRun(runs, settled, after, rows)

    return asyncio.run(run())


def test_a_handler_settling_through_awa_sa_ends_as_the_worker_would(
    real_engine: sa.Engine, real_db_url: str
) -> None:
    """``Fail`` bounds an always-failing job by max_attempts, as the worker's own retry does,
    and a handler's awa-sa ending is final: the runtime's completion after it is stale."""
    max_attempts = 2  # attempt 1's backoff is 2 to 2.5 s; attempt 2 is the last
    got = settle_in_handlers(real_db_url, real_engine, max_attempts)
    # The always-failing job ran exactly max_attempts times, then ended failed.
    assert got.runs["always_fails"] == list(range(1, max_attempts + 1))
    *retries, last = got.settled["always_fails"]
    assert all(isinstance(o, awa_sa.Rescheduled) for o in retries), retries
    failed = got.after_shutdown["always_fails"]
    assert last == awa_sa.Failed(failed["id"], terminal=False)
    assert (failed["state"], failed["attempt"], failed["run_lease"]) == (
        "failed",
        max_attempts,
        max_attempts,
    )
    assert [e["attempt"] for e in failed["errors"]] == list(range(1, max_attempts + 1))
    assert not any("terminal" in e for e in failed["errors"])
    # The completing job ran once, and awa-sa's completion is the one that stands.
    assert got.runs["completes"] == [1]
    assert got.settled["completes"] == [awa_sa.Completed(got.after_shutdown["completes"]["id"])]
    # The runtime's own completion of each attempt, after the handler returned, changed nothing.
    assert got.after_shutdown == got.after_settle
    assert got.after_shutdown["completes"]["state"] == "completed"
