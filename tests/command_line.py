"""The ``awa-sa`` command run as a user runs it: a subprocess, its exit status and its output."""

from __future__ import annotations

import os
import subprocess
import sys


def awa_sa_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "awa_sa", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def printed_blocks(output: str) -> list[tuple[str, str]]:
    """(title, sql) for each block: a ``-- title`` line, comment lines, then the statement."""
    blocks = []
    for chunk in output.strip().split("\n\n"):
        lines = chunk.splitlines()
        assert lines[0].startswith("-- "), chunk
        body = "\n".join(line for line in lines if not line.startswith("-- "))
        assert body.endswith(";")
        blocks.append((lines[0][3:], body[:-1]))
    return blocks
