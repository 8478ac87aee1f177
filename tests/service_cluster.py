"""The cluster ``./dev soak`` runs the service soak on: a throwaway server, an ``awa migrate``
database with the ``awa_qs`` substrate prepared (as tests/conftest.py's ``real_template``), and
PgBouncer in transaction mode in front of it when asked (awa_sa/testing/pooler.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from service_checks import format_table
from service_soak import Soak, SoakConfig

from awa_sa.testing.pooler import pgbouncer
from awa_sa.testing.server import embedded_postgres

POOLED: dict[str, Any] = {"connect_args": {"prepare_threshold": None}}
"""psycopg 3 under transaction pooling (docs/deploying.md#poolers)."""


def awa_cli(url: str, *args: str) -> None:
    """The real ``awa`` CLI installed beside this interpreter, on *url*."""
    env = {**os.environ, "DATABASE_URL": url, "RUST_LOG": "error"}
    binary = Path(sys.executable).with_name("awa")
    subprocess.run([str(binary), *args], env=env, check=True, capture_output=True, timeout=600)


@contextmanager
def soak_cluster(pooler: bool) -> Iterator[tuple[str, str, dict[str, Any], Path]]:
    """``(awa-sa's URL, the direct URL, awa-sa's engine options, a scratch directory)``."""
    with ExitStack() as stack:
        server = stack.enter_context(embedded_postgres())
        admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE DATABASE soak")
        admin.dispose()
        awa_cli(server.database_url("soak", "postgres"), "migrate")
        awa_cli(
            server.database_url("soak", "postgres"),
            *("storage", "prepare-queue-storage-schema", "--schema", "awa_qs"),
        )
        direct = server.database_url("soak")
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="awa-sa-soak-")))
        if not pooler:
            yield direct, direct, {}, workdir
            return
        bouncer = stack.enter_context(pgbouncer(server, pool_size=16))
        yield bouncer.database_url("soak"), direct, POOLED, workdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev soak", description="tests/service_soak.py")
    parser.add_argument("--jobs", type=int, default=2000, help="committed enqueues (default 2000)")
    parser.add_argument("--pooler", action="store_true", help="awa-sa through PgBouncer")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument(
        "--callbacks", type=float, default=0.18, help="share of jobs parked on callbacks (0.18)"
    )
    args = parser.parse_args(argv)
    with soak_cluster(pooler=args.pooler) as (sa_url, direct_url, options, workdir):
        config = SoakConfig(
            jobs=args.jobs, seed=args.seed, callbacks=args.callbacks, engine_options=options
        )
        figures = Soak(sa_url, direct_url, config, workdir).run()
    print(format_table(figures, "PgBouncer" if args.pooler else "direct"))
    return 0 if figures.ok else 1
