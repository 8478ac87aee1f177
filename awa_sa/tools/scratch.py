"""A database the demo creates on a server and removes afterwards, even when interrupted.

The demo's walk-through runs on a scratch database of its own, so it can run on any server,
the caller's included, and leave nothing behind: its cleanup holds Ctrl-C until the DROP is
done, and first lets go of a connection an interrupt left half authenticated.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import sqlalchemy as sa

CONNECT = {"connect_timeout": 10}
"""A wrong host fails within seconds instead of looking like a hang."""


@contextmanager
def fresh_database(server: sa.URL) -> Iterator[sa.Engine]:
    """Create a uniquely named database on *server*, yield an engine on it, then drop it."""
    name = f"awa_sa_demo_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(
        server, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT", connect_args=CONNECT
    )
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        engine = sa.create_engine(
            server.set(database=name), poolclass=sa.NullPool, connect_args=CONNECT
        )
        try:
            yield engine
        finally:
            with _uninterrupted():
                engine.dispose()
                _release_interrupted_frames()
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _release_interrupted_frames() -> None:
    """Let go of what the exception being handled, if any, still holds in its frames.

    A Ctrl-C in the middle of a connect leaves that connection's socket referenced only from the
    traceback, and its server backend waiting for the rest of the password exchange. Such a
    backend does not answer the barrier DROP DATABASE waits on, so the DROP would hang until the
    server's authentication_timeout (a minute by default). Clearing the finished frames closes
    the socket and the backend goes away.
    """
    tb = sys.exc_info()[2]
    if tb is not None:
        traceback.clear_frames(tb)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Cleanup runs to its end: a Ctrl-C or SIGTERM meanwhile is held and delivered after it.

    Delivered during the DROP it would cancel it and leave the database behind, while the demo
    says it is gone. When the demo is already unwinding from an interrupt, a second one is
    dropped (the first already says stop). Only the main thread can take signals over.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held and sys.exc_info()[1] is None:
        signal.raise_signal(held[0])
