"""Soak (issue #6): concurrent writers, double completions, rescues and a live storage transition.

The harness is ``soak.py``; this file runs it once, on a real ``awa migrate`` cluster, with
transitions through Awa's own ``awa.storage_*`` functions. The run is bounded (5 s by default;
``AWA_SA_SOAK_SECONDS`` sets it). Figures are printed (``pytest -s``) and written to
``soak-real.json`` in the test's own temporary directory (pytest keeps the last three runs'
under its base temporary directory).

It ran on the Alembic fixture too, for twice as long, until that run was dropped for CI's CPU
(issue 39): it proved nothing of awa-sa that this one does not. Every object awa-sa's statement
touches there (tables, triggers, the routing functions byte for byte) is the real one, as
``test_catalog_parity.py`` checks; what differs is only how the storage phases move: the
fixture has no ``awa.storage_*`` functions, so the harness emulated them
(``racing.EmulatedTransitions``). A soak on the emulation proves the emulation against the soak;
here the real functions take their real locks. The same holds for every scenario the
``cluster`` fixture runs (tests/conftest.py): real clusters only, since 2026-12-06.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from racing import RealTransitions
from soak import Report, Soak, SoakConfig, format_report, write_report

pytestmark = pytest.mark.slow  # one bounded soak, 5 s

SOAK_SECONDS = float(os.environ.get("AWA_SA_SOAK_SECONDS", "5"))


def _finish(report: Report, directory: Path) -> None:
    path = directory / f"soak-{report.kind}.json"
    write_report(report, path)
    print()
    print(format_report(report))
    print(f"  figures written to {path}")
    assert not report.problems, "\n".join(report.problems[:40])

    # The run exercised what it is meant to exercise (a quiet soak proves nothing).
    f = report.figures
    outcomes = f["outcomes"]
    for outcome in ("Rescheduled", "Migrated", "CancelledDuplicate", "Stale"):
        assert outcomes.get(outcome, 0) > 0, f"no {outcome} in {outcomes}"
    assert outcomes.get("error:UniqueConflict", 0) > 0
    assert f["double_completion_races"].get("won", 0) > 0
    assert f["rescues"] > 0
    assert f["claims"] > 0
    assert f["late_completions"] > 0
    assert set(f["by_form"]) == {
        "engine",
        "connection",
        "rollback",
        "async_engine",
        "async_connection",
    }
    phases = [(t["name"].split()[0], t["state"]) for t in f["transitions"]]
    assert phases == [
        ("prepare", "prepared"),
        ("enter_mixed", "mixed_transition"),
        ("abort", "canonical"),
        ("prepare", "prepared"),
        ("enter_mixed", "mixed_transition"),
        ("finalize", "active"),
    ]
    abort = f["transitions"][2]
    assert abort["waiting_at_commit"] >= 1  # writers were queued behind the abort


def test_soak_on_a_real_cluster(real_db_url: str, real_engine: sa.Engine, tmp_path: Path) -> None:
    """Transitions through ``awa.storage_prepare/enter_mixed_transition/abort/finalize``, with a
    live queue-storage runtime registered for the flip and retired for abort."""
    config = SoakConfig(seconds=SOAK_SECONDS, jobs=80, label="real")
    _finish(Soak(real_db_url, RealTransitions(real_engine), config).run(), tmp_path)
