"""A callback that arrives before the handler parks: awa-sa writes what awa-pg 0.6.9 writes.

Twin clusters per phase (canonical, mixed_transition, active), each with a live awa-pg worker
whose handler registered a callback and is held at a gate the test opens
(:mod:`callback_running`): the wait is ``running`` with its callback columns. Each call runs by
awa-pg's ``AsyncClient`` on one twin and by awa-sa, in a caller's transaction that also commits
a business row, on the other (:mod:`administering`): every row of every table of the phase's
schemas and every sequence changed alike, the same NOTIFYs, the same answer. ``retry_external``
and ``heartbeat_callback`` take only a parked wait, in awa-pg as in awa-sa: "callback not
found" and None, nothing written. Then the gates open: the handlers return ``WaitForCallback``
and both workers do the same with it, each job ending once and never running again.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import change, pg_call, same_job, snapshot, twins
from callback_running import Holder, Running, running_twins
from callback_waits import CALLS as ENDERS
from callback_waits import CHANNELS, PHASES, on_pg, same_answer
from racing import wait_for

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

CEL = {
    "filter": "payload.kind == 'charge'",
    "on_fail": "payload.status == 'declined'",
    "on_complete": "payload.status == 'paid' && payload.amount > 0u",
    "transform": "{'paid': payload.amount, 'order': payload.order}",
}
PAID = {"kind": "charge", "status": "paid", "amount": 1250, "order": "A-1"}
DECLINED = {"kind": "charge", "status": "declined", "amount": 1250}
REFUND = {"kind": "refund", "status": "paid", "amount": 1250}
JOBS: tuple[dict[str, Any], ...] = (
    # The options of each job, by number (``progress``: flushed before it registers).
    {"unique_opts": {"by_args": True}, "tags": ["t"], "metadata": {"m": 1}},  # 1 complete
    {"progress": True, "tags": ["f"]},  # 2 fail
    {"progress": True, "metadata": {"m": 3}},  # 3 resume
    {"cel": CEL, "unique_opts": {"by_args": True}},  # 4 resolved paid
    {"cel": CEL, "progress": True},  # 5 resolved declined
    {"cel": CEL, "tags": ["u"]},  # 6 retry, heartbeat: not found; resolve: ignored
)


CALLS: dict[str, tuple[int, Any, Any]] = {
    **{verb: (n, *ENDERS[verb]) for verb, n in (("complete", 1), ("fail", 2), ("resume", 3))},
    "resolve-paid": (
        4,
        lambda c, cb: c.resolve_callback(cb, PAID, "ignore"),
        lambda conn, cb: awa_sa.resolve_callback(conn, cb, PAID),
    ),
    "resolve-declined": (
        5,
        lambda c, cb: c.resolve_callback(cb, DECLINED, "complete"),
        lambda conn, cb: awa_sa.resolve_callback(conn, cb, DECLINED, "complete"),
    ),
    **{verb: (6, *ENDERS[verb]) for verb in ("retry", "heartbeat")},
    "resolve-ignored": (
        6,
        lambda c, cb: c.resolve_callback(cb, REFUND, "complete"),
        lambda conn, cb: awa_sa.resolve_callback(conn, cb, REFUND, "complete"),
    ),
}
STATE = {  # the job after the call; None: not found
    "complete": "completed",
    "fail": "failed",
    "resume": "running",
    "resolve-paid": "completed",
    "resolve-declined": "failed",
    "retry": None,
    "heartbeat": None,
    "resolve-ignored": "running",
}


@pytest.fixture(scope="module", params=PHASES)
def running(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[Running]:
    with running_twins(pg, awa_databases, real_template, request.param, JOBS) as made:
        yield made


def compared(running: Running, name: str) -> tuple[Any, Any, dict[str, Any], Any]:
    """*name*'s call on its job's running wait, awa-pg on one twin and awa-sa on the other
    (run once per twin pair; a later test gets what it made)."""
    if name in running.done:
        return running.done[name]  # type: ignore[no-any-return]
    n, by_pg, by_sa = CALLS[name]
    waits = running.wait(0, n), running.wait(1, n)
    assert waits[0] is not None
    assert waits[1] is not None
    assert (waits[0][0], waits[1][0]) == ("running", "running")
    ids = waits[0][1], waits[1][1]
    assert None not in ids
    made = twins(
        running.urls,
        running.engines,
        on_pg(lambda c: by_pg(c, ids[0])),
        lambda conn: by_sa(conn, ids[1]),
        schemas=running.schemas,
        channels=CHANNELS,
    )
    running.done[name] = made
    return made


@pytest.mark.parametrize("name", CALLS)
def test_a_call_on_a_running_wait_writes_what_awa_pg_writes(running: Running, name: str) -> None:
    got_pg, got_sa, changed, notes = compared(running, name)
    assert notes == []
    state = STATE[name]
    if state is None:  # a parked wait only, in awa-pg as in awa-sa
        assert (got_pg, got_sa, changed) == (None, None, {})
        n, by_pg, _ = CALLS[name]
        wait = running.wait(0, n)
        assert wait is not None
        assert wait[0] == "running"
        with pytest.raises(awa.CallbackNotFound):  # awa-pg's answer, read as None above
            pg_call(running.urls[0], lambda c: by_pg(c, wait[1]))
        return
    assert got_pg is not None
    assert got_sa is not None
    if name.startswith("resolve"):
        same_answer(got_sa, got_pg)
        job = got_sa.job
        if state == "running":
            assert (got_sa.outcome, job, changed) == ("ignored", None, {})
            return
        assert got_sa.outcome == state
    else:
        job = got_sa
        same_job(got_sa, got_pg)
    assert (job.state, job.run_lease) == (state, 1)
    assert changed, "nothing changed"
    if name == "resume":  # where a handler's wait_for_callback would find it
        assert job.metadata["_awa_callback_result"] == {"ok": [1, "two"]}
        assert job.callback_id is None
    if running.phase != "canonical":  # the materialised lease, and the progress's attempt row
        plane = running.schemas[-1]
        assert f"{plane}.leases" in changed
        if JOBS[CALLS[name][0] - 1].get("progress"):
            assert f"{plane}.attempt_state" in changed


ENDS = [
    ("completed", None),
    ("failed", "card declined"),
    ("failed", "WaitForCallback returned without calling register_callback"),
    ("completed", None),
    ("failed", "callback failed: on_fail expression matched"),
    ("waiting_external", None),
]
"""Each job, by number, once its handler returned ``WaitForCallback``: ended by its callback
and never parked; resumed, so the return finds no callback registered and the runtime fails
the job (the handler was to await ``wait_for_callback``); still waiting, so parked."""


def ends(running: Running, side: int) -> list[tuple[str, str | None]]:
    """Each job's state and its last error, by number, on twin *side*."""
    sql = (
        "SELECT state::text, errors[array_length(errors, 1)]->>'error'"
        " FROM awa.jobs WHERE id = ANY(:ids) ORDER BY id"
    )
    with running.engines[side].connect() as conn:
        return [(row[0], row[1]) for row in conn.execute(sa.text(sql), {"ids": running.ids})]


