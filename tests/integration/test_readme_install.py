"""The README's install command, run as written in a fresh venv, then its quickstart's test.

A reader's first hour starts with these lines: a fresh clone, ``pip install`` with the extras the
README shows, and the quickstart's service and test in a project of their own, with the async
example beside them, run by pytest with nothing but what that install brought (the plugin,
pytest-asyncio, asyncpg). pip's cache
makes it quick and lets it run without a network once the dependencies have been fetched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import BLOCKS, QUICKSTART_TEST, SHELL

pytestmark = pytest.mark.slow  # a fresh clone and a pip install into a fresh venv

ROOT = Path(__file__).resolve().parents[2]


def run(command: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        command,
        shell=True,
        cwd=cwd,
        env=env,
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

    project = tmp_path / "project"
    project.mkdir()
    (project / "service.py").write_text(BLOCKS[QUICKSTART_TEST - 1])
    (project / "test_service.py").write_text(BLOCKS[QUICKSTART_TEST])
    for name in ("async_mailer.py", "test_async_mailer.py"):  # the README's async example
        (project / name).write_text((ROOT / "examples" / name).read_text())
    out = run("python -m pytest -v -p no:cacheprovider", project, env)
    assert "7 passed" in out  # the quickstart, and three async tests on psycopg and on asyncpg
    assert "[asyncpg] PASSED" in out
    modules = "asyncpg, pytest_asyncio, awa_sa.asyncio, awa_sa"
    imported = run(f"python -c 'import {modules}; print(awa_sa.__file__)'", project, env)
    assert imported.startswith(str(venv))  # the installed copy, not this checkout
