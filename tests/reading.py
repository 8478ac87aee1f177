"""Jobs a real awa-pg 0.6.9 runtime put in every state, for the read tests to compare.

:func:`populated` starts a runtime on a cluster (its queues: ``run_q`` with the default
deadline, so its claims are ``lease_claims`` receipts; ``compact_q`` without one, so compact
``lease_claim_batches``) and gives it jobs that end every way a handler can end them, then
jobs it holds: a handler that waits (running, its progress flushed), one of ``compact_q``,
and one parked on a callback (``waiting_external``). While they are held, the caller's
*compare* runs; then the held handlers return and the runtime stops. A side session holds
the maintenance-leader lock throughout, so nothing promotes, rescues, rotates or prunes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import awa
import sqlalchemy as sa
from runtimes import STILL_RINGS, hold_leadership, pg_url, until_idle

QUEUES: list[dict[str, Any]] = [
    {"name": "run_q", "max_workers": 8},
    {"name": "compact_q", "max_workers": 4, "deadline_duration_ms": 0},
]
WAIT = 60.0


@dataclass
class Seeded:
    """What was made: ids by what was asked of each."""

    ids: dict[str, int] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    dlq_refused: str | None = None


class Failing(Exception):
    """A handler's retryable failure."""


async def _ended(client: awa.AsyncClient, made: Seeded) -> None:
    """Jobs that end every way: complete (bare, and with tags, metadata and a unique key),
    fail for good, fail with attempts left, fail on the last attempt, cancel, snooze."""
    specs: list[tuple[str, str, dict[str, Any]]] = [
        ("complete_bare", "run_q", {}),
        ("complete_rich", "run_q", {"tags": ["a", "b"], "metadata": {"m": 1}}),
        ("complete_unique", "run_q", {"unique_opts": {"by_args": True}}),
        ("complete_compact", "compact_q", {}),
        ("terminal", "run_q", {"tags": ["t"]}),
        ("retry", "run_q", {"max_attempts": 3}),
        ("final", "run_q", {"max_attempts": 1}),
        ("final_dlq", "run_q", {"max_attempts": 1}),
        ("cancel", "run_q", {}),
        ("snooze", "run_q", {"metadata": {"s": True}}),
    ]
    for name, queue, options in specs:
        job = await client.insert({"name": name}, kind=name, queue=queue, **options)
        made.ids[name] = job.id
        await until_idle(client, WAIT)


def _handlers(client: awa.AsyncClient, release: asyncio.Event, holding: list[int]) -> None:
    async def complete(job: Any) -> Any:
        return None

    async def terminal(job: Any) -> Any:
        raise awa.TerminalError("no good")

    async def failing(job: Any) -> Any:
        raise Failing("try again")

    async def cancel(job: Any) -> Any:
        return awa.Cancel("not wanted")

    async def snooze(job: Any) -> Any:
        return awa.Snooze(3600)

    async def hold(job: Any) -> Any:
        job.set_progress(40, "half")
        job.update_metadata({"step": 2})
        await job.flush_progress()
        holding.append(job.id)
        await release.wait()
        return None

    async def waits(job: Any) -> Any:
        token = await job.register_callback(timeout_seconds=3600)
        holding.append(job.id)
        return awa.WaitForCallback(token)

    for kind, queue, handler in (
        ("complete_bare", "run_q", complete),
        ("complete_rich", "run_q", complete),
        ("complete_unique", "run_q", complete),
        ("complete_compact", "compact_q", complete),
        ("terminal", "run_q", terminal),
        ("retry", "run_q", failing),
        ("final", "run_q", failing),
        ("final_dlq", "run_q", failing),
        ("cancel", "run_q", cancel),
        ("snooze", "run_q", snooze),
        ("hold", "run_q", hold),
        ("hold_compact", "compact_q", hold),
        ("waits", "run_q", waits),
    ):
        client.task(dict, kind=kind, queue=queue)(handler)


async def populated(
    url: str,
    engine: sa.Engine,
    compare: Callable[[Seeded], None],
    *,
    schema: str | None = None,
    role: str | None = None,
) -> Seeded:
    """Jobs in every state on the cluster at *url* (module docstring), *compare* run while
    three are held."""
    made = Seeded()
    leader = await asyncio.to_thread(hold_leadership, engine)
    client = awa.AsyncClient(pg_url(url))
    release = asyncio.Event()
    holding: list[int] = []
    _handlers(client, release, holding)
    try:
        await client.start(
            QUEUES,
            poll_interval_ms=20,
            heartbeat_interval_ms=600_000,
            queue_storage_schema=schema,
            storage_transition_role=role,  # type: ignore[arg-type]
            **STILL_RINGS,
        )
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        for name, queue, run_at in (("available", "idle_q", None), ("scheduled", "run_q", later)):
            job = await client.insert(
                {"name": name}, kind=name, queue=queue, run_at=run_at, tags=["x"]
            )
            made.ids[name] = job.id
        await _ended(client, made)
        made.ids["cancelled_admin"] = (
            await client.insert({"name": "c"}, kind="idle", queue="idle_q", run_at=later)
        ).id
        await client.cancel(made.ids["cancelled_admin"])
        for kind, queue in (("hold", "run_q"), ("hold_compact", "compact_q"), ("waits", "run_q")):
            made.ids[kind] = (await client.insert({"name": kind}, kind=kind, queue=queue)).id
            for _ in range(int(WAIT / 0.02)):
                if made.ids[kind] in holding:
                    break
                await asyncio.sleep(0.02)  # the runtime's own pace: its claim, then the handler
            else:
                raise AssertionError(f"the runtime did not hold {kind} within {WAIT:.0f} s")
        await until_idle_but(client, 2)
        try:
            await client.move_failed_to_dlq(made.ids["final_dlq"], "moved by the test")
        except Exception as exc:  # the canonical plane has no DLQ
            made.dlq_refused = str(exc)
        made.held = list(holding)
        await asyncio.to_thread(compare, made)
    finally:
        release.set()
        await client.shutdown()
        await client.close()
        leader.close()
    return made


async def until_idle_but(client: awa.AsyncClient, held: int) -> None:
    """Until the runtime holds no job but the *held* ones its handlers wait in."""
    for _ in range(int(WAIT / 0.01)):
        health = await client.health_check()
        if sum(q.in_flight for q in health.queues.values()) <= held:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the runtime kept jobs in flight")