def returned(running: Running, side: int) -> bool:
    """Whether every handler on twin *side* returned and its runtime wrote what it made of it."""
    waits = (running.wait(side, n) for n in range(1, len(JOBS) + 1))
    return all(wait is None or wait[0] != "running" for wait in waits)


def ran(holder: Holder, job_id: int) -> bool:
    return holder.runs[job_id] == 1


def test_the_workers_go_on_alike_once_the_handlers_return(running: Running) -> None:
    """Every comparison made, the gates open: each handler returns ``WaitForCallback`` on a
    wait its callback ended, resumed or left alone, and both workers do the same with it, row
    for row; each job ends once, and none runs again."""
    for name in CALLS:
        compared(running, name)
    numbers = range(1, len(JOBS) + 1)
    before = [snapshot(engine, running.schemas) for engine in running.engines]
    for holder in running.holders:
        for n in numbers:
            holder.release(running.job(n))
    for side in (0, 1):  # the runtime's pace (its results are batched), so polled
        wait_for(partial(returned, running, side), what="every handler's return")
    after = [snapshot(engine, running.schemas) for engine in running.engines]
    assert change(before[1], after[1]) == change(before[0], after[0])
    assert ends(running, 0) == ends(running, 1) == ENDS
    for side, holder in enumerate(running.holders):
        sentinel = holder.insert("sentinel", {"s": side})
        wait_for(partial(ran, holder, sentinel), what="the sentinel's run")
        assert [holder.runs[running.job(n)] for n in numbers] == [1] * len(JOBS)
