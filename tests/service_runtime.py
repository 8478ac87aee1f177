"""One real awa-pg 0.6.9 runtime of the service soak, in a process of its own (service_soak.py).

``python tests/service_runtime.py CONFIG_JSON`` starts an ``awa.AsyncClient`` with the role the
soak gives it, serves the soak's two queues until SIGTERM, then shuts down as a deployment
stops a worker. Each handler is the service's: in one transaction it finds its attempt
(``attempt_of``), reads how far its job's plan got (the service's own committed rows), settles
the attempt with awa-sa and writes its business row (``svc_effects``); some enqueue a follow-up
job in that transaction (with its own ``svc_requests`` row). ``Stale`` rolls it all back. A
share of the ``slow`` queue's first attempts sleep past the queue's short deadline, so the
runtime's deadline rescue races the settle from either side.

Every run is appended to the process's log (JSON lines): what the handler saw and answered,
read back by service_checks.py. Kept in a file, not a table: a rolled-back run leaves no row.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import awa
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import (
    AttemptNotFound,
    AwaSAError,
    Cancel,
    Complete,
    Ending,
    Fail,
    Migrated,
    Rescheduled,
    Result,
    RetryAfter,
    Snooze,
    Stale,
    attempt_of,
)

KIND = "svc"
PLANS: dict[str, tuple[tuple[str, ...], int, str, int]] = {
    "complete": (("complete",), 40, "svc", 25),
    "fail": (("fail",), 8, "svc", 3),  # always a retryable failure: to the final attempt
    "terminal": (("terminal",), 4, "svc", 25),
    "cancel": (("cancel",), 6, "svc", 25),
    "snooze": (("snooze", "complete"), 8, "svc", 25),
    "retry_after": (("retry_after", "complete"), 8, "svc", 25),
    "followup": (("followup",), 8, "svc", 25),
    "slow": (("complete",), 18, "slow", 5),  # the first run may outlive the deadline
    "callback": (("complete",), 0, "svc", 3),  # parks; the final attempt completes (below)
}
"""plan -> (the result of each run in order, share per 100, queue, max_attempts). The
``callback`` plan's share is the soak's own (``SoakConfig.callbacks``): its runs before the last
attempt park on a callback (``Service.park``), the last settles as ``complete`` does, so a wait
the timeout rescue ends is run again, never failed by it without a business row. Only a
queue-storage job parks; a canonical one completes at once: a canonical wait still parked at
the flip is found by no receiver (awa-pg's calls and awa-sa's look where routing points), its
timeout rescue makes it a canonical ``retryable`` job, and with a canonical runtime holding the
maintenance leadership awa-pg 0.6.9 left such jobs unpromoted in ``mixed_transition``, so the
``finalize`` gate refused for good (seen at ``--jobs 13000``)."""
assert sum(p[1] for p in PLANS.values()) == 100

QS_ID_BASE = 100_000_000
"""The queue-storage schema's ``job_id_seq`` starts here (service_soak.py): an id names its plane
(both sequences start at 1 otherwise, and ids collide during the mixed window)."""

CALLBACK_TIMEOUTS_MS = {500: 30, 4000: 70}
"""A wait's callback timeout -> its share: a receiver answers within RECEIVER_DELAY_S
(service_receiver.py), so the short ones race the runtime's callback-timeout rescue."""

SLOW_DEADLINE_MS = 500
QUEUES = [
    {"name": "svc", "max_workers": 16, "deadline_duration_ms": 60_000},
    {"name": "slow", "max_workers": 8, "deadline_duration_ms": SLOW_DEADLINE_MS},
]

RESULTS: dict[str, Result] = {
    "complete": Complete(),
    "followup": Complete(),
    "fail": Fail("soak: transient"),
    "terminal": Fail("soak: terminal", terminal=True),
    "cancel": Cancel("soak"),
    "snooze": Snooze(0.3),
    "retry_after": RetryAfter(0.3),
}

