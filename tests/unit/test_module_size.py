"""No module of ``awa_sa/`` over 400 lines: a module that outgrows it holds two concerns."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST = 400


def test_every_module_of_the_package_fits() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in (ROOT / "awa_sa").rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > MOST} == {}
