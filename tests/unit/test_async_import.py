"""Without greenlet, ``import awa_sa.asyncio`` names the awa-sa extra that brings it."""

from __future__ import annotations

import subprocess
import sys

HIDE_GREENLET = "import sys; sys.modules['greenlet'] = None; import awa_sa.asyncio"


def test_the_async_face_without_greenlet_names_our_extra() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HIDE_GREENLET], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: awa_sa.asyncio needs greenlet: "
        "pip install 'awa-sa[async]' (or 'awa-sa[asyncpg]')"
    )