EFFECTS = sa.table(
    "svc_effects",
    *(sa.column(c) for c in ("token", "job_id", "run_lease", "attempt", "storage", "ending")),
    *(sa.column(c) for c in ("state", "new_job_id", "runtime")),
)
TABLES = """
CREATE TABLE svc_requests (id bigserial PRIMARY KEY, token text NOT NULL, job_id bigint NOT NULL,
    how text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE svc_effects (id bigserial PRIMARY KEY, token text NOT NULL, job_id bigint NOT NULL,
    run_lease bigint NOT NULL, attempt int NOT NULL, storage text NOT NULL, ending text NOT NULL,
    state text NOT NULL, new_job_id bigint, runtime text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX ON svc_effects (token);
CREATE TABLE svc_callbacks (id bigserial PRIMARY KEY, callback_id text NOT NULL UNIQUE,
    token text NOT NULL, job_id bigint NOT NULL, run_lease bigint NOT NULL, attempt int NOT NULL,
    storage text NOT NULL, timeout_ms int NOT NULL, runtime text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE svc_receipts (id bigserial PRIMARY KEY, callback_id text NOT NULL,
    receiver text NOT NULL, action text NOT NULL, job_id bigint, run_lease bigint, state text,
    storage text, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE svc_admin (id bigserial PRIMARY KEY, verb text NOT NULL, job_id bigint,
    answer text NOT NULL, state text, run_lease bigint, storage text,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
"""
"""The service's own tables: its requests, its handlers' effects, the callbacks they parked on,
its receivers' rows (service_receiver.py), its admin's actions."""

REQUESTS = sa.table("svc_requests", sa.column("token"), sa.column("job_id"), sa.column("how"))
CALLBACKS = sa.table(
    "svc_callbacks",
    *(sa.column(c) for c in ("callback_id", "token", "job_id", "run_lease", "attempt")),
    *(sa.column(c) for c in ("storage", "timeout_ms", "runtime")),
)


def state_of(result: Result, ending: Ending) -> str:
    """The job's state as this settle left it (the business row's claim)."""
    if isinstance(ending, Rescheduled | Migrated):
        return "scheduled" if isinstance(result, Snooze) else "retryable"
    return {"Completed": "completed", "Cancelled": "cancelled", "Failed": "failed"}.get(
        type(ending).__name__, type(ending).__name__
    )


