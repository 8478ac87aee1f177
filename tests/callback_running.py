"""Twin clusters whose jobs a real awa-pg handler holds ``running`` on a registered callback.

For the comparisons of a callback that arrives before the handler returned ``WaitForCallback``
(``test_callback_running.py``). As :mod:`callback_waits`, each twin is a clone of the ``awa
migrate`` template with the maintenance leadership held, in a chosen phase, its jobs given the
same ids; but here the twin's awa-pg worker stays live on a loop of its own thread, and its
handler registers the callback (after a flushed progress when asked; with the CEL expressions
of its ``cel`` argument, if any), tells the test, then awaits a gate the test opens: until
then the wait is ``running`` with its callback columns (``awa.jobs_hot`` in canonical, a
materialised ``leases`` row in queue storage). Once opened, the handler returns
``WaitForCallback`` and the runtime does with it what it does.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import awa
import sqlalchemy as sa
from administering import twin
from callback_waits import QUEUES, SCHEMA, Phase, flip, routing, until_claimed, warm
from runtimes import pg_url, until_idle

from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

TIMEOUT = 120.0


@dataclass
class Holder:
    """A live awa-pg worker whose ``holds`` handlers wait at a gate after registering."""

    url: str
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    runs: Counter[int] = field(default_factory=Counter)
    registered: dict[int, threading.Event] = field(default_factory=dict)
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    client: Any = None

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def open(self) -> None:
        """The client, its tasks registered, not started (canonical enqueues first)."""
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def made() -> None:
            self.client = awa.AsyncClient(pg_url(self.url))
            self.client.task(dict, kind="holds", queue="cb_q")(self.holds)
            self.client.task(dict, kind="warm", queue="cb_q")(warm)
            self.client.task(dict, kind="sentinel", queue="cb_q")(self.sentinel)

        self.call(made())

    def start(self, phase: Phase) -> None:
        start: dict[str, Any] = {"promote_interval_ms": 600_000, "heartbeat_interval_ms": 600_000}
        if phase == "mixed_transition":
            start |= {
                "queue_storage_schema": "awa_qs",
                "storage_transition_role": "queue_storage_target",
            }
        queues = [{**QUEUES[0], "max_workers": 16}]
        self.call(self.client.start(queues, **start))

    def stop(self) -> None:
        if self.client is None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            return
        for job_id in list(self.gates):
            self.release(job_id)

        async def stop() -> None:
            await self.client.shutdown()
            await self.client.close()

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def holds(self, job: Any) -> Any:
        """Registers a callback, tells the test, holds the attempt ``running`` until the test
        opens its gate, then parks; a second run (never expected) just completes."""
        self.runs[job.id] += 1
        if self.runs[job.id] > 1:
            return None
        gate = self.gates.setdefault(job.id, asyncio.Event())
        if job.args.get("progress"):
            job.set_progress(50, "half way")
            await job.flush_progress()
        token = await job.register_callback(timeout_seconds=3600, **job.args.get("cel", {}))
        self.registered.setdefault(job.id, threading.Event()).set()
        await gate.wait()
        return awa.WaitForCallback(token)

    async def sentinel(self, job: Any) -> None:
        self.runs[job.id] += 1

    def release(self, job_id: int) -> None:
        gate = self.gates.setdefault(job_id, asyncio.Event())
        self.loop.call_soon_threadsafe(gate.set)

    def held(self, job_id: int) -> None:
        """Until the handler of *job_id* registered its callback (an event it sets)."""
        event = self.registered.setdefault(job_id, threading.Event())
        assert event.wait(TIMEOUT), f"job {job_id} did not register within {TIMEOUT:.0f} s"

    def insert(self, kind: str, args: dict[str, Any], options: dict[str, Any] | None = None) -> int:
        async def insert() -> int:
            given = options or {}
            job = await self.client.insert(args, kind=kind, queue="cb_q", **given)
            return int(job.id)

        return int(self.call(insert()))

    def idle(self) -> None:
        self.call(until_idle(self.client))


@dataclass
class Running:
    phase: Phase
    urls: tuple[str, str]
    engines: tuple[sa.Engine, sa.Engine]
    holders: tuple[Holder, Holder]
    ids: list[int]
    done: dict[str, Any] = field(default_factory=dict)
    """What each comparison made of its job (so a later test can run one not yet run)."""

    @property
    def schemas(self) -> tuple[str, ...]:
        return ("awa", "awa_qs") if self.phase == "mixed_transition" else ("awa",)

    def job(self, n: int) -> int:
        return self.ids[n - 1]

    def wait(self, side: int, n: int) -> tuple[str, str | None] | None:
        """The *n*-th job's wait on twin *side*: its state and callback id, or None."""
        return wait_of(self.engines[side], self.phase, self.job(n))


def wait_of(engine: sa.Engine, phase: Phase, job_id: int) -> tuple[str, str | None] | None:
    schema = SCHEMA[phase]
    table = "awa.jobs_hot WHERE id" if schema is None else f"{schema}.leases WHERE job_id"
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(f"SELECT state::text, callback_id::text FROM {table} = :i"), {"i": job_id}
        ).first()
    return None if found is None else (str(found[0]), found[1])


def _hold(
    holder: Holder, engine: sa.Engine, phase: Phase, jobs: Sequence[dict[str, Any]]
) -> list[int]:
    def args(n: int, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        given = dict(options)
        made: dict[str, Any] = {"n": n, "progress": given.pop("progress", False)}
        if "cel" in given:
            made["cel"] = given.pop("cel")
        return made, given

    holder.open()
    ids: list[int] = []
    if phase == "canonical":  # enqueued first: the worker does not finalize the cluster
        for n, options in enumerate(jobs, start=1):
            ids.append(holder.insert("holds", *args(n, options)))
        holder.start(phase)
        for job_id in ids:
            holder.held(job_id)
        return ids
    if phase == "mixed_transition":  # see :func:`callback_waits.warm`
        holder.insert("warm", {"w": 0})
        holder.start(phase)
        holder.call(until_claimed(engine, "awa_qs"))
        holder.idle()
    else:
        holder.start(phase)
    for n, options in enumerate(jobs, start=1):  # one at a time: the twins' receipts match
        ids.append(holder.insert("holds", *args(n, options)))
        holder.held(ids[-1])
    return ids


@contextmanager
def running_twins(
    pg: EmbeddedPostgres,
    databases: Databases,
    template: str,
    phase: Phase,
    jobs: Sequence[dict[str, Any]],
) -> Iterator[Running]:
    """Two twins in *phase*, each with a live worker holding *jobs* ``running`` on their
    callbacks; every gate opened and the workers stopped on exit."""
    with ExitStack() as stack:
        urls, engines, holders, made = [], [], [], []
        for _ in range(2):
            url, engine = twin(stack, pg, databases, template)
            if phase == "mixed_transition":
                flip(pg, url)
            holder = Holder(url)
            stack.callback(holder.stop)
            made.append(_hold(holder, engine, phase, jobs))
            assert routing(engine) == (phase, SCHEMA[phase])
            assert all(wait_of(engine, phase, i) for i in made[-1])
            urls.append(url)
            engines.append(engine)
            holders.append(holder)
        assert made[0] == made[1]
        yield Running(
            phase, (urls[0], urls[1]), (engines[0], engines[1]), (holders[0], holders[1]), made[0]
        )
