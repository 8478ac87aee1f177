"""The README's code is run, not trusted, and so is docs/usage.md's: each Python example
against a fixture database.

The README's recipe (an awa-pg handler: the handler's row and ``settle`` of its job, in one
transaction, async and sync) runs on an attempt of each plane, seeded by the testing kit as a
worker's claim leaves it. Its ``@client.task`` registration is awa-pg's; here ``client`` is a
stand-in that hands the handler back (registering needs a live awa-pg client, and running the
handler under a real runtime is ``examples/test_invoicer_worker.py``'s part).

The README's producer (a request's row and its unique ``send_invoice`` job, in one transaction)
runs against a database that the published ``awa migrate`` built, since enqueueing calls Awa's
own producer function; a second request for the same order commits its row and answers the
first request's job.

A docs/usage.md example may use ``job_id``/``run_lease`` and ``next_job_id``/``next_run_lease``:
two running canonical attempts, claimed for it.

A usage example that no longer matches the API is worse than none; newcomers copy it first.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import awa_sa
from awa_sa import Fail, RunningAttempt
from awa_sa.testing import job_of, locate, queue_storage_attempt, running_attempt

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()
EXAMPLE_URL = re.compile(r'"postgresql\+(psycopg|asyncpg)://app@db\.internal/awa"')
RECIPES = re.findall(r"```python\n(.*?)```", README, re.S)
HANDLERS = RECIPES[:2]
"""The README's handler recipes, async then sync; the block after them is its producer."""
PRODUCER = 2
BLOCKS = re.findall(r"```python\n(.*?)```", USAGE, re.S)
SHELL = re.findall(r"```sh\n(.*?)```", README, re.S)
QUICKSTART_TEST = 1
"""docs/usage.md's test of a canonical handler; the block before it is the service it imports."""
MAX_LINES = 350


def claimed(engine: sa.Engine) -> tuple[int, int]:
    with engine.begin() as conn:
        row = conn.execute(
            sa.text(
                "INSERT INTO awa.jobs_hot (kind, state, attempt, run_lease, attempted_at, "
                "heartbeat_at) VALUES ('readme', 'running', 1, 7, now(), now()) "
                "RETURNING id, run_lease"
            )
        ).one()
    return int(row.id), int(row.run_lease)


def test_readme_starts_with_an_install_from_a_checkout() -> None:
    """The package is on no index: the first command a reader copies must work as it stands."""
    assert SHELL[0].splitlines() == [
        "git clone <this repository> awa-sa",
        "pip install './awa-sa[async,testing]'",
    ]


def test_readme_is_short_and_leads_with_the_handler_recipe() -> None:
    assert len(README.splitlines()) <= MAX_LINES
    headings = re.findall(r"^## (.*)$", README, re.M)
    assert headings == [
        "Install",
        "In an awa-pg handler: your rows and the job's end in one transaction",
        "Enqueue in your transaction",
        "Testing your service",
        "Where to read more",
    ]
    assert len(RECIPES) == 3
    assert "from awa_sa.asyncio import settle" in RECIPES[0]
    assert "from awa_sa import Complete, Stale, settle" in RECIPES[1]
    assert "from awa_sa.asyncio import enqueue" in RECIPES[PRODUCER]


def test_every_local_link_of_the_readme_and_usage_resolves() -> None:
    for page, text in ((ROOT / "README.md", README), (ROOT / "docs" / "usage.md", USAGE)):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), (page.name, target)


