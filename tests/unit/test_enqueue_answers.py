"""A batch's rows are built without ``EnqueuedJob.__init__`` (the same rows, every field set) and
without the garbage collector's passes, which are left as the caller had them."""

from __future__ import annotations

import dataclasses
import gc
from datetime import UTC, datetime

import pytest

from awa_sa.enqueue.answers import collector_paused, new_row
from awa_sa.enqueue.new_jobs import EnqueuedJob


def test_new_row_is_the_dataclass_row() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    values = (7, "k", "q", "available", 2, 0, 25, now, now, {"n": 1}, {"m": 2}, ("t",), b"x")
    built, made = new_row(*values), EnqueuedJob(*values)
    assert built == made
    assert repr(built) == repr(made)
    assert dataclasses.astuple(built) == values
    assert not hasattr(EnqueuedJob, "__post_init__")  # nothing new_row would skip
    assert [f.name for f in dataclasses.fields(EnqueuedJob)] == list(EnqueuedJob.__slots__)


def test_the_collector_is_held_off_for_a_batch_and_left_as_it_was() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), collector_paused():
        1 / 0  # noqa: B018
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()
