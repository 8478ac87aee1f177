"""docs/architecture.md's module table names every module of ``awa_sa/``.

The table is where a second maintainer learns which module holds which concern; a module added
without a row there would be one they have to find by reading the code.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_every_module_of_the_package_has_a_row() -> None:
    rows = set(re.findall(r"^\| `([^`]+)` \|", ARCHITECTURE.read_text(), flags=re.MULTILINE))
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "awa_sa").rglob("*.py")}
    assert modules - rows == set()


def test_every_row_names_a_module_that_exists() -> None:
    rows = re.findall(r"^\| `([^`]+)` \|", ARCHITECTURE.read_text(), flags=re.MULTILINE)
    assert [row for row in rows if not (ROOT / row).exists()] == []
