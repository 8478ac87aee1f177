"""What the twin-cluster comparisons of the administering verbs share (issue 37).

A twin comparison runs awa-pg 0.6.9's own ``Client`` method on one cluster and awa-sa's call on
the other, in a caller's transaction that also commits a business row, then compares what
changed: every row of every table of the schemas named (partitions through their parents; the
runtimes' own liveness and claimer bookkeeping left out) and every sequence, with only the
clocks masked, and every NOTIFY sent on the channels named.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

import awa
import psycopg
import sqlalchemy as sa
from conftest import QUIESCED_FLIP, cloned, run_awa
from jobs import RUNTIME_CLOCK, plane_tables, sequences
from runtimes import hold_leadership, pg_url, rows

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

CLOCK = re.compile(
    r'"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\+00"'  # a timestamptz column
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00"  # an error entry's worker clock
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A callback id: random on each twin, so masked like a clock."""
MARKER = "awa_sa_test_step"
BOOKKEEPING = RUNTIME_CLOCK | {"runtime_storage_backends"}


class Twin(NamedTuple):
    url: str
    engine: sa.Engine


class Phase(NamedTuple):
    """A queue-storage phase twins are compared in: its routing schema, the schemas a snapshot
    reads, and what a real worker's ``start`` takes to run there."""

    name: str
    schema: str
    schemas: tuple[str, ...]
    start: dict[str, Any]


PHASES = {
    # The twin's first real runtime auto-finalizes it to queue storage in schema awa.
    "active": Phase("active", "awa", ("awa",), {}),
    # The real CLI prepares awa_qs and flips; a queue_storage_target worker runs there.
    "mixed_transition": Phase(
        "mixed_transition",
        "awa_qs",
        ("awa", "awa_qs"),
        {"queue_storage_schema": "awa_qs", "storage_transition_role": "queue_storage_target"},
    ),
}


def masked(text: str) -> str:
    return UUID.sub("UUID", CLOCK.sub("CLOCK", text))


def snapshot(engine: sa.Engine, schemas: Sequence[str] = ("awa",)) -> dict[str, list[str]]:
    """Every row of every table of *schemas* and every sequence, as text, clocks masked."""
    with engine.connect() as conn:
        out = {
            table: sorted(
                masked(text)
                for text in conn.execute(sa.text(f"SELECT t::text FROM {table} t")).scalars()
            )
            for table in plane_tables(conn, schemas, BOOKKEEPING)
        }
        out["sequences"] = [str(tuple(row)) for row in sequences(conn, schemas)]
    return out


def change(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, Any]:
    """Per table that changed: the rows gone and the rows come."""
    return {
        table: (sorted(set(before[table]) - set(rows)), sorted(set(rows) - set(before[table])))
        for table, rows in after.items()
        if rows != before.get(table)
    }


def differing(sa_change: dict[str, Any], pg_change: dict[str, Any]) -> dict[str, Any]:
    """The tables whose change differs between the twins: awa-sa's change, then awa-pg's."""
    return {
        table: (sa_change.get(table), pg_change.get(table))
        for table in sorted(set(sa_change) | set(pg_change))
        if sa_change.get(table) != pg_change.get(table)
    }


def pg_call(url: str, call: Callable[[awa.AsyncClient], Any]) -> Any:
    """*call* on a new awa-pg client of its own."""

    async def run() -> Any:
        client = awa.AsyncClient(pg_url(url))
        try:
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(run())


def heard(
    url: str, channels: Sequence[str], act: Callable[[], Any]
) -> tuple[Any, list[tuple[str, str]]]:
    """*act*'s result and the NOTIFYs it sent on *channels*, in order."""
    listener = psycopg.connect(pg_url(url), autocommit=True)
    try:
        for channel in (*channels, MARKER):
            listener.execute(f'LISTEN "{channel}"')
        got = act()
        listener.execute(f"NOTIFY {MARKER}")
        notes: list[tuple[str, str]] = []
        for note in listener.notifies(timeout=30):
            if note.channel == MARKER:
                return got, notes
            notes.append((note.channel, note.payload))
        raise AssertionError("the marker NOTIFY never arrived")
    finally:
        listener.close()


