"""Each test's CPU, its servers' and runtimes' included, when ``AWA_SA_TEST_CPU`` names a file.

CI is CPU-bound on 2 cores, so what a test costs the run is its CPU, not its wall time (which
the other workers' load stretches). Each pytest process moves itself into a cgroup v1
``cpuacct`` group of its own, which every process it starts stays in, detached servers too;
a test's CPU is the group's usage across its setup, call and teardown (a module's shared
set-up is counted to its first test). One line per test, appended: seconds, then the node id.
Where the cgroup cannot be made, nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT = os.environ.get("AWA_SA_TEST_CPU")


def _group() -> Path | None:
    group = CPUACCT / f"awa-sa-test-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


GROUP = _group() if OUT else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if GROUP is None or OUT is None:
        return (yield)
    usage = GROUP / "cpuacct.usage"
    before = int(usage.read_text())
    try:
        return (yield)
    finally:
        spent = (int(usage.read_text()) - before) / 1e9
        with open(OUT, "a") as out:
            out.write(f"{spent:8.2f} {item.nodeid}\n")