class Service:
    def __init__(self, config: dict[str, Any]) -> None:
        self.name = config["name"]
        self.engine = create_async_engine(
            config["sa_url"], pool_size=24, max_overflow=4, **config.get("engine_options", {})
        )
        self.log = Path(config["log"]).open("a", buffering=1)  # noqa: SIM115  # closed by main()

    def record(self, **run: Any) -> None:
        self.log.write(json.dumps(run, default=str) + "\n")

    async def handle(self, job: Any) -> Any:
        plan, token = job.args["plan"], job.args["t"]
        run: dict[str, Any] = {"rt": self.name, "job": job.id, "attempt": job.attempt}
        run |= {"token": token, "plan": plan, "t0": time.time()}
        if plan == "callback" and job.attempt < PLANS[plan][3] and job.id >= QS_ID_BASE:
            try:
                return await self.park(job, token, run)
            finally:
                run["t1"] = time.time()
                self.record(**run)
        if plan == "slow" and job.attempt == 1:
            # About the deadline: settled within a rescue interval of it, from either side.
            nap = random.Random(token).uniform(0.7, 1.3) * SLOW_DEADLINE_MS / 1000
            run["slept"] = nap
            await asyncio.sleep(nap)
        try:
            async with self.engine.connect() as conn:
                await self.settle(conn, job, plan, token, run)
        except AwaSAError as exc:  # recorded for the checks, then the runtime retries it
            run["answer"] = f"error:{type(exc).__name__}"
            run["message"] = str(exc)[:300]
            raise
        finally:
            run["t1"] = time.time()
            self.record(**run)

    async def park(self, job: Any, token: str, run: dict[str, Any]) -> Any:
        """Registers a callback with awa-pg's own ``Job`` API, then records it for the receivers
        in the service's transaction (with the attempt's lease, from ``attempt_of``), and parks.
        A wait whose attempt is already gone is not recorded: nobody will call it back."""
        ms = random.choices(list(CALLBACK_TIMEOUTS_MS), list(CALLBACK_TIMEOUTS_MS.values()))[0]
        run["timeout_ms"] = ms
        try:
            callback = await job.register_callback(timeout_seconds=ms / 1000)
        except Exception as exc:  # awa-pg's refusal, recorded for the checks
            run["answer"] = "register refused"
            run["message"] = f"{type(exc).__name__}: {exc}"[:300]
            raise
        run["callback"] = str(callback.id)
        async with self.engine.connect() as conn, conn.begin() as tx:
            try:
                found = await conn.run_sync(attempt_of, job)
            except AttemptNotFound:
                run["answer"] = "AttemptNotFound"  # rescued or cancelled since it was claimed
                await tx.rollback()
                return awa.WaitForCallback(callback)
            run["lease"], run["storage"] = found.run_lease, found.storage
            row = {"callback_id": run["callback"], "token": token, "job_id": job.id}
            row |= {"run_lease": found.run_lease, "attempt": found.attempt}
            row |= {"storage": found.storage, "timeout_ms": ms, "runtime": self.name}
            await conn.execute(sa.insert(CALLBACKS).values(**row))
        run["answer"] = "Parked"
        return awa.WaitForCallback(callback)

    async def settle(
        self, conn: AsyncConnection, job: Any, plan: str, token: str, run: dict[str, Any]
    ) -> None:
        async with conn.begin() as tx:
            try:
                found = await conn.run_sync(attempt_of, job)
            except AttemptNotFound:
                run["answer"] = "AttemptNotFound"  # rescued or cancelled before the lookup
                await tx.rollback()
                return
            run["lease"], run["storage"] = found.run_lease, found.storage
            done = (
                await conn.execute(
                    sa.text("SELECT count(*) FROM svc_effects WHERE token = :t"), {"t": token}
                )
            ).scalar_one()
            steps = PLANS[plan][0]
            step = steps[min(int(done), len(steps) - 1)]
            result = RESULTS[step]
            ending = await awa_async.settle(conn, found, result)
            run["answer"] = type(ending).__name__
            if isinstance(ending, Stale):
                await tx.rollback()
                return
            new_id = ending.job_id if isinstance(ending, Migrated) else None
            row = {"token": token, "job_id": job.id, "run_lease": found.run_lease}
            row |= {"attempt": found.attempt, "storage": found.storage, "runtime": self.name}
            row |= {"ending": run["answer"], "state": state_of(result, ending)}
            await conn.execute(sa.insert(EFFECTS).values(**row, new_job_id=new_id))
            if step == "followup":
                follow = f"{token}.f"
                made = await awa_async.enqueue(
                    conn, {"t": follow, "plan": "complete"}, kind=KIND, queue="svc"
                )
                await conn.execute(
                    sa.insert(REQUESTS).values(token=follow, job_id=made.id, how="followup")
                )
                run["followup"] = made.id


async def main(config: dict[str, Any]) -> None:
    service = Service(config)
    client = awa.AsyncClient(config["awa_url"])
    client.task(dict, kind=KIND, queue="svc")(service.handle)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    options: dict[str, Any] = dict(config.get("start", {}))
    await client.start(QUEUES, **options)
    print("started", flush=True)  # the soak waits for this line
    try:
        await stop.wait()
    finally:
        await client.shutdown(timeout_ms=5000)
        await client.close()
        await service.engine.dispose()
        service.log.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
