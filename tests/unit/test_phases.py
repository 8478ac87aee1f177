"""The storage phases are named once: the kit's ``Phase``, whose names key the fixture's rows."""

from __future__ import annotations

import awa_sa_schema
from awa_sa.testing.phases import PHASES


def test_the_fixture_writes_rows_for_exactly_the_kits_phases() -> None:
    assert awa_sa_schema.PHASES == PHASES
