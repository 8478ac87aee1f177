"""The async faces' bridge: a sync step run on the sync Connection behind an async bind.

Every async twin of every capability runs its sync step here, in one kept greenlet (the
Engine form whole, or the step on an ``AsyncConnection``'s sync Connection), so there is one
copy of the decision logic and both faces send the same compiled statements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from awa_sa.core import binds
from awa_sa.core.driver_errors import translated_error
from awa_sa.core.drivers import check_dialect
from awa_sa.core.errors import ValidationError
from awa_sa.core.internals import run_in_greenlet

_T = TypeVar("_T")
AsyncBind = AsyncEngine | AsyncConnection | AsyncSession


async def administered(
    bind: AsyncEngine | AsyncConnection | AsyncSession, step: Callable[[Connection], _T]
) -> _T:
    check_bind(bind)
    return await on_sync(bind, binds.administer_in, step, engine_form=binds.administered)


def check_bind(bind: object) -> None:
    if isinstance(bind, AsyncEngine | AsyncConnection):
        check_dialect(bind.dialect, is_async=True)
    elif isinstance(bind, AsyncSession):
        check_dialect(binds.session_dialect(bind.sync_session), is_async=True)
    else:
        raise ValidationError(
            "bind must be a sqlalchemy AsyncEngine, AsyncConnection or AsyncSession, got "
            f"{type(bind).__name__} (use the awa_sa functions for sync binds)"
        )


async def on_sync(
    bind: AsyncEngine | AsyncConnection | AsyncSession,
    fn: Callable[..., _T],
    *args: Any,
    engine_form: Callable[..., _T] | None = None,
) -> _T:
    """``fn(conn, *args)`` on the sync Connection behind *bind*, or ``engine_form`` (else
    ``fn``) of the whole sync Engine, each in one kept greenlet (the module's docstring)."""
    if isinstance(bind, AsyncEngine):
        return await run_in_greenlet(engine_form or fn, bind.sync_engine, *args)
    try:  # a connection that died in the greenlet, or a Session's autobegin
        if isinstance(bind, AsyncSession):
            bind = await bind.connection()
        if bind.sync_connection is None:  # not started: run_sync raises SQLAlchemy's error
            return await bind.run_sync(fn, *args)
        return await run_in_greenlet(fn, bind.sync_connection, *args)
    except Exception as exc:
        # translated() entered only once something was raised (as in awa_sa.settle.binds)
        raise translated_error(exc)  # noqa: B904 -- translated() chained it already
