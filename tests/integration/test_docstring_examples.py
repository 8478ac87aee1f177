"""The examples in the public docstrings run, against a real Awa v040 database from the kit.

Each docstring's examples are one doctest, run on a fresh database (the plugin's
``awa_engine``) given to it as ``engine``: the only name an example does not import itself, so a
reader can paste one into a session that has an engine. A module of :data:`MODULES` whose
docstrings gain an example is picked up here without a change (a module's examples that need no
database run in its own unit tests); one of the public entry points losing its example fails the
last test.
"""

from __future__ import annotations

import doctest
import importlib
import io

import pytest
import sqlalchemy as sa

import awa_sa
import awa_sa.asyncio
import awa_sa.testing

# By name: the kit's package re-exports `locate`, which hides the module of the same name.
MODULES = [
    importlib.import_module(name)
    for name in (
        "awa_sa",
        "awa_sa.settle.results",
        "awa_sa.settle.api",
        "awa_sa.asyncio",
        "awa_sa.testing.attempts",
        "awa_sa.testing.phases",
        "awa_sa.testing.locate",
    )
]
EXAMPLES = [
    test
    for module in MODULES
    for test in doctest.DocTestFinder(exclude_empty=True).find(module)
    if test.examples
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_the_example_runs(example: doctest.DocTest, awa_engine: sa.Engine) -> None:
    example.globs = {**example.globs, "engine": awa_engine}
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    runner.run(example, out=report.write)
    assert runner.failures == 0, report.getvalue()
    assert runner.tries == len(example.examples)


def test_every_public_entry_point_carries_an_example() -> None:
    """What a service calls, and what its tests call: each shows itself in use."""
    public = [
        awa_sa,  # reschedule_canonical_attempt and its batch form, shown in the package's
        awa_sa.asyncio.reschedule_canonical_attempt,
        awa_sa.Snooze,
        awa_sa.RetryBackoff,
        awa_sa.testing.running_attempt,
        awa_sa.testing.set_phase,
        awa_sa.testing.locate,
    ]
    assert [obj for obj in public if ">>>" not in (obj.__doc__ or "")] == []
    assert len(EXAMPLES) >= len(public)
