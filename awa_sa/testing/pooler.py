"""A throwaway PgBouncer in front of a throwaway server, for the pooler tests and the bench.

Debian's ``pgbouncer`` (``./dev`` installs it), in transaction pooling mode unless asked
otherwise: the mode a service runs when it pools many callers onto a few server connections,
and the one that breaks drivers which keep prepared statements across transactions. Like the
server it fronts, it admits the server's owner alone: the same password (scram-sha-256), its
files in a directory only the server's account may enter.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from awa_sa.testing.errors import EmbeddedPostgresError
from awa_sa.testing.server import EmbeddedPostgres, scratch_parent

_BINARIES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")


def find_pgbouncer() -> str | None:
    """The pgbouncer binary, or None (``apt-get install pgbouncer``)."""
    return shutil.which("pgbouncer") or next((b for b in _BINARIES if Path(b).exists()), None)


@dataclass
class PgBouncer:
    """A running PgBouncer: connect to ``port`` with the fronted server's user and password."""

    server: EmbeddedPostgres
    port: int
    root: Path
    process: subprocess.Popen[bytes]

    def database_url(self, dbname: str, scheme: str = "postgresql+psycopg") -> str:
        """*dbname* on the fronted server, through the pooler."""
        direct = self.server.database_url(dbname, scheme)
        return direct.replace(f":{self.server.port}/", f":{self.port}/", 1)

    @property
    def log(self) -> str:
        return (self.root / "pgbouncer.log").read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def pgbouncer(
    server: EmbeddedPostgres, pool_size: int = 4, pool_mode: str = "transaction"
) -> Iterator[PgBouncer]:
    """PgBouncer with at most *pool_size* server connections per database and user."""
    binary = find_pgbouncer()
    if binary is None:
        raise EmbeddedPostgresError("pgbouncer not found; apt-get install pgbouncer (./dev does)")
    run_as = "postgres" if os.geteuid() == 0 else None  # PgBouncer refuses to run as root
    root = Path(tempfile.mkdtemp(prefix="awa-sa-pgbouncer-", dir=scratch_parent()))
    port = _free_port()
    (root / "userlist.txt").write_text(f'"{server.user}" "{server.password}"\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = scram-sha-256\nauth_file = {root / 'userlist.txt'}\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\n"
        f"logfile = {root / 'pgbouncer.log'}\n"
    )
    for path in (root, *root.iterdir()):
        if run_as is not None:
            shutil.chown(path, user=run_as)
    root.chmod(0o700)
    process = subprocess.Popen(
        [binary, str(root / "pgbouncer.ini")],
        user=run_as,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, process, root)
        yield PgBouncer(server, port, root, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait_listening(port: int, process: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (root / "pgbouncer.log").read_text(errors="replace")[-2000:]
            raise EmbeddedPostgresError(f"pgbouncer exited ({process.returncode}): {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)
    raise EmbeddedPostgresError("pgbouncer did not listen within 30 s")
