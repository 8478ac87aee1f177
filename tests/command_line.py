"""The ``awa-sa`` command run as a user runs it (a subprocess), or in the test's own process.

A subprocess costs a Python start with SQLAlchemy and awa_sa imported (and coverage, under CI):
most of a second of CPU each (issue 39). Only what needs a real process runs as one: the entry
point, ``$DATABASE_URL`` from the environment, the demo's own server, Ctrl-C. Everything else
calls the command's own entry function, which ends the same way (click's standalone mode: the
``Error:`` line, the exit status) and gives the same result shape.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from awa_sa.tools.cli import main


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


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what the command does to its process: ``-v``'s handler and level on the ``awa_sa``
    logger (left behind, it would write to a closed buffer in later tests), the demo's signal
    handlers, and ``$DATABASE_URL``, unset as for the subprocess."""
    logger = logging.getLogger("awa_sa")
    handlers, level = list(logger.handlers), logger.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    url = os.environ.pop("DATABASE_URL", None)
    try:
        yield
    finally:
        if url is not None:
            os.environ["DATABASE_URL"] = url
        for sig, handler in signals.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        for added in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(added)
            added.close()
        logger.setLevel(level)


def awa_sa_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``awa-sa ARGS`` through its entry function. An exception the command lets out is not
    turned into an exit status: it fails the test, traceback and all."""
    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), redirect_stdout(out), redirect_stderr(err):
        try:
            main.main(args=list(args), prog_name="awa-sa")
        except SystemExit as exited:
            code = exited.code
        else:
            code = 0
    status = code if isinstance(code, int) else 0 if code is None else 1
    return subprocess.CompletedProcess(["awa-sa", *args], status, out.getvalue(), err.getvalue())


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