class Tasks:
    """A stand-in for ``awa.AsyncClient``'s ``task`` registration: the handler, unchanged."""

    def task(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return lambda handler: handler


def seeded(engine: sa.Engine, plane: str) -> RunningAttempt:
    """A ``send_invoice`` job for order 7, claimed on *plane*, with the handler's table."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE invoices (order_id bigint PRIMARY KEY, job_id bigint)")
        args = {"order_id": 7}
        if plane == "queue storage":
            return queue_storage_attempt(conn, kind="send_invoice", queue="billing", args=args)
        job_id, _ = running_attempt(conn, kind="send_invoice", queue="billing", args=args)
    [mine] = awa_sa.running_attempts(engine, job_id=job_id)
    return mine


def run_recipe(index: int, db_url: str, job: Any) -> None:
    """The README's handler *index*, on the test's database, given *job*."""
    code = HANDLERS[index]
    found = EXAMPLE_URL.search(code)
    assert found is not None
    url = sa.make_url(db_url).set(drivername=f"postgresql+{found.group(1)}")
    namespace: dict[str, Any] = {"client": Tasks()}
    runnable = code.replace(found.group(0), repr(url.render_as_string(hide_password=False)))
    exec(compile(runnable, f"README-{index}", "exec"), namespace)
    handler = namespace.get("send_invoice") or namespace["record_invoice"]
    if inspect.iscoroutinefunction(handler):

        async def call() -> None:
            try:
                await handler(job)
            finally:
                await namespace["engine"].dispose()

        asyncio.run(call())
    else:
        try:
            handler(job)
        finally:
            namespace["engine"].dispose()


@pytest.mark.parametrize("plane", ["queue storage", "canonical"])
@pytest.mark.parametrize("index", range(len(HANDLERS)))
def test_the_handler_recipe_commits_its_row_with_the_jobs_end(
    engine: sa.Engine, db_url: str, index: int, plane: str
) -> None:
    mine = seeded(engine, plane)
    run_recipe(index, db_url, job_of(mine))
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT order_id, job_id FROM invoices").all()
        schema = None if plane == "canonical" else mine.storage
        where = locate(conn, mine.job_id, schema=schema)
    assert [tuple(row) for row in rows] == [(7, mine.job_id)]
    assert where is not None
    assert where.state == "completed"
    assert awa_sa.running_attempts(engine) == []


@pytest.mark.parametrize("index", range(len(HANDLERS)))
def test_the_handler_recipe_writes_nothing_for_an_attempt_settled_elsewhere(
    engine: sa.Engine, db_url: str, index: int
) -> None:
    mine = seeded(engine, "queue storage")
    awa_sa.settle(engine, mine, Fail("rescued"))  # as a rescue would, before the handler
    with pytest.raises(Exception, match=str(mine.job_id)) as raised:
        run_recipe(index, db_url, job_of(mine))
    assert type(raised.value).__name__ == "AlreadySettled"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM invoices").scalar() == 0


def test_the_producer_recipe_commits_its_row_with_one_job(real_engine: sa.Engine) -> None:
    with real_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE invoice_requests (order_id bigint)")
    code = RECIPES[PRODUCER]
    found = EXAMPLE_URL.search(code)
    assert found is not None
    url = real_engine.url.set(drivername=f"postgresql+{found.group(1)}")
    namespace: dict[str, Any] = {}
    runnable = code.replace(found.group(0), repr(url.render_as_string(hide_password=False)))
    exec(compile(runnable, "README-producer", "exec"), namespace)

    async def twice() -> list[int | None]:
        try:
            return [await namespace["request_invoice"](7) for _ in range(2)]
        finally:
            await namespace["engine"].dispose()

    first, second = asyncio.run(twice())
    with real_engine.connect() as conn:
        requests = conn.exec_driver_sql("SELECT order_id FROM invoice_requests").all()
        jobs = conn.exec_driver_sql(
            "SELECT id, kind, queue, args, state::text FROM awa.jobs_hot"
        ).all()
    assert first is not None
    assert second == first  # the duplicate answers the job the first request enqueued
    assert [tuple(row) for row in requests] == [(7,), (7,)]  # both requests committed
    assert [tuple(row) for row in jobs] == [
        (first, "send_invoice", "billing", {"order_id": 7}, "available")
    ]


def test_usage_has_the_forms() -> None:
    assert len(BLOCKS) == 8
    assert "def test_" in BLOCKS[QUICKSTART_TEST]
    assert "Complete()" in BLOCKS[2]  # exactly once
    assert "create_async_engine" in BLOCKS[5]
    assert "postgresql+asyncpg://" in BLOCKS[6]
    assert "reschedule_canonical_attempts(" in BLOCKS[7]


def test_the_quickstart_test_passes(db_url: str, engine: sa.Engine) -> None:
    """docs/usage.md's canonical service, imported as ``service``, and its test, run as pytest
    would."""
    service = types.ModuleType("service")
    code = BLOCKS[QUICKSTART_TEST - 1]
    found = EXAMPLE_URL.search(code)
    assert found is not None
    exec(
        compile(code.replace(found.group(0), repr(db_url)), "usage-service", "exec"), vars(service)
    )
    sys.modules["service"] = service
    try:
        namespace: dict[str, Any] = {}
        exec(compile(BLOCKS[QUICKSTART_TEST], "usage-test", "exec"), namespace)
        tests = [value for name, value in namespace.items() if name.startswith("test_")]
        assert len(tests) == 1
        tests[0](awa_engine=engine)
    finally:
        del sys.modules["service"]
        service.engine.dispose()


@pytest.mark.parametrize("index", [i for i in range(len(BLOCKS)) if i != QUICKSTART_TEST])
def test_usage_example_runs(engine: sa.Engine, db_url: str, index: int) -> None:
    code = BLOCKS[index]
    found = EXAMPLE_URL.search(code)
    assert found is not None
    url = sa.make_url(db_url).set(drivername=f"postgresql+{found.group(1)}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE audit (job_id bigint, what text)")
    job_id, run_lease = claimed(engine)
    next_job_id, next_run_lease = claimed(engine)
    namespace: dict[str, Any] = {
        "job_id": job_id,
        "run_lease": run_lease,
        "next_job_id": next_job_id,
        "next_run_lease": next_run_lease,
    }
    runnable = code.replace(found.group(0), repr(url.render_as_string(hide_password=False)))
    exec(compile(runnable, f"usage-{index}", "exec"), namespace)
    if inspect.iscoroutinefunction(namespace.get("on_failure")):

        async def call() -> None:
            await namespace["on_failure"](job_id, run_lease, 1, TimeoutError("upstream"))
            await namespace["engine"].dispose()

        asyncio.run(call())
    elif "on_failure" in namespace:  # the canonical service
        outcome = namespace["on_failure"](namespace["engine"], job_id, run_lease, OSError("down"))
        assert type(outcome).__name__ == "Rescheduled"
        namespace["engine"].dispose()
    else:
        namespace["engine"].dispose()
    with engine.connect() as conn:
        scheduled = conn.exec_driver_sql("SELECT id, state::text FROM awa.scheduled_jobs")
        states: dict[int, str] = {row.id: row.state for row in scheduled}
        audit = conn.exec_driver_sql("SELECT job_id, what FROM audit").all()
        hot = conn.exec_driver_sql("SELECT id, state::text FROM awa.jobs_hot")
        in_place: dict[int, str] = {row.id: row.state for row in hot}
    if "Complete()" in code:  # the exactly-once recipe: the row and the completion together
        assert in_place[job_id] == "completed"
        assert [tuple(r) for r in audit] == [(job_id, "invoice sent")]
        return
    assert states[job_id] == ("scheduled" if "Snooze(" in code else "retryable")
    if "audit.insert()" in code:
        assert [tuple(r) for r in audit] == [(job_id, "Rescheduled")]
    if "reschedule_canonical_attempts(" in code:
        # In input order; the repeated attempt is Stale, as it would be one by one.
        outcomes = [type(outcome).__name__ for outcome in namespace["outcomes"]]
        assert outcomes == ["Rescheduled", "Rescheduled", "Stale"]
        assert states[next_job_id] == "retryable"
    else:
        assert next_job_id not in states
