"""Imports run one way: tools -> testing kit -> core, and capabilities meet only in the shared
core (docs/architecture.md#modules).

Read from the source with ``ast``, so an import inside a function or under ``TYPE_CHECKING``
counts as much as one at the top: either would tie a lower layer to a higher one the day it runs.
``test_testing_plugin.py`` checks the other half at run time (``import awa_sa`` loads neither
the kit nor the tools).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {"core": 0, "testing": 1, "tools": 2}


def layer_of(module: str) -> str | None:
    """The layer of one of our modules; None for anything else (standard library, SQLAlchemy)."""
    top, _, rest = module.partition(".")
    if top == "awa_sa":
        if rest == "testing" or rest.startswith("testing."):
            return "testing"
        if rest in ("tools", "__main__") or rest.startswith("tools."):
            return "tools"
        return "core"
    if top in ("awa_sa_schema", "pytest_awa_sa"):
        return "testing"  # the fixture and the plugin are the kit's, outside the package
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    found = [*ROOT.glob("awa_sa/**/*.py"), *ROOT.glob("awa_sa_schema/**/*.py")]
    return sorted([*found, ROOT / "pytest_awa_sa.py"])


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """Every module *path* imports, relative imports resolved, with its line number."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            # `from awa_sa import testing` names a module, not an attribute.
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def violations(path: Path) -> list[str]:
    mine = layer_of(module_name(path))
    assert mine is not None
    found = []
    for line, target in imported(path):
        theirs = layer_of(target)
        if theirs is not None and LAYERS[theirs] > LAYERS[mine]:
            found.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    return found


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_from_a_layer_above_it(path: Path) -> None:
    assert violations(path) == []


SHARED = {"core", "tables"}
"""The packages every capability stands on; they import no capability."""
CAPABILITIES = {"settle", "enqueue", "administer", "callbacks", "read"}
EDGES = {"administer": {"settle"}, "callbacks": {"administer", "settle"}}
"""The edges between capabilities: cancelling a running attempt is settling it; ending a
callback wait deletes its lease and closes its receipt as the administering cancel and retry of
a wait do, and answers their ``JobRow``."""


def package_of(module: str) -> str | None:
    """The shared package or capability of a module of ``awa_sa``; None for the faces above."""
    parts = module.split(".")
    if parts[0] != "awa_sa" or (len(parts) < 3 and parts[-1] not in SHARED | CAPABILITIES):
        return None
    return parts[1] if parts[1] in SHARED | CAPABILITIES else None


def crossings(path: Path) -> list[str]:
    mine = package_of(module_name(path))
    if mine is None:
        return []
    allowed = {mine} | SHARED | EDGES.get(mine, set()) if mine in CAPABILITIES else SHARED
    found = []
    for line, target in imported(path):
        theirs = package_of(target)
        if theirs is not None and theirs not in allowed:
            found.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    return found


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_capabilities_meet_only_in_the_shared_core(path: Path) -> None:
    assert crossings(path) == []


def test_the_architecture_doc_names_the_edges() -> None:
    """docs/architecture.md draws every edge between capabilities this test allows."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for source, targets in EDGES.items():
        for target in targets:
            assert f"{source} -> {target}" in text


def test_the_fixture_is_independent_of_the_library() -> None:
    """awa_sa_schema builds a database as Awa would; it must not lean on what it tests."""
    for path in ROOT.glob("awa_sa_schema/**/*.py"):
        assert not [t for _, t in imported(path) if t.partition(".")[0] == "awa_sa"], path


def test_the_walk_sees_every_kind_of_import() -> None:
    """The reader itself: a plain, a from, a relative and a function-local import are all seen."""
    source = ROOT / "awa_sa" / "settle" / "results.py"
    names = {target for _, target in imported(source)}
    assert "awa_sa.core.errors" in names
    plugin = {target for _, target in imported(ROOT / "pytest_awa_sa.py")}
    assert "awa_sa.testing.databases" in plugin  # imported inside a fixture
    relative = {target for _, target in imported(ROOT / "awa_sa_schema" / "build.py")}
    assert "awa_sa_schema._sql" in relative
    assert layer_of("awa_sa.tools.cli") == "tools"
    assert layer_of("awa_sa.testing") == "testing"
    assert layer_of("awa_sa.settle.api") == "core"
    assert layer_of("sqlalchemy") is None
    assert package_of("awa_sa.enqueue.api") == "enqueue"
    assert package_of("awa_sa.core") == "core"
    assert package_of("awa_sa.asyncio") is None
