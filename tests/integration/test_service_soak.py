"""Proof III, at the suite's size: a service's whole traffic through awa-sa beside three real
awa-pg runtimes, across a real transition (tests/service_soak.py), direct.

``./dev soak --jobs N [--pooler]`` runs the same soak at any size on a throwaway server, and
through PgBouncer; the figures of the full-size runs are in docs/development.md#service-soak.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from service_checks import format_table
from service_soak import Soak, SoakConfig

pytestmark = pytest.mark.slow  # three real awa-pg runtimes and the real CLI, 30-50 s

JOBS = 150
"""Every plan, verb and phase a few times over; the transition comes at a quarter of them. A
tenth of them wait on callbacks (``SoakConfig.callbacks``; those on queue storage park) that the
receivers resolve."""


def test_a_services_traffic_beside_three_runtimes_through_a_transition(
    clone_database: Callable[[str], str], real_template: str, tmp_path: Path
) -> None:
    url = clone_database(real_template)
    figures = Soak(url, url, SoakConfig(jobs=JOBS), tmp_path).run()
    table = format_table(figures, "direct")
    print("\n" + table)
    assert figures.ok, table
    assert [t[0] for t in figures.counts["transitions"]] == [
        "prepare",
        "enter-mixed-transition",
        "finalize",
    ]
    ends = figures.counts["ends"]
    assert any(k.startswith("canonical") for k in ends), ends  # both planes ended jobs
    assert any(not k.startswith("canonical") for k in ends), ends
    assert figures.counts["callbacks"]["waits"] > 0, figures.counts["callbacks"]  # a few parked
