"""The awa-pg worker process of part ``handlers`` (:mod:`bench.handlers`), one per plane and
concurrency: ``python -m bench.handler_worker CONFIG``.

A process of its own so that its CPU (the runtime's threads and the handlers' event loop) is
read from ``/proc`` apart from the harness's. Its handlers connect as their own role, so that
``pg_stat_statements`` tells their statements from the runtime's. It takes its orders on
stdin, one a line (``arm KIND N``, ``stop``), and answers on stdout: ``ready`` once started,
``armed``, then ``done MONOTONIC ERRORS`` when N jobs of KIND have been handled and the runtime
holds none (its completion of the last one handed over), the clock comparable with the
harness's (``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import awa
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from awa_sa import Complete, Stale
from awa_sa.asyncio import attempt_of, settle

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "bench_handlers"
ROWS = sa.table("bench_rows", sa.column("order_id"), sa.column("job_id"))
"""The service's own table."""


class AlreadySettled(Exception):
    """Settled elsewhere (a rescue, a cancel): this attempt's rows must not commit."""


class Handlers:
    """The handlers, each counted as it ends, on the service's own AsyncEngine."""

    def __init__(self, service_url: str, concurrency: int) -> None:
        # A connection for every handler at once: none waits on the pool.
        self.engine = create_async_engine(service_url, pool_size=concurrency, max_overflow=0)
        self.kind = ""
        self.target = 0
        self.handled = 0
        self.errors = 0
        self.reached = asyncio.Event()

    def counted(self, kind: str, body: Callable[[Any], Awaitable[None]]) -> Any:
        async def handler(job: Any) -> None:
            try:
                await body(job)
            except Exception:
                self.errors += 1
                raise
            finally:
                if kind == self.kind:
                    self.handled += 1
                    if self.handled == self.target:
                        self.reached.set()

        return handler

    async def instant(self, job: Any) -> None:
        """Returns at once: the runtime completes the job."""

    async def at_least_once(self, job: Any) -> None:
        """One business row in its own transaction, then the runtime completes the job."""
        async with self.engine.begin() as conn:
            await conn.execute(ROWS.insert().values(order_id=job.args["n"], job_id=job.id))

    async def recipe(self, job: Any) -> None:
        """The README's handler: the row and the job's end in one transaction."""
        async with self.engine.begin() as conn:  # one transaction: your rows and the job's end
            await conn.execute(ROWS.insert().values(order_id=job.args["n"], job_id=job.id))
            if isinstance(await settle(conn, job, Complete()), Stale):
                raise AlreadySettled(job.id)  # rolls the rows back with it

    async def recipe_attempt(self, job: Any) -> None:
        """The recipe by the attempt: ``attempt_of`` first, the row, then ``settle`` of it."""
        async with self.engine.begin() as conn:
            mine = await attempt_of(conn, job)
            await conn.execute(ROWS.insert().values(order_id=job.args["n"], job_id=job.id))
            if isinstance(await settle(conn, mine, Complete()), Stale):
                raise AlreadySettled(job.id)


HANDLERS = ("instant", "at_least_once", "recipe", "recipe_attempt")
HISTORY_KIND = "history"
"""The jobs that grow the cluster's history: the returns-at-once handler's."""


async def main(config: dict[str, Any]) -> None:
    concurrency = int(config["concurrency"])
    worker = Handlers(config["service_url"], concurrency)
    client = awa.AsyncClient(config["runtime_url"])
    for kind in (*HANDLERS, HISTORY_KIND):
        body = getattr(worker, kind if kind in HANDLERS else "instant")
        client.task(dict, kind=kind, queue=QUEUE)(worker.counted(kind, body))
    await client.start([(QUEUE, concurrency)])
    loop = asyncio.get_running_loop()
    say("ready")
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "stop":
                return
            worker.kind, worker.target = line[1], int(line[2])
            worker.handled = worker.errors = 0
            worker.reached.clear()
            say("armed")
            profile = _profiler(worker.kind)
            await worker.reached.wait()
            if profile is not None:
                profile.disable()
                profile.dump_stats(f"{os.environ[PROFILE]}.{worker.kind}")
            while any(q.in_flight for q in (await client.health_check()).queues.values()):
                await asyncio.sleep(0.002)  # the runtime's last completion, at its own pace
            say(f"done {time.monotonic()} {worker.errors}")
    finally:
        await client.shutdown()
        await client.close()
        await worker.engine.dispose()


PROFILE = "AWA_SA_BENCH_PROFILE"
"""A path prefix: where set, each run's handlers are profiled (cProfile) to PREFIX.KIND."""


def _profiler(kind: str) -> cProfile.Profile | None:
    if not os.environ.get(PROFILE):
        return None
    profile = cProfile.Profile()
    profile.enable()
    return profile


def say(line: str) -> None:
    print(line, flush=True)


WAIT_S = 300.0
"""A hung worker's bound, per run."""


class Worker:
    """The harness's side of the worker process: its orders, its answers, its CPU."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in __exit__
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.handler_worker", json.dumps(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self._buffer = b""
        self._expect("ready", 120)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *_: object) -> None:
        try:
            self._send("stop")
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.log.close()

    def cpu(self) -> float:
        """The process's CPU seconds so far, every thread (the runtime's and the loop's)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def arm(self, kind: str, n: int) -> None:
        self._send(f"arm {kind} {n}")
        self._expect("armed", 60)

    def done(self) -> tuple[float, int]:
        """When the worker was done (its monotonic clock, the harness's too), and the errors."""
        _, at, errors = self._expect("done", WAIT_S).split()
        return float(at), int(errors)

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        self.process.stdin.flush()

    def _expect(self, word: str, timeout: float) -> str:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                self.log.seek(0)
                said = self.log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"the worker did not say {word!r} (it said: {said})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        text = line.decode()
        if not text.startswith(word):
            raise RuntimeError(f"the worker said {text!r}, not {word!r}")
        return text


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
