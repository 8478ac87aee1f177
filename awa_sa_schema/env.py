"""Alembic entry point for the awa-sa v040 test fixture; the logic lives in ``environment``.

Alembic executes this file by path, outside the package, so it imports the installed package
by name. mypy checks this directory as a plain package and cannot resolve that name.
"""

from awa_sa_schema.environment import run  # type: ignore[import-not-found, unused-ignore]

run()
