"""Every private SQLAlchemy or driver name awa-sa reaches for, looked up once, at import.

A SQLAlchemy or driver release may rename or reshape any of them without notice, and each sits
on the path of every call. So each is checked here, once, and nowhere else: its presence, and
its parameters where ``inspect.signature`` reads them for a few microseconds. A path whose
names are all found takes them. A path with a name missing or changed takes SQLAlchemy's public
API instead (a ``Connection`` and ``exec_driver_sql``, ``greenlet_spawn``, the isolation level
read from the driver connection), the same outcomes by a slower road, and awa-sa says so once
per process with a :class:`PrivatePathUnavailable` warning; never an error.

``AWA_SA_PUBLIC_ONLY=1`` in the environment, read once here, turns every private path off
without a warning, so that a whole run of the suite proves the public paths
(docs/architecture.md#private-names).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Connection, Engine, Pool, util
from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.engine.default import DefaultDialect, DefaultExecutionContext
from sqlalchemy.pool.base import _ConnectionFairy
from sqlalchemy.schema import Table

__all__ = ["PATHS", "PUBLIC_ONLY", "Paths", "PrivatePathUnavailable", "look_up"]

PUBLIC_ONLY = os.environ.get("AWA_SA_PUBLIC_ONLY") == "1"
"""Whether every private path is off, as the environment asked at import."""


class PrivatePathUnavailable(RuntimeWarning):
    """A private SQLAlchemy or driver name awa-sa uses is missing or changed: awa-sa takes the
    public API there instead, with the same outcomes, at some cost per call."""


@dataclass(frozen=True, slots=True)
class Paths:
    """Which private paths this process takes; each is on only where all its names were found."""

    lean: bool
    """A statement's text through ``Connection._execute_context`` with the lean execution
    context (``awa_sa.core.internals.lean``); else ``exec_driver_sql``."""
    direct: bool
    """The Engine form's try on a pooled connection (``awa_sa.core.internals.direct``); else a
    ``Connection``."""
    asyncpg_context: bool
    """The direct path on asyncpg, which does its execution context's two steps; else asyncpg
    engines keep the ``Connection``."""
    asyncpg_native: bool
    """asyncpg's lone autocommit statement by its own ``fetch``; else through the adapter."""
    kept_greenlet: bool
    """The async faces in a kept greenlet; else ``greenlet_spawn``'s new one per call."""
    isolation: bool
    """The isolation level ``create_engine`` was given, read from the dialect; else from each
    pooled connection's driver (``awa_sa.core.internals.connecting.driver_isolation_level``)."""
    schema_map: bool
    """A function under a translated schema by SQLAlchemy's own mapping; else by reading the
    compiler's map."""
    missing: tuple[str, ...] = ()
    """The names found missing or changed."""


def _parameters(fn: Callable[..., Any], *names: str) -> bool:
    """Whether *fn* takes *names* as its first parameters (``self`` or ``cls`` left out)."""
    found = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    return found[: len(names)] == list(names)


def _slot(cls: type[Any], name: str) -> bool:
    return any(name in getattr(klass, "__slots__", ()) for klass in cls.__mro__)


def _greenlet_marker() -> bool:
    """Whether SQLAlchemy's ``await_()`` still accepts a greenlet by its marker attribute."""
    await_ = inspect.unwrap(getattr(util, "await_", None) or util.await_only)
    return "__sqlalchemy_greenlet_provider__" in await_.__code__.co_consts


def _isolation_kept() -> bool:
    """Whether a dialect keeps the level ``create_engine(isolation_level=...)`` gives it where
    awa-sa reads it."""
    dialect = DefaultDialect(isolation_level="SERIALIZABLE")
    return dialect._on_connect_isolation_level == "SERIALIZABLE"


_Check = tuple[str, str, Callable[[], bool]]