def business(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM public.business")).scalar_one())


def sa_call(engine: sa.Engine, call: Callable[[sa.Connection], Any]) -> Any:
    """*call* in a caller's transaction that also commits a business row."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('administered')"))
        return call(conn)


def twin(stack: ExitStack, pg: EmbeddedPostgres, databases: Databases, template: str) -> Twin:
    """One twin: a clone of *template* and its engine, with the maintenance leadership held
    (nothing promotes or rescues behind a comparison) and the business table callers commit
    to; closed with *stack*."""
    url = stack.enter_context(cloned(pg, databases, template))
    engine = sa.create_engine(url)
    stack.callback(engine.dispose)
    leader = hold_leadership(engine)
    stack.callback(leader.close)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE public.business (note text)"))
    return Twin(url, engine)


async def until_failed(engine: sa.Engine, job_id: int, seconds: float = 60.0) -> None:
    """Until a real worker has failed job *job_id* (polled at the worker's own pace)."""
    for _ in range(int(seconds / 0.05)):
        found = rows(engine, "SELECT state::text AS s FROM awa.jobs WHERE id = :i", i=job_id)
        if found and found[0]["s"] == "failed":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} did not fail within {seconds:.0f} s")


def twin_pair(
    pg: EmbeddedPostgres,
    databases: Databases,
    template: str,
    prepare: Callable[[Twin], Coroutine[Any, Any, Any]],
    phase: Phase = PHASES["active"],
) -> Iterator[tuple[Twin, Twin]]:
    """Two twins of *template*, each in *phase* (mixed_transition: flipped by the real CLI
    first) and made ready by *prepare* (a real worker's run, as a rule), for a module's
    fixture to ``yield from``; closed when it resumes."""
    with ExitStack() as stack:
        made = [twin(stack, pg, databases, template) for _ in range(2)]
        for side in made:
            if phase.name == "mixed_transition":
                _flip(pg, side)
            asyncio.run(prepare(side))
        yield made[0], made[1]


def _flip(pg: EmbeddedPostgres, side: Twin) -> None:
    dbname = sa.make_url(side.url).database or ""
    details = '{"schema": "awa_qs"}'
    run_awa(pg, dbname, "storage", "prepare", "--engine", "queue_storage", "--details", details)
    run_awa(pg, dbname, *QUIESCED_FLIP)
    found = rows(
        side.engine,
        "SELECT state, awa.active_queue_storage_schema() AS s FROM awa.storage_transition_state",
    )
    assert (found[0]["state"], found[0]["s"]) == ("mixed_transition", "awa_qs"), found


async def until_routed(side: Twin, phase: Phase) -> None:
    """Until the twin routes to *phase*'s schema: at once in mixed_transition, after its
    first runtime's auto-finalize on active (polled at the runtime's own pace)."""
    for _ in range(1200):
        found = rows(side.engine, "SELECT awa.active_queue_storage_schema() AS s")
        if found[0]["s"] == phase.schema:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the twin did not route to {phase.schema} within 60 s")


def pair_twins(
    pair: tuple[Twin, Twin],
    on_pg: Callable[[awa.AsyncClient], Any],
    on_sa: Callable[[sa.Connection], Any],
    *,
    schemas: Sequence[str],
    channels: Sequence[str],
) -> tuple[Any, Any, dict[str, Any], list[tuple[str, str]]]:
    """:func:`twins` on a :func:`twin_pair`: awa-pg on the first, awa-sa on the second."""
    urls, engines = (pair[0].url, pair[1].url), (pair[0].engine, pair[1].engine)
    return twins(urls, engines, on_pg, on_sa, schemas=schemas, channels=channels)


def twins(
    urls: tuple[str, str],
    engines: tuple[sa.Engine, sa.Engine],
    on_pg: Callable[[awa.AsyncClient], Any],
    on_sa: Callable[[sa.Connection], Any],
    *,
    schemas: Sequence[str],
    channels: Sequence[str],
) -> tuple[Any, Any, dict[str, Any], list[tuple[str, str]]]:
    """awa-pg's call on the first twin, awa-sa's on the second: the same rows changed and
    the same NOTIFYs sent, the business row committed. Both results, the change, the NOTIFYs."""
    before = snapshot(engines[0], schemas), snapshot(engines[1], schemas)
    paid = business(engines[1])
    got_pg, pg_heard = heard(urls[0], channels, lambda: pg_call(urls[0], on_pg))
    got_sa, sa_heard = heard(urls[1], channels, lambda: sa_call(engines[1], on_sa))
    changed = change(before[1], snapshot(engines[1], schemas))
    pg_changed = change(before[0], snapshot(engines[0], schemas))
    assert changed == pg_changed, differing(changed, pg_changed)
    assert sa_heard == pg_heard
    assert business(engines[1]) == paid + 1
    return got_pg, got_sa, changed, sa_heard


def same_job(got_sa: awa_sa.JobRow, got_pg: Any) -> None:
    """awa-sa's row after the change says what awa-pg's ``Job`` says."""
    assert (got_sa.id, got_sa.kind, got_sa.queue, got_sa.attempt, got_sa.args) == (
        got_pg.id,
        got_pg.kind,
        got_pg.queue,
        got_pg.attempt,
        got_pg.args,
    )
    assert (got_sa.tags, got_sa.metadata, got_sa.priority) == (
        got_pg.tags,
        got_pg.metadata,
        got_pg.priority,
    )
    assert got_sa.state == str(got_pg.state).rsplit(".", 1)[-1].lower()
