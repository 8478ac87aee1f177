"""``python -m bench`` still runs, every part but the batch sizes, at the smallest settings.

The benchmark is not timed here (timings are the bench's business, not the suite's): this only
keeps it working as the code under it changes, so that ``./dev bench`` is there when asked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the whole benchmark, about 20 s at its smallest

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = (
    *("--rounds", "2", "--per-round", "2", "--warmup", "2"),
    *("--far-rounds", "1", "--far-per-round", "2", "--server-calls", "5"),
    *("--callers-seconds", "0.2", "--callers-rounds", "1"),
    *("--only", "single,breakdown,distance,server,callers,routing"),
)


def test_the_bench_runs_and_writes_every_part(tmp_path: Path) -> None:
    figures = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", *SMALLEST, "--json", str(figures)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    written = json.loads(figures.read_text())
    assert {"single", "distance", "server", "callers", "routing"} <= set(written)
