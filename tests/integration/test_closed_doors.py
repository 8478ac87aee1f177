"""The throwaway servers (the suite's, the demo's, the bench's) let in their owner alone.

Their superuser can run programs as the server's account (``COPY ... PROGRAM``), so another
account on the machine must not reach them: not over TCP without the per-server password, not
through the Unix socket, whose directory it cannot enter. The owner reaches them on every driver
with the URL the kit hands out.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating an OS account needs root")


@pytest.fixture(scope="module")
def stranger() -> Iterator[str]:
    """A fresh OS account with no home and no shell: any other local user."""
    name = f"awasa{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def as_account(account: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args),
        user=account,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LC_ALL": "C", **env},
        cwd="/",
        check=False,
    )


def psql(
    pg: EmbeddedPostgres, account: str, host: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return as_account(
        account,
        str(pg.bindir / "psql"),
        "-X",
        "-w",  # never prompt
        "-h",
        host,
        "-p",
        str(pg.port),
        "-U",
        pg.user,
        "-d",
        "postgres",
        "-c",
        "SELECT 1",
        **env,
    )


def test_another_account_cannot_connect(pg: EmbeddedPostgres, stranger: str) -> None:
    no_password = psql(pg, stranger, pg.host)
    assert no_password.returncode != 0
    assert "no password supplied" in no_password.stderr
    guessed = psql(pg, stranger, pg.host, PGPASSWORD="postgres")
    assert guessed.returncode != 0
    assert "password authentication failed" in guessed.stderr
    socket = psql(pg, stranger, str(pg.root))
    assert socket.returncode != 0
    assert "Permission denied" in socket.stderr


def test_the_owner_connects_on_every_driver(pg: EmbeddedPostgres) -> None:
    url = sa.make_url(pg.url)
    assert url.password == pg.password
    for driver in ("psycopg", "psycopg2", "pg8000"):
        engine = sa.create_engine(url.set(drivername=f"postgresql+{driver}"), poolclass=sa.NullPool)
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT current_user")) == pg.user
        engine.dispose()

    async def both_async() -> None:
        for driver in ("psycopg", "asyncpg"):
            engine = create_async_engine(url.set(drivername=f"postgresql+{driver}"))
            async with engine.connect() as conn:
                assert await conn.scalar(sa.text("SELECT current_user")) == pg.user
            await engine.dispose()

    asyncio.run(both_async())


def test_the_kit_url_carries_the_password(awa_url: str, pg: EmbeddedPostgres) -> None:
    assert sa.make_url(awa_url).password == pg.password
    hba = sa.create_engine(pg.url, poolclass=sa.NullPool)
    with hba.connect() as conn:
        rules = conn.execute(
            sa.text("SELECT type, auth_method FROM pg_hba_file_rules ORDER BY line_number")
        ).all()
    hba.dispose()
    assert {method for kind, method in rules if kind == "host"} == {"scram-sha-256"}
    assert {method for kind, method in rules if kind == "local"} == {"trust"}
    assert oct(pg.root.stat().st_mode & 0o777) == "0o700"
