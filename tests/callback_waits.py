"""Twin clusters whose jobs a real awa-pg handler parked on a callback, in a chosen phase.

Shared by the callback tests (``test_callbacks*.py``). Each twin is a clone of the ``awa
migrate`` template with the maintenance leadership held (:func:`administering.twin`: nothing
promotes or rescues behind a comparison). On each, the same jobs get the same ids; a real
handler registers a callback (some flush a progress first) and returns ``WaitForCallback``:

* ``canonical``: the jobs enqueued before the worker starts, so it does not finalize the
  cluster: ``awa.jobs_hot`` rows in ``waiting_external``;
* ``mixed_transition``: a canonical job enqueued first, then the real CLI prepares queue storage
  in ``awa_qs`` and flips the cluster; a ``queue_storage_target`` worker parks each job, one at a
  time (so the twins' receipts match), as an ``awa_qs.leases`` row;
* ``active``: the worker starts first and auto-finalizes the cluster to queue storage in
  ``awa``; each job parked one at a time, as an ``awa.leases`` row; queue ``cbc_q`` has no
  deadline, so its jobs were claimed under compact receipts.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import awa
import sqlalchemy as sa
from administering import masked, pg_call, same_job, twin
from conftest import QUIESCED_FLIP, run_awa
from runtimes import pg_url, until_idle

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

Phase = Literal["canonical", "mixed_transition", "active"]
PHASES: tuple[Phase, ...] = ("canonical", "mixed_transition", "active")
SCHEMA: dict[Phase, str | None] = {
    "canonical": None,
    "mixed_transition": "awa_qs",
    "active": "awa",
}
"""Where each phase's waits are: ``awa.jobs_hot``, or that schema's ``leases``."""
CHANNELS = ("awa:cancel", "awa:cb_q", "awa:cbc_q", "awa:idle_q")
QUEUES: list[dict[str, Any]] = [
    {"name": "cb_q", "max_workers": 4},  # the default deadline: a ``lease_claims`` receipt
    {"name": "cbc_q", "max_workers": 1, "deadline_duration_ms": 0},  # compact receipts
]


def on_pg(call: Callable[[awa.AsyncClient], Any]) -> Callable[[awa.AsyncClient], Any]:
    """*call*, with awa-pg's "callback not found" read as None."""

    async def answered(client: awa.AsyncClient) -> Any:
        try:
            return await call(client)
        except awa.CallbackNotFound:
            return None

    return answered


CALLS: dict[str, tuple[Any, Any]] = {
    "complete": (
        lambda c, cb: c.complete_external(cb, {"paid": True}),
        lambda conn, cb: awa_sa.complete_external(conn, cb, {"paid": True}),
    ),
    "fail": (
        lambda c, cb: c.fail_external(cb, "card declined"),
        lambda conn, cb: awa_sa.fail_external(conn, cb, "card declined"),
    ),
    "retry": (
        lambda c, cb: c.retry_external(cb),
        awa_sa.retry_external,
    ),
    "resume": (
        lambda c, cb: c.resume_external(cb, {"ok": [1, "two"]}),
        lambda conn, cb: awa_sa.resume_external(conn, cb, {"ok": [1, "two"]}),
    ),
    "heartbeat": (
        lambda c, cb: c.heartbeat_callback(cb, 120.5),
        lambda conn, cb: awa_sa.heartbeat_callback(conn, cb, 120.5),
    ),
}
"""Each verb ending a wait, as awa-pg's ``AsyncClient`` and as awa-sa call it."""


@dataclass
class Parked:
    phase: Phase
    urls: tuple[str, str]
    engines: tuple[sa.Engine, sa.Engine]
    ids: list[int]

    @property
    def schemas(self) -> tuple[str, ...]:
        return ("awa", "awa_qs") if self.phase == "mixed_transition" else ("awa",)

    def job(self, n: int) -> int:
        """The id of the *n*-th job parked (from 1)."""
        return self.ids[n - 1]

    def callback_id(self, side: int, n: int) -> str | None:
        """The *n*-th job's callback id on twin *side*, or None when it waits on none."""
        return callback_of(self.engines[side], self.phase, self.job(n))


def callback_of(engine: sa.Engine, phase: Phase, job_id: int) -> str | None:
    schema = SCHEMA[phase]
    table = "awa.jobs_hot WHERE id" if schema is None else f"{schema}.leases WHERE job_id"
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(f"SELECT callback_id::text FROM {table} = :i ORDER BY run_lease DESC"),
            {"i": job_id},
        ).first()
    return None if found is None else found[0]


def waiting(engine: sa.Engine, phase: Phase) -> int:
    schema = SCHEMA[phase]
    table = "awa.jobs_hot" if schema is None else f"{schema}.leases"
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(f"SELECT count(*) FROM {table} WHERE state = 'waiting_external'")
        )
        return int(found.scalar_one())


async def handler(job: Any) -> Any:
    """Registers a callback (after a flushed progress when asked; with the CEL expressions of
    its ``cel`` argument, if any) and parks on it."""
    if job.args.get("progress"):
        job.set_progress(50, "half way")
        await job.flush_progress()
    token = await job.register_callback(timeout_seconds=3600, **job.args.get("cel", {}))
    return awa.WaitForCallback(token)


