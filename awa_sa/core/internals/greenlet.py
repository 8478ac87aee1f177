"""The kept greenlet the async faces run the sync flow in (``run_in_greenlet``).

Its own module because it is the async faces' only reach past SQLAlchemy's API, and apart from
the Engine form's: SQLAlchemy's ``await_()`` accepts it by an undocumented marker attribute,
checked at import (:mod:`awa_sa.core.internals.lookup`); without it, ``greenlet_spawn`` runs the
call.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.util import greenlet_spawn

from awa_sa.core.internals import lookup

__all__ = ["run_in_greenlet"]

_T = TypeVar("_T")

_DONE = object()
"""What a carrier switches back with once its function has returned or raised."""
_IDLE_CARRIERS = 8
"""Idle carriers kept per thread: as many as it has run awa-sa calls at once, up to this."""
_idle = threading.local()


async def run_in_greenlet(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, run where SQLAlchemy's ``await_()`` can switch out of it, as
    ``sqlalchemy.util.greenlet_spawn`` (undocumented) and ``AsyncConnection.run_sync`` run it.

    The async faces run the sync flow so: an ``AsyncEngine`` call runs the whole Engine form
    (checkout, statement, checkin) in one greenlet, not one per step as ``async with
    engine.connect()`` would. ``greenlet_spawn`` makes a new greenlet for every call, and with
    it a new stack for its Python frames: mapped, faulted in and unmapped each time (a page
    fault per call; docs/performance.md#kept-greenlet says what that costs). The greenlet here
    is kept and reused. ``await_()`` asks two things of it, on SQLAlchemy 2.0 and 2.1 alike:
    the (undocumented) marker ``__sqlalchemy_greenlet_provider__``, and a parent that awaits
    what it is switched to and switches back with the result or throws the error in, which the
    loop below does as ``greenlet_spawn``'s does. ``fn`` runs in the caller's ``contextvars``
    context. Where the marker is not what ``await_()`` reads (``lookup.PATHS.kept_greenlet``),
    ``greenlet_spawn`` runs it. tests/unit/test_greenlet_carrier.py.
    """
    if not lookup.PATHS.kept_greenlet:
        return await greenlet_spawn(fn, *args)
    carrier_type, current = _carriers()
    try:
        idle: list[Any] = _idle.carriers
    except AttributeError:  # the thread's first call
        idle = _idle.carriers = []
    carrier = idle.pop() if idle else carrier_type()
    caller = current()
    carrier.parent = caller
    carrier.gr_context = caller.gr_context
    step = carrier.switch(fn, args)
    while step is not _DONE:
        try:
            value = await step
        except BaseException:
            step = carrier.throw(*sys.exc_info())
        else:
            step = carrier.switch(value)
    value, error = carrier.outcome
    carrier.outcome = carrier.gr_context = None  # an idle carrier holds nothing of the call
    if len(idle) < _IDLE_CARRIERS:
        idle.append(carrier)
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]


@functools.cache
def _carriers() -> tuple[type[Any], Callable[[], Any]]:
    """The carrier greenlet's class, and ``greenlet.getcurrent``: made on first use, since
    greenlet is in the async extras only."""
    from greenlet import GreenletExit, getcurrent, greenlet  # noqa: PLC0415

    def serve(fn: Any, args: Any) -> None:
        """A carrier's run: every call it is switched to. It never holds itself (nor the call,
        once done) in a local, so that a carrier no one keeps is freed at once, ended by the
        GreenletExit greenlet raises in it, rather than left in a cycle, suspended."""
        while True:
            try:
                getcurrent().outcome = (fn(*args), None)
            except GreenletExit:
                raise
            except BaseException as exc:
                getcurrent().outcome = (None, exc)
            fn = args = None
            fn, args = getcurrent().parent.switch(_DONE)

    class Carrier(greenlet):  # type: ignore[misc]  # greenlet has no annotations
        __sqlalchemy_greenlet_provider__ = True
        outcome: tuple[Any, BaseException | None] | None = None

        def __init__(self) -> None:
            super().__init__(serve)

    return Carrier, getcurrent
