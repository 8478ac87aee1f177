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
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import awa_release
from test_testing_real_claim import pg_url

import awa_sa
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
    """Let the worker claim both jobs, empty the marks, then let its handlers answer."""

    async def run() -> None:
        worker = Worker(pg_url(url))
        client = worker.client
        await client.insert(Snoozes(1), queue="q", tags=["t"], metadata={"m": 1})
        await client.insert(Retries(1), queue="q", priority=3, max_attempts=5)
        await client.start([("q", 2)], promote_interval_ms=600_000, heartbeat_interval_ms=600_000)
        try:
            for event in worker.holding.values():
                await asyncio.wait_for(event.wait(), 60)
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