_CHECKS: tuple[_Check, ...] = (
    (
        "lean",
        "Connection._execute_context",
        lambda: _parameters(
            Connection._execute_context,
            "dialect",
            "constructor",
            "statement",
            "parameters",
            "execution_options",
        ),
    ),
    (
        "lean",
        "DefaultExecutionContext._init_statement",
        lambda: _parameters(
            DefaultExecutionContext._init_statement,
            "dialect",
            "connection",
            "dbapi_connection",
            "execution_options",
            "statement",
            "parameters",
        ),
    ),
    (
        "lean",
        "DefaultExecutionContext._setup_result_proxy",
        lambda: _parameters(DefaultExecutionContext._setup_result_proxy),
    ),
    ("direct", "Engine._has_events", lambda: isinstance(Engine._has_events, bool)),
    ("direct", "Dialect._has_events", lambda: isinstance(DefaultDialect._has_events, bool)),
    ("direct", "Engine._should_log_info", lambda: _parameters(Engine._should_log_info)),
    (
        "direct",
        "Connection._handle_dbapi_exception_noconnection",
        lambda: _parameters(
            Connection._handle_dbapi_exception_noconnection, "e", "dialect", "engine"
        ),
    ),
    (
        "direct",
        "Pool._invalidate",
        lambda: _parameters(Pool._invalidate, "connection", "exception"),
    ),
    (
        "direct",
        "_ConnectionFairy._close_special",
        lambda: _parameters(_ConnectionFairy._close_special, "transaction_reset"),
    ),
    (
        "asyncpg_context",
        "PGDialect_asyncpg._invalidate_schema_cache",
        lambda: _parameters(asyncpg.PGDialect_asyncpg._invalidate_schema_cache),
    ),
    (
        "asyncpg_context",
        "PGDialect_asyncpg._invalidate_schema_cache_asof",
        lambda: isinstance(asyncpg.PGDialect_asyncpg._invalidate_schema_cache_asof, int | float),
    ),
    (
        "asyncpg_context",
        "AsyncAdapt_asyncpg_cursor._invalidate_schema_cache_asof",
        lambda: _slot(asyncpg.AsyncAdapt_asyncpg_cursor, "_invalidate_schema_cache_asof"),
    ),
    (
        "asyncpg_native",
        "AsyncAdapt_asyncpg_connection._handle_exception",
        lambda: _parameters(asyncpg.AsyncAdapt_asyncpg_connection._handle_exception, "error"),
    ),
    ("kept_greenlet", "__sqlalchemy_greenlet_provider__", _greenlet_marker),
    (
        "isolation",
        "DefaultDialect._on_connect_isolation_level",
        _isolation_kept,
    ),
    ("schema_map", "SchemaItem._use_schema_map", lambda: Table._use_schema_map is True),
)
"""Each private name: the path that needs it, the name, and its check."""

_DEPENDS = {"asyncpg_context": "direct", "asyncpg_native": "asyncpg_context"}
"""A path that is a part of another is off with it."""

_warned = False


def look_up(*, public_only: bool = PUBLIC_ONLY, checks: Iterable[_Check] = _CHECKS) -> Paths:
    """Run every check; warn once per process (:class:`PrivatePathUnavailable`) where one fails,
    unless *public_only*, which turns every path off in silence."""
    global _warned  # noqa: PLW0603 -- the one warning per process
    names = [field.name for field in fields(Paths) if field.name != "missing"]
    on: dict[str, Any] = dict.fromkeys(names, not public_only)
    if public_only:
        return Paths(**on)
    missing = []
    for path, name, check in checks:
        try:
            found = check()
        except Exception:  # a name gone raises AttributeError, a reshaped one anything
            found = False
        if not found:
            on[path] = False
            missing.append(name)
    for path, whole in _DEPENDS.items():
        on[path] = on[path] and on[whole]
    if missing and not _warned:
        _warned = True
        off = ", ".join(name for name in names if not on[name])
        warnings.warn(
            PrivatePathUnavailable(
                f"awa-sa takes SQLAlchemy's public API where it used {', '.join(missing)}"
                f" (paths off: {off}); outcomes are the same, calls slower. Upgrade awa-sa, or"
                " set AWA_SA_PUBLIC_ONLY=1 to silence this."
            ),
            stacklevel=2,
        )
    return Paths(**on, missing=tuple(missing))


PATHS = look_up()
"""This process's paths. Read as ``lookup.PATHS`` at each use, so a test can swap it."""
