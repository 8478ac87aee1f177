"""Every public name imports from a fresh interpreter: the layout under them may move, they may not.

``awa_sa``, ``awa_sa.asyncio`` and ``awa_sa.testing`` are the public API; a service imports
their names and nothing below them. A fresh interpreter, so no module this suite imported
first can hide a name that only resolves after another import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = ("awa_sa", "awa_sa.asyncio", "awa_sa.testing")

# The names each face exported before the capabilities became packages; a name may be added,
# none may go.
SINCE_THE_LAYOUT = {
    "awa_sa": 57,
    "awa_sa.asyncio": 15,
}


def _fresh(module: str) -> list[str]:
    script = (
        "import importlib, json; "
        f"m = importlib.import_module({module!r}); "
        "[getattr(m, n) for n in m.__all__]; "
        "print(json.dumps(sorted(m.__all__)))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    names: list[str] = json.loads(done.stdout)
    return names


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_imports_in_a_fresh_interpreter(module: str) -> None:
    names = _fresh(module)
    assert names
    assert len(names) >= SINCE_THE_LAYOUT.get(module, 1)
