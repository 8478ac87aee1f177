"""The tools built on the library: the ``awa-sa`` command, the demo, the throwaway server,
cluster status and the statement listing.

Imports go one way: a tool imports the core (``awa_sa``), the core never imports a tool, so
``import awa_sa`` loads neither click nor Alembic.
"""
