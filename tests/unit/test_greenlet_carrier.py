"""The kept greenlet the async faces run the sync flow in behaves as ``greenlet_spawn``'s own.

SQLAlchemy's ``await_()`` must accept it; a result, an exception, a cancellation and the
caller's context variables must cross it both ways; concurrent calls must each get their own;
and an idle one must hold nothing of the call it ran (``awa_sa.core.internals.run_in_greenlet``).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from typing import Any

import pytest
from greenlet import getcurrent
from sqlalchemy.util.concurrency import await_only, in_greenlet

from awa_sa.core.internals import greenlet as internals
from awa_sa.core.internals import lookup, run_in_greenlet

kept = pytest.mark.skipif(
    not lookup.PATHS.kept_greenlet, reason="greenlet_spawn's greenlet, new each call"
)
"""For what only the kept greenlet does; the rest holds of ``greenlet_spawn``'s too."""

seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="unset")


def awaiting(value: Any) -> tuple[Any, Any]:
    """What SQLAlchemy's await_ hands back, and the greenlet it ran in."""
    return await_only(asyncio.sleep(0, value)), getcurrent()


@kept
async def test_await_inside_it_returns_and_the_greenlet_is_kept() -> None:
    first, carrier = await run_in_greenlet(awaiting, 1)
    second, again = await run_in_greenlet(awaiting, 2)
    assert (first, second) == (1, 2)
    assert again is carrier
    assert await run_in_greenlet(in_greenlet) is True


def failing() -> None:
    await_only(asyncio.sleep(0))
    raise LookupError("from the flow")


def catching() -> str:
    async def refused() -> None:
        raise KeyError("from the driver")

    try:
        await_only(refused())
    except KeyError as exc:
        return f"caught {exc}"
    return "not raised"


async def test_exceptions_cross_it_both_ways_and_it_serves_again() -> None:
    with pytest.raises(LookupError, match="from the flow") as raised:
        await run_in_greenlet(failing)
    assert "failing" in {entry.name for entry in raised.traceback}
    assert await run_in_greenlet(catching) == "caught 'from the driver'"
    assert (await run_in_greenlet(awaiting, 3))[0] == 3


async def test_concurrent_calls_each_get_their_own() -> None:
    release = asyncio.Event()

    def waiting(name: str) -> tuple[str, Any]:
        await_only(release.wait())
        return name, getcurrent()

    tasks = [asyncio.create_task(run_in_greenlet(waiting, name)) for name in "abc"]
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*tasks)
    assert [name for name, _ in results] == ["a", "b", "c"]
    assert len({id(carrier) for _, carrier in results}) == 3


async def test_a_cancelled_call_unwinds_inside_and_the_greenlet_serves_again() -> None:
    unwound: list[str] = []
    started = asyncio.Event()

    def held() -> None:
        started.set()
        try:
            await_only(asyncio.Event().wait())
        finally:
            unwound.append("finally")

    task = asyncio.create_task(run_in_greenlet(held))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert unwound == ["finally"]
    assert (await run_in_greenlet(awaiting, 4))[0] == 4


async def test_the_callers_context_variables_cross_it_both_ways() -> None:
    def reading_and_setting() -> str:
        before = seen.get()
        seen.set("set inside")
        return before

    seen.set("set outside")
    assert await run_in_greenlet(reading_and_setting) == "set outside"
    assert seen.get() == "set inside"


class Held:
    """Something a call takes and returns, that an idle greenlet must not keep alive."""


async def test_an_idle_greenlet_holds_nothing_of_its_call() -> None:
    def echo(held: Held) -> Held:
        await_only(asyncio.sleep(0))
        return held

    arg = Held()
    result = await run_in_greenlet(echo, arg)
    gone = weakref.ref(arg)
    del arg, result
    assert gone() is None


@kept
async def test_a_thread_keeps_only_a_few_idle() -> None:
    release = asyncio.Event()
    carriers: list[weakref.ref[Any]] = []

    def waiting() -> None:
        carriers.append(weakref.ref(getcurrent()))
        await_only(release.wait())

    tasks = [asyncio.create_task(run_in_greenlet(waiting)) for _ in range(24)]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*tasks)
    assert len(internals._idle.carriers) == internals._IDLE_CARRIERS
    assert sum(carrier() is not None for carrier in carriers) == internals._IDLE_CARRIERS


def test_each_thread_has_its_own() -> None:
    found: list[Any] = []

    def run() -> None:
        found.append(asyncio.run(run_in_greenlet(awaiting, "thread"))[0])

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == ["thread", "thread"]


def test_a_carrier_no_one_keeps_ends_at_once_even_suspended() -> None:
    carrier_type, _ = internals._carriers()
    ended: list[str] = []

    def suspended() -> None:
        try:
            getcurrent().parent.switch("suspended")
        finally:
            ended.append("unwound")

    carrier = carrier_type()
    assert carrier.switch(suspended, ()) == "suspended"
    finished = weakref.ref(carrier)
    del carrier  # no cycle to wait for the collector: freed here, and ended
    assert ended == ["unwound"]
    assert finished() is None
