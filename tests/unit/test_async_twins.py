"""Every public function of ``awa_sa`` has its twin in ``awa_sa.asyncio``, and the other way round.

An async service must never find a call missing from its face: a new public function of one
face fails here until the other has it too, with the same parameters. What is sync-only by
nature has nothing to await: the value classes (dataclasses, named tuples), the exceptions and
the unions of them are recognised as such; anything else public without a twin (a constant, a
class with behaviour) must be listed in :data:`SYNC_ONLY` with its reason, on purpose.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import awa_sa
import awa_sa.asyncio as awa_async

SYNC_ONLY = {
    "CANONICAL": "a constant: RunningAttempt.storage of a canonical attempt",
    "CALLBACK_SIGNATURE_HEADER": "a constant: the header a callback's signature comes in",
    "CALLBACK_DEFAULT_PATH_PREFIX": "a constant: where Awa mounts the callback routes",
    "CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS": "a constant: a heartbeat's default timeout",
}
"""Public names of ``awa_sa`` that are neither functions nor values by nature, with no twin."""
NO_IO = {
    "jobs_view": "builds a selectable and touches no connection: the same one serves both faces",
    "sign_callback": "a keyed hash of a callback id: no connection",
    "verify_callback": "a keyed hash compared: no connection",
    "build_callback_url": "a string put together: no connection",
}
"""Public functions of ``awa_sa`` that do no I/O, so have nothing to await: no twin."""


def public(module: types.ModuleType) -> dict[str, object]:
    return {name: getattr(module, name) for name in module.__all__}


def is_value_by_nature(value: object) -> bool:
    """A value class, an exception, or a union of them: built or caught, never awaited."""
    if isinstance(value, types.UnionType):
        return all(is_value_by_nature(member) for member in value.__args__)
    if not inspect.isclass(value):
        return False
    named_tuple = issubclass(value, tuple) and hasattr(value, "_fields")
    return dataclasses.is_dataclass(value) or issubclass(value, BaseException) or named_tuple


def twinned(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in public(module).items()
        if inspect.isfunction(value) and name not in NO_IO
    }


def test_every_public_function_has_its_twin() -> None:
    missing_async = twinned(awa_sa) - twinned(awa_async)
    missing_sync = twinned(awa_async) - twinned(awa_sa)
    assert not missing_async, f"in awa_sa but not in awa_sa.asyncio: {sorted(missing_async)}"
    assert not missing_sync, f"in awa_sa.asyncio but not in awa_sa: {sorted(missing_sync)}"


def test_every_other_public_name_is_a_value_or_listed_as_sync_only() -> None:
    """A public callable object that is not a function (a class with behaviour, an instance
    with ``__call__``) cannot slip past the twin check unnoticed."""
    others = {
        name
        for name, value in public(awa_sa).items()
        if not inspect.isfunction(value) and not is_value_by_nature(value)
    }
    assert others == set(SYNC_ONLY)


def test_the_async_face_exports_only_coroutine_functions() -> None:
    for name, value in public(awa_async).items():
        assert inspect.iscoroutinefunction(value), name


def test_twins_take_the_same_parameters() -> None:
    """Same names, kinds and defaults, in the same order; the bind's type is the difference."""
    for name in twinned(awa_sa):
        sync, twin = getattr(awa_sa, name), getattr(awa_async, name)
        assert shape(twin) == shape(sync), name


def shape(fn: types.FunctionType) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
