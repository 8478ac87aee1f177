"""The README's code is run, not trusted: each Python example against a fixture database.

An example may use ``job_id``/``run_lease`` and ``next_job_id``/``next_run_lease``: two running
canonical attempts, claimed for it.

A usage example that no longer matches the API is worse than none; newcomers copy it first.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_URL = re.compile(r'"postgresql\+(psycopg|asyncpg)://app@db\.internal/awa"')
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
SHELL = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
QUICKSTART_TEST = 1
"""The quickstart's test; the block before it is the service it imports."""


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
        "pip install './awa-sa[asyncpg,testing]'",
    ]


def test_readme_has_the_usage_forms() -> None:
    assert len(BLOCKS) == 8
    assert "def test_" in BLOCKS[QUICKSTART_TEST]
    assert "Complete()" in BLOCKS[2]  # exactly once
    assert "create_async_engine" in BLOCKS[5]
    assert "postgresql+asyncpg://" in BLOCKS[6]
    assert "reschedule_canonical_attempts(" in BLOCKS[7]


def test_the_quickstart_test_passes(db_url: str, engine: sa.Engine) -> None:
    """The quickstart's service, imported as ``service``, and its test, run as pytest would."""
    service = types.ModuleType("service")
    code = BLOCKS[QUICKSTART_TEST - 1]
    found = EXAMPLE_URL.search(code)
    assert found is not None
    exec(
        compile(code.replace(found.group(0), repr(db_url)), "README-service", "exec"), vars(service)
    )
    sys.modules["service"] = service
    try:
        namespace: dict[str, Any] = {}
        exec(compile(BLOCKS[QUICKSTART_TEST], "README-test", "exec"), namespace)
        tests = [value for name, value in namespace.items() if name.startswith("test_")]
        assert len(tests) == 1
        tests[0](awa_engine=engine)
    finally:
        del sys.modules["service"]
        service.engine.dispose()


@pytest.mark.parametrize("index", [i for i in range(len(BLOCKS)) if i != QUICKSTART_TEST])
def test_readme_example_runs(engine: sa.Engine, db_url: str, index: int) -> None:
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
    exec(compile(runnable, f"README-{index}", "exec"), namespace)
    if inspect.iscoroutinefunction(namespace.get("on_failure")):

        async def call() -> None:
            await namespace["on_failure"](job_id, run_lease, 1, TimeoutError("upstream"))
            await namespace["engine"].dispose()

        asyncio.run(call())
    elif "on_failure" in namespace:  # the quickstart's service
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
