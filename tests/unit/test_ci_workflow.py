"""The hosted-CI workflow runs each job of ``.ci/run`` as one matrix entry, and nothing else.

The workflow cannot run here, so this test is what keeps it in step: a job added to ``.ci/run``'s
``ALL_JOBS`` but not to the matrix would never run on hosted CI, and a matrix entry with no job
behind it would fail only there. It also holds the entry to calling ``.ci/run`` as root, so that
the two ways of running CI cannot drift into two definitions of it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RUN = (ROOT / ".ci" / "run").read_text()
WORKFLOW: dict[str, Any] = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())


def all_jobs() -> list[str]:
    found = re.search(r"^ALL_JOBS=\(([^)]*)\)$", RUN, re.M)
    assert found, ".ci/run no longer has an ALL_JOBS=(...) line"
    return found.group(1).split()


def the_job() -> dict[str, Any]:
    jobs: dict[str, dict[str, Any]] = WORKFLOW["jobs"]
    assert len(jobs) == 1, "one job, with one matrix entry per job of .ci/run"
    return next(iter(jobs.values()))


def test_the_matrix_is_all_jobs_in_their_order() -> None:
    assert the_job()["strategy"]["matrix"]["job"] == all_jobs()


def test_every_job_has_its_function_in_ci_run() -> None:
    defined = set(re.findall(r"^job_([a-z0-9-]+)\(\)", RUN, re.M))
    assert set(all_jobs()) <= defined


def test_each_entry_calls_ci_run_with_its_job_as_root_on_debian() -> None:
    job = the_job()
    assert job["strategy"]["fail-fast"] is False  # one failing cell says nothing of the others
    container = job["container"]
    assert container["image"].startswith(("debian:", "ubuntu:"))
    assert "--user" not in container.get("options", "")  # a container's default user is root
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert "bash .ci/run ${{ matrix.job }}" in runs


def test_the_whole_run_runs_every_job_once() -> None:
    """``.ci/run`` with no job named runs FIRST, then main beside BESIDE_MAIN and THEN: each job
    in exactly one of them."""
    named = ["main"]
    for name in ("FIRST", "BESIDE_MAIN", "THEN"):
        found = re.search(rf"^{name}=\(([^)]*)\)$", RUN, re.M)
        assert found, f".ci/run no longer has a {name}=(...) line"
        named += shlex.split(found.group(1))
    assert sorted(named) == sorted(all_jobs())
    assert len(named) == len(set(named))
