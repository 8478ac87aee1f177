"""The tools built on the library: the ``awa-sa`` command, the demo, cluster status and the
statement listing.

The top layer: a tool may import the testing kit (the demo runs on its throwaway server and
claims jobs with its helpers) and the core, and neither imports a tool, so ``import awa_sa``
loads neither click nor Alembic (docs/architecture.md#modules).
"""