async def warm(job: Any) -> None:
    """A job completed first in mixed_transition: the first claim of a ``queue_storage_target``
    runtime there cannot register a callback (awa-pg 0.6.9 answers "job is not in running
    state"), every later one can."""


async def until_claimed(engine: sa.Engine, schema: str) -> None:
    def claimed() -> int:
        with engine.connect() as conn:
            found = conn.execute(sa.text(f"SELECT count(*) FROM {schema}.lease_claims"))
            return int(found.scalar_one())

    for _ in range(1200):
        if await asyncio.to_thread(claimed):
            return
        await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
    raise AssertionError("the warm-up job was not claimed within 60 s")


async def until_parked(engine: sa.Engine, phase: Phase, count: int) -> None:
    for _ in range(1200):
        if await asyncio.to_thread(waiting, engine, phase) >= count:
            return
        await asyncio.sleep(0.05)  # the worker's own pace: no lock to watch here
    raise AssertionError(f"{count} jobs were not parked within 60 s")


async def park(
    url: str, engine: sa.Engine, phase: Phase, jobs: Sequence[dict[str, Any]]
) -> list[int]:
    """*jobs* (each its insert options, ``progress``, ``cel`` and ``queue`` too) parked in
    *phase*."""
    client = awa.AsyncClient(pg_url(url))
    client.task(dict, kind="waits", queue="cb_q")(handler)
    client.task(dict, kind="waits", queue="cbc_q")(handler)
    client.task(dict, kind="warm", queue="cb_q")(warm)
    start: dict[str, Any] = {"promote_interval_ms": 600_000, "heartbeat_interval_ms": 600_000}
    if phase == "mixed_transition":
        start |= {
            "queue_storage_schema": "awa_qs",
            "storage_transition_role": "queue_storage_target",
        }
    ids: list[int] = []

    async def insert(n: int, options: dict[str, Any]) -> None:
        given = dict(options)
        args: dict[str, Any] = {"n": n, "progress": given.pop("progress", False)}
        if "cel" in given:
            args["cel"] = given.pop("cel")
        given.setdefault("queue", "cb_q")
        job = await client.insert(args, kind="waits", **given)
        ids.append(job.id)

    try:
        if phase == "canonical":  # enqueued first: the worker does not finalize the cluster
            for n, options in enumerate(jobs, start=1):
                await insert(n, options)
            await client.start(QUEUES, **start)
            await until_parked(engine, phase, len(jobs))
        elif phase == "active":
            await client.start(QUEUES, **start)
            for n, options in enumerate(jobs, start=1):
                await insert(n, options)
                await until_parked(engine, phase, n)
        else:
            await client.insert({"w": 0}, kind="warm", queue="cb_q")  # see :func:`warm`
            await client.start(QUEUES, **start)
            await until_claimed(engine, "awa_qs")
            await until_idle(client)
            for n, options in enumerate(jobs, start=1):
                await insert(n, options)
                await until_parked(engine, phase, n)
    finally:
        await client.shutdown()
        await client.close()
    return ids


def flip(pg: EmbeddedPostgres, url: str) -> None:
    """A canonical job first (``awa.jobs_hot`` id 1, on a queue no worker serves), then the
    real CLI's prepare and quiesced flip to mixed_transition, routing to ``awa_qs``."""
    pg_call(url, lambda c: c.insert({"n": 0}, kind="before", queue="idle_q"))
    dbname = sa.make_url(url).database or ""
    details = '{"schema": "awa_qs"}'
    run_awa(pg, dbname, "storage", "prepare", "--engine", "queue_storage", "--details", details)
    run_awa(pg, dbname, *QUIESCED_FLIP)


def routing(engine: sa.Engine) -> tuple[str, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT state, awa.active_queue_storage_schema() FROM awa.storage_transition_state"
            )
        ).one()
    return str(row[0]), row[1]


@contextmanager
def parked_twins(
    pg: EmbeddedPostgres,
    databases: Databases,
    template: str,
    phase: Phase,
    jobs: Sequence[dict[str, Any]],
) -> Iterator[Parked]:
    with ExitStack() as stack:
        urls, engines, made = [], [], []
        for _ in range(2):
            url, engine = twin(stack, pg, databases, template)
            if phase == "mixed_transition":
                flip(pg, url)
            made.append(asyncio.run(park(url, engine, phase, jobs)))
            assert routing(engine) == (phase, SCHEMA[phase])
            urls.append(url)
            engines.append(engine)
        assert made[0] == made[1]
        yield Parked(phase, (urls[0], urls[1]), (engines[0], engines[1]), made[0])


def strict(a: Any, b: Any) -> bool:
    """Equal, type for type (``1``, ``1.0`` and ``True`` apart, a float's sign too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(strict, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict(a[k], b[k]) for k in a)
    return bool(a == b)


def same_answer(got: Any, theirs: Any) -> None:
    """awa-sa's ``Resolved`` says what awa-pg's ``ResolveResult`` says: outcome, reason, the
    payload type for type, the job and its errors (clocks masked)."""
    assert (got.outcome, got.reason) == (theirs.outcome, theirs.reason)
    assert strict(got.payload, theirs.payload), (got.payload, theirs.payload)
    if theirs.job is None:
        assert got.job is None
        return
    assert got.job is not None
    same_job(got.job, theirs.job)
    ours, awa_pg = (json.dumps(job.errors, sort_keys=True) for job in (got.job, theirs.job))
    assert masked(ours) == masked(awa_pg)
