"""Attempts per second with 1, 4 and 16 callers, each a process with its own connection.

Processes, not threads, so that callers never queue for one interpreter lock and what is
measured is the database and the client's own CPU. Every caller takes ``FOR SHARE`` on the
same transition singleton: once two lockers overlap, PostgreSQL records them in a MultiXact,
and each further overlapping locker creates a new one holding the live members. While the
callers run, the parent samples ``pg_stat_activity`` (what the callers' backends wait on) and
reads the MultiXact SLRU counters and how many MultiXact ids were used.

On a 2-core machine the callers, their backends and the sampler share two cores, so the curve
flattens at the CPU, not at the lock; the wait events say whether the lock ever shows.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import sqlalchemy as sa

from awa_sa import reschedule_canonical_attempt
from bench.floor import psycopg_raw
from bench.workload import KIND, Jobs, canonical_texts, one_statement_text

APP = "awa-sa-bench-caller"
TRACKED = "-c pg_stat_statements.track=top"
_PATIENCE = 60.0
CALLERS = (1, 4, 16)


def _caller(
    form: str,
    url: str,
    *,
    ids: list[tuple[int, int]],
    ready: Any,
    start: Event,
    seconds: float,
    results: Any,
) -> None:
    """One caller: connect, warm up, wait for the start, reschedule until time or ids run out.

    Puts ``(attempts, seconds)`` on *results*, or the error that stopped it.
    """
    try:
        op = _op(form, url)
        supply = iter(ids)
        for _ in range(5):
            op(*next(supply))
    except BaseException as exc:
        results.put(exc)
        raise
    finally:
        ready.release()
    start.wait()
    began = time.perf_counter()
    deadline, done = began + seconds, 0
    try:
        for job_id, lease in supply:
            op(job_id, lease)
            done += 1
            if time.perf_counter() >= deadline:
                break
    except BaseException as exc:
        results.put(exc)
        raise
    results.put((done, time.perf_counter() - began))


def _op(form: str, url: str) -> Callable[[int, int], Any]:
    settings = {"application_name": APP, "options": TRACKED}
    if form == "floor":
        dsn = url.replace("+psycopg", "") + "?" + urlencode(settings, quote_via=quote)
        dialect = sa.create_engine(url).dialect
        raw = psycopg_raw(canonical_texts(dialect), one_statement_text(dialect))
        conn = psycopg.connect(dsn)
        return lambda job_id, lease: raw.four(conn, job_id, lease)
    engine = sa.create_engine(url, pool_size=1, connect_args=settings)
    return lambda job_id, lease: reschedule_canonical_attempt(engine, job_id, lease, KIND)


def run(url: str, seconds: float, rounds: int) -> dict[str, Any]:
    """Per caller count and form: attempts per second (best round), waits seen, MultiXacts used."""
    admin = sa.create_engine(url, poolclass=sa.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
    out: dict[str, Any] = {}
    try:
        for callers in CALLERS:
            for form in ("floor", "awa-sa Engine") * rounds:
                row = _round(admin, url, form, callers, seconds)
                best = out.setdefault(f"{callers} {form}", row)
                if row["per_s"] > best["per_s"]:
                    out[f"{callers} {form}"] = row
    finally:
        admin.dispose()
    return out


def _round(
    admin: sa.Engine, url: str, form: str, callers: int, seconds: float, *, rate: float = 5000
) -> dict[str, Any]:
    """One timed run of *callers* processes; *rate* bounds what they could use in total."""
    ctx = mp.get_context("fork")
    quota = int(rate * seconds / callers) + 5 + 50
    jobs = Jobs(url)
    jobs.seed(quota * callers)
    ready, start, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_caller,
            args=(form, url),
            kwargs={
                "ids": jobs.take(quota),
                "ready": ready,
                "start": start,
                "seconds": seconds,
                "results": results,
            },
            daemon=True,
        )
        for _ in range(callers)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        if not ready.acquire(timeout=_PATIENCE):
            raise RuntimeError(f"{form}: a caller never got ready")
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        before = _counters(conn)
        start.set()
        waits = _sample(conn, results, callers, time.monotonic() + seconds + _PATIENCE)
        after = _counters(conn)
        server_us = _statement_times(conn)
    finished = [results.get(timeout=_PATIENCE) for _ in procs]
    for proc in procs:
        proc.join(timeout=_PATIENCE)
    for item in finished:
        if isinstance(item, BaseException):
            raise RuntimeError(f"{form}: a caller failed: {item!r}") from item
    done = sum(n for n, _ in finished)
    return {
        "per_s": done / max(t for _, t in finished),
        "waits": waits,
        "multixacts_per_attempt": (after["mxids"] - before["mxids"]) / done,
        "server_us": server_us,
        "slru": {k: after[k] - before[k] for k in after if k != "mxids"},
    }


def _counters(conn: sa.Connection) -> dict[str, int]:
    """MultiXact ids used so far in this database, and the MultiXact SLRU block counters."""
    mxids = conn.execute(
        sa.text("SELECT mxid_age(datminmxid) FROM pg_database WHERE datname = current_database()")
    ).scalar_one()
    slru = conn.execute(
        sa.text(
            "SELECT name, blks_zeroed, blks_hit, blks_read, blks_written FROM pg_stat_slru"
            " WHERE name LIKE 'MultiXact%'"
        )
    ).all()
    conn.rollback()
    out = {"mxids": int(mxids)}
    for name, *values in slru:
        for column, value in zip(("zeroed", "hit", "read", "written"), values, strict=True):
            out[f"{name} {column}"] = int(value)
    return out


def _statement_times(conn: sa.Connection) -> dict[str, float]:
    """Mean server time of the lock, the move, or the one statement while the callers ran, µs."""
    rows = conn.execute(
        sa.text(
            "SELECT query, mean_exec_time FROM pg_stat_statements s JOIN pg_database d"
            " ON d.oid = s.dbid WHERE d.datname = current_database() AND calls > 0"
        )
    ).all()
    conn.rollback()
    out: dict[str, float] = {}
    for query, mean_ms in rows:
        if "to_regprocedure(" in query:
            out["one statement"] = mean_ms * 1000
        elif "FOR SHARE" in query:
            out["lock"] = mean_ms * 1000
        elif query.startswith("WITH head"):
            out["move"] = mean_ms * 1000
    return out


def _sample(conn: sa.Connection, results: Any, callers: int, give_up: float) -> dict[str, float]:
    """Share of samples of the callers' backends in each state, until the callers are done."""
    seen: Counter[str] = Counter()
    query = sa.text(
        "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
        " WHERE application_name = :app"
    )
    while results.qsize() < callers and time.monotonic() < give_up:
        for state, kind, event in conn.execute(query, {"app": APP}):
            if state == "idle in transaction" or (kind == "Client" and event == "ClientRead"):
                seen["waiting for the client"] += 1
            elif kind is None:
                seen["on CPU"] += 1
            else:
                seen[f"{kind}:{event}"] += 1
        conn.rollback()  # each sample a fresh snapshot of pg_stat_activity
        time.sleep(0.005)
    total = sum(seen.values()) or 1
    return {name: n / total for name, n in seen.most_common()}
