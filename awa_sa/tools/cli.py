"""The ``awa-sa`` command: ``demo``, ``sql`` and ``status``.

Every failure a user can cause (a bad URL, a server that is down, a database that is not an
Awa v040 cluster) ends as one ``Error: ...`` line and exit status 1, never a traceback: the
command is run by people checking a cluster, and a stack trace hides the one fact they need.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

import click
import sqlalchemy as sa

from awa_sa.core.errors import AwaSAError
from awa_sa.tools import demo as demo_mod
from awa_sa.tools import listing
from awa_sa.tools.errors import DemoUnavailable
from awa_sa.tools.planes import explain
from awa_sa.tools.status import ClusterStatus, read_status

_CONNECT_TIMEOUT_SECS = 10
"""Long enough for a slow network, short enough that a wrong host does not look like a hang."""


def fail(message: str) -> NoReturn:
    raise click.ClickException(message)


def database_url(raw: str) -> sa.URL:
    """Parse a PostgreSQL URL as awa's own CLI accepts it (``postgres://`` included).

    The driver is always psycopg 3, the one awa-sa depends on: ``postgres://`` and a bare
    ``postgresql://`` would otherwise ask SQLAlchemy for psycopg2, which is not installed.
    """
    try:
        url = sa.make_url(raw)
    except sa.exc.ArgumentError:
        fail(f"--url is not a database URL: {raw!r}")
    if url.get_backend_name() not in ("postgresql", "postgres"):
        fail(f"--url is not a PostgreSQL URL: {shown(url)}")
    return url.set(drivername="postgresql+psycopg")


def shown(url: sa.URL) -> str:
    """The URL as a user would type it, password hidden: safe to print in errors."""
    return url.set(drivername=url.get_backend_name()).render_as_string(hide_password=True)


def create_engine(url: sa.URL) -> sa.Engine:
    """An engine without a pool: the CLI opens a handful of connections and exits."""
    connect_args: dict[str, object] = {}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = _CONNECT_TIMEOUT_SECS
    return sa.create_engine(url, poolclass=sa.NullPool, connect_args=connect_args)


def one_line(exc: BaseException) -> str:
    """The first meaningful line of an error: the driver's own text when there is one."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


@contextmanager
def friendly_errors(what: str) -> Iterator[None]:
    """Turn the failures a user can cause into one ``Error:`` line."""
    try:
        yield
    except click.ClickException:
        raise
    except sa.exc.DBAPIError as exc:
        fail(f"{what}: {one_line(exc)}")
    except AwaSAError as exc:
        fail(f"{what}: {one_line(exc)}")


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``finally`` blocks clean up what we started."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Show the library's log records (logger 'awa_sa', every level) on stderr.",
)
@click.version_option(package_name="awa-sa")
def main(verbose: bool) -> None:
    """awa-sa: re-schedule running canonical Awa v040 attempts from SQLAlchemy Core."""
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger = logging.getLogger("awa_sa")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)


@main.command()
@click.option(
    "--url",
    metavar="URL",
    help="Use this existing PostgreSQL server instead of a throwaway one. The walk-through "
    "runs in a new database that is created on it and dropped afterwards.",
)
def demo(url: str | None) -> None:
    """Walk through every outcome with real rows on a throwaway database."""
    server_url = database_url(url) if url else None
    _exit_on_sigterm()
    started = time.monotonic()
    try:
        with friendly_errors("demo failed"):
            demo_mod.run(click.echo, server_url)
    except KeyboardInterrupt:
        click.echo("interrupted; everything the demo started has been removed", err=True)
        sys.exit(130)
    except DemoUnavailable as exc:
        fail(str(exc))
    click.echo(f"done in {time.monotonic() - started:.1f} s; everything it created is removed")


@main.command()
@click.option(
    "--schema",
    default="awa",
    show_default=True,
    metavar="NAME",
    help="Queue-storage schema to render into the statements (awa's default is 'awa').",
)
def sql(schema: str) -> None:
    """Print every statement awa-sa can send, compiled for PostgreSQL."""
    with friendly_errors("cannot render statements"):
        blocks = listing.render_all(schema)
    for block in blocks:
        click.echo(f"-- {block.title}")
        for line in textwrap.wrap(listing.plain(block.description), listing.WIDTH - 3):
            click.echo(f"-- {line}")
        click.echo(f"{listing.formatted(block.sql)};")
        click.echo()


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{state} {n}" for state, n in counts.items()) or "empty"


def _status_lines(where: str, st: ClusterStatus) -> Iterator[str]:
    yield f"cluster      {where} (Awa schema v{st.schema_version:03d}, {st.release_family})"
    epoch = "" if st.epoch is None else f" (epoch {st.epoch})"
    missing = "" if st.epoch is not None else " (no transition row)"
    yield f"phase        {st.phase}{epoch}{missing}"
    yield f"engines      current {st.current_engine}, prepared {st.prepared_engine or '-'}"
    if st.routing_schema:
        yield f"routing      new writes -> queue storage in schema {st.routing_schema}"
    else:
        yield "routing      new writes -> canonical plane (awa.jobs_hot / awa.scheduled_jobs)"
    yield f"canonical    awa.jobs_hot: {_counts(st.jobs_hot)}"
    yield f"             awa.scheduled_jobs: {_counts(st.scheduled_jobs)}"
    if st.queue_storage_schema is None:
        yield "queue store  none in play"
    elif not st.queue_storage_installed:
        yield f"queue store  {st.queue_storage_schema}: not installed (no deferred_jobs table)"
    else:
        yield f"queue store  {st.queue_storage_schema}.deferred_jobs: {_counts(st.deferred_jobs)}"
    if st.runtimes is None:
        yield "runtimes     not recorded (no awa.runtime_instances table)"
    elif not st.runtimes:
        yield "runtimes     none live"
    for n, runtime in enumerate(st.runtimes or ()):
        label = "runtimes" if n == 0 else ""
        yield (
            f"{label:<12} {runtime.name}: {runtime.capability}, role {runtime.role}, "
            f"awa {runtime.version}"
        )
    yield from explain(st)
    backlog = st.canonical_live_backlog
    backlog_text = f"canonical live backlog {backlog} (non-terminal jobs_hot + all scheduled_jobs)"
    if st.phase != "mixed_transition":
        yield f"finalize     not applicable in phase {st.phase}; canonical live backlog {backlog}"
    elif st.finalize_ready:
        yield f"finalize     can pass: {backlog_text}, no live canonical-only runtime"
    else:
        if backlog:
            yield f"finalize     blocked: {backlog_text}"
        for runtime in st.finalize_blockers:
            yield (
                f"finalize     blocked by runtime {runtime.name}: it reports storage_capability "
                f"{runtime.capability} (last seen {runtime.last_seen_at:%Y-%m-%d %H:%M:%S%z})"
            )


@main.command()
@click.option(
    "--url",
    envvar="DATABASE_URL",
    metavar="URL",
    help="The Awa cluster's database (default: $DATABASE_URL).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def status(url: str | None, as_json: bool) -> None:
    """Show the storage transition phase and the backlogs that gate finalize (read-only)."""
    if url is None:
        raise click.UsageError("no database given: pass --url URL, or set $DATABASE_URL")
    parsed = database_url(url)
    where = shown(parsed)
    engine = create_engine(parsed)
    try:
        with friendly_errors(f"cannot read {where}"):
            st = read_status(engine)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"url": where, **st.as_dict()}, indent=2))
        return
    for line in _status_lines(where, st):
        click.echo(line)
