"""The README's install command, run as written in a fresh venv, then its testing example.

A reader's first hour starts with these lines: a fresh clone, ``pip install`` with the extras the
README shows, and the service whose test the README shows (``examples/invoicer.py``), with the
async mailer beside it, in a project of their own configured with the README's pytest settings,
run by pytest with nothing but what that install brought (the plugin, pytest-asyncio, asyncpg).
pip's cache
makes it quick and lets it run without a network once the dependencies have been fetched.

The same install must work for any account from any checkout: building or installing writes
nothing into the checkout, so an ordinary account installs from one that root built (with
setuptools it could not: root's ``awa_sa.egg-info/`` was in the way).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_readme import README, SHELL

pytestmark = pytest.mark.slow  # a fresh clone and a pip install into a fresh venv

ROOT = Path(__file__).resolve().parents[2]


def run(command: str, cwd: Path, env: dict[str, str], user: str | None = None) -> str:
    proc = subprocess.run(
        command,
        shell=True,
        cwd=cwd,
        env=env,
        user=user,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_readme_install_and_quickstart_work_in_a_fresh_venv(tmp_path: Path) -> None:
    clone, install = SHELL[0].splitlines()
    assert clone == "git clone <this repository> awa-sa"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    run(f"git clone -q {ROOT} awa-sa", tmp_path, env)
    run(install.replace("pip install", "pip install -q"), tmp_path, env)
    assert untouched(tmp_path / "awa-sa")

    project = tmp_path / "project"
    project.mkdir()
    [settings] = re.findall(r"```toml\n(.*?)```", README, re.S)  # the README's pytest settings
    (project / "pyproject.toml").write_text(settings)
    for name in ("invoicer.py", "test_invoicer.py", "async_mailer.py", "test_async_mailer.py"):
        (project / name).write_text((ROOT / "examples" / name).read_text())
    out = run("python -m pytest -v -p no:cacheprovider -W error", project, env)
    assert "9 passed" in out  # the invoicer's three, and the mailer's three on each driver
    assert "[asyncpg] PASSED" in out
    modules = "asyncpg, pytest_asyncio, awa_sa.asyncio, awa_sa"
    imported = run(f"python -c 'import {modules}; print(awa_sa.__file__)'", project, env)
    assert imported.startswith(str(venv))  # the installed copy, not this checkout


def untouched(checkout: Path) -> bool:
    """Whether git sees nothing new in *checkout*, not even an ignored file."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    return status.stdout == ""


ACCOUNT = "nobody"  # an ordinary account that every Debian and Ubuntu machine has
ACCOUNT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LC_ALL": "C.UTF-8"}


def a_python_for(account: str) -> str:
    """A Python 3.11+ the account can run and make a venv with (a pyenv under /root is closed)."""
    for python in (shutil.which("python3"), "/usr/bin/python3"):
        if python is None:
            continue
        check = "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))"
        try:
            probe = subprocess.run(
                [python, "-c", check], user=account, capture_output=True, check=False
            )
        except PermissionError:  # a directory on the way is closed to the account
            continue
        if probe.returncode == 0:
            return python
    pytest.skip(f"no Python 3.11+ with venv that {account} can run")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory root and the account both reach (pytest's own temp dir is closed to others)."""
    path = Path(tempfile.mkdtemp(prefix="awa-sa-install-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="root builds the checkout, another account installs")
def test_an_ordinary_account_installs_from_a_checkout_that_root_built(shared_dir: Path) -> None:
    python = a_python_for(ACCOUNT)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    checkout = shared_dir / "awa-sa"
    run(f"git clone -q {ROOT} {checkout}", shared_dir, env)
    # Root builds the checkout, and gathers every wheel the install needs, the build backend's
    # too: the account then installs without pip's cache (root's) or a network.
    wheels = shared_dir / "wheels"
    builder = shared_dir / "root-venv"
    run(f"{python} -m venv {builder}", shared_dir, env)
    pip = f"{builder}/bin/python -m pip -q"
    run(f"{pip} wheel -w {wheels} '{checkout}[asyncpg,testing]'", shared_dir, env)
    backend = tomllib.loads((checkout / "pyproject.toml").read_text())["build-system"]["requires"]
    run(f"{pip} download -d {wheels} " + " ".join(f"'{r}'" for r in backend), shared_dir, env)
    assert untouched(checkout)
    for built in wheels.glob("awa_sa-*.whl"):
        built.unlink()  # the account builds awa-sa from the checkout itself

    venv = shared_dir / "venv"
    venv.mkdir()
    shutil.chown(venv, ACCOUNT)
    run(f"{python} -m venv {venv}", shared_dir, ACCOUNT_ENV, user=ACCOUNT)
    install = f"{venv}/bin/python -m pip install -q --no-cache-dir --no-index --find-links {wheels}"
    run(f"{install} '{checkout}[asyncpg,testing]'", shared_dir, ACCOUNT_ENV, user=ACCOUNT)
    modules = "asyncpg, awa_sa.asyncio, pytest_awa_sa"
    imported = run(
        f"{venv}/bin/python -c 'import {modules}; print(awa_sa.__file__)'",
        shared_dir,
        ACCOUNT_ENV,
        user=ACCOUNT,
    )
    assert imported.startswith(str(venv))
    assert untouched(checkout)
