"""A throwaway PostgreSQL server for tests, the demo and the benchmark.

PostgreSQL refuses to run as root, and CI runs as root, so the server is started as the
unprivileged ``postgres`` account when we are root; otherwise as ourselves. Everything lives
in one temporary directory that :meth:`EmbeddedPostgres.stop` removes, in RAM when there is room
(see :func:`scratch_parent`).

Only its owner gets in. The superuser can run programs as the server's account
(``COPY ... PROGRAM``), so another local account must not reach it: TCP on 127.0.0.1 asks for a
password drawn per server (scram-sha-256) that only :attr:`EmbeddedPostgres.url` carries, and
the Unix socket lies in the server's own directory, which no other account may enter.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from awa_sa.testing.bindir import find_bindir
from awa_sa.testing.errors import EmbeddedPostgresError

# Durability is worthless for a database that is deleted afterwards; speed is not. Nor is JIT:
# a fresh cluster's partitions have no statistics, so PostgreSQL estimates a queue-storage read
# (awa-sa's listing, the runtime's own maintenance) costly enough to JIT-compile it, some 0.3-1 s
# of a test's CPU each time for a plan that reads a few rows.
_FAST_SETTINGS = (
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
    "jit=off",
    "max_connections=200",
    "shared_buffers=128MB",
)


SCRATCH_ENVIRONMENT_VARIABLE = "AWA_SA_PG_TMPDIR"
_RAM_DIR = Path("/dev/shm")
_RAM_DIR_MIN_FREE = 1 << 30


def scratch_parent() -> str | None:
    """Where a server's directory goes: $AWA_SA_PG_TMPDIR, else RAM if roomy, else the temp dir.

    Tests clone a database per test, and a v040 database is some 900 files. Creating them costs
    about 600 ms on the ext4 disk of a small VM even with fsync off, and about 40 ms on tmpfs.
    ``/dev/shm`` is used only with 1 GiB free: containers often give it 64 MB.
    """
    given = os.environ.get(SCRATCH_ENVIRONMENT_VARIABLE)
    if given:
        return given
    try:
        stat = os.statvfs(_RAM_DIR)
    except OSError:
        return None
    roomy = stat.f_bavail * stat.f_frsize >= _RAM_DIR_MIN_FREE
    return str(_RAM_DIR) if roomy and os.access(_RAM_DIR, os.W_OK | os.X_OK) else None


def _scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="awa-sa-pg-", dir=scratch_parent()))


_PORT_TRIES = 5
_PORT_TAKEN = "Address already in use"
"""The free port is chosen before initdb, about a second before the server binds it, and in
that second any socket may take it: a client connection's local port comes from the same
ephemeral range, and a suite's workers open hundreds. Then another free port is tried. (One
worker's server of a four-worker suite once failed to start, and its log went with its
directory; a failure's own log lines are now in the error.)"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedPostgres:
    """One running server: connect to ``host``:``port`` as ``user`` with ``password``."""

    bindir: Path = field(default_factory=find_bindir)
    host: str = "127.0.0.1"
    port: int = field(default_factory=_free_port)
    user: str = "postgres"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    """URL-safe, so it goes into a URL as it is."""
    root: Path = field(default_factory=_scratch_dir)
    settings: tuple[str, ...] = ()
    """Extra ``name=value`` server settings, after ours (the bench loads pg_stat_statements)."""
    _run_as: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError as exc:
                raise EmbeddedPostgresError(
                    "running as root needs an unprivileged 'postgres' account to start PostgreSQL"
                ) from exc
            self._run_as = "postgres"
            shutil.chown(self.root, user="postgres")
        self.root.chmod(0o700)
        if self._run_as is not None and not self._can_run_binaries():
            self.bindir = self._copy_installation()

    def _can_run_binaries(self) -> bool:
        try:
            probe = subprocess.run(
                [str(self.bindir / "postgres"), "--version"],
                check=False,
                user=self._run_as,
                cwd="/",
                capture_output=True,
            )
        except PermissionError:  # the account cannot reach or execute the file
            return False
        return probe.returncode == 0

    def _copy_installation(self) -> Path:
        """A copy of the installation the ``postgres`` account can read, inside our directory.

        A wheel's binaries live in a virtualenv, and root's (``/root/...``, mode 700) is closed
        to that account. PostgreSQL finds ``lib`` and ``share`` relative to ``bin``, and a wheel
        repaired by auditwheel finds its libraries in ``<package>.libs`` beside the package, so
        that layout is kept (some 40 MB, copied to RAM when there is room).
        """
        install = self.bindir.parent
        package = install.parent
        copy = self.root / "site" / package.name
        shutil.copytree(install, copy / install.name, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy.parent / libs.name, symlinks=True)
        return copy / install.name / self.bindir.name

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """The maintenance database with psycopg 3, password included."""
        return self.database_url("postgres")

    def database_url(self, dbname: str, scheme: str = "postgresql+psycopg") -> str:
        """*dbname* on this server, password included; ``scheme`` ``postgres`` suits libpq and
        the awa CLI."""
        return f"{scheme}://{self.user}:{self.password}@{self.host}:{self.port}/{dbname}"

    def _run(self, *args: str) -> None:
        proc = subprocess.run(
            [str(a) for a in args],
            check=False,
            user=self._run_as,
            cwd=self.root,
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
        )
        if proc.returncode != 0:
            detail = proc.stderr.strip() or proc.stdout.strip()
            raise EmbeddedPostgresError(
                f"{Path(args[0]).name} failed ({proc.returncode}): {detail}"
            )

    def start(self) -> EmbeddedPostgres:
        pwfile = self.root / "pwfile"  # in the server's private directory, gone after initdb
        pwfile.write_text(self.password)
        if self._run_as is not None:
            shutil.chown(pwfile, user=self._run_as)
        try:
            self._run(
                str(self.bindir / "initdb"),
                "-D",
                str(self.datadir),
                "-U",
                self.user,
                f"--pwfile={pwfile}",
                "--auth-host=scram-sha-256",
                "--auth-local=trust",  # the socket's directory admits the owner alone
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            )
        finally:
            pwfile.unlink()
        log = self.root / "server.log"
        for tries_left in reversed(range(_PORT_TRIES)):
            seen = log.stat().st_size if log.exists() else 0  # bytes, as the log is read back
            try:
                self._pg_ctl_start(log)
                return self
            except EmbeddedPostgresError as exc:
                said = log.read_bytes()[seen:].decode(errors="replace") if log.exists() else ""
                if tries_left and _PORT_TAKEN in said:
                    self.port = _free_port()
                    continue
                raise EmbeddedPostgresError(f"{exc}\n{said.strip()}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _pg_ctl_start(self, log: Path) -> None:
        options = " ".join(
            [f"-p {self.port}", f"-k {self.root}", f"-c listen_addresses={self.host}"]
            + [f"-c {s}" for s in (*_FAST_SETTINGS, *self.settings)]
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.datadir),
            "-o",
            options,
            "-l",
            str(log),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        if (self.datadir / "postmaster.pid").exists():
            with suppress(EmbeddedPostgresError):
                self._run(
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                )
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def embedded_postgres(settings: tuple[str, ...] = ()) -> Iterator[EmbeddedPostgres]:
    """Start a server, yield it, and remove it again whatever happens in between."""
    server = EmbeddedPostgres(settings=settings)
    try:
        yield server.start()
    finally:
        server.stop()
