"""The README's "Testing your service" code is an excerpt of ``examples/``, which CI runs.

Its blocks are fenced ``py`` rather than ``python``: ``test_readme.py`` executes the ``python``
blocks of the usage section on their own, and an excerpt of a test module cannot run alone.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.search(
    r"^## Testing your service\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M
)


def test_the_readme_excerpts_are_the_example_verbatim() -> None:
    assert SECTION is not None
    blocks = re.findall(r"```py\n(.*?)```", SECTION.group(1), re.S)
    assert blocks
    example = "".join(path.read_text() for path in sorted((ROOT / "examples").glob("*.py")))
    for block in blocks:
        assert block in example
