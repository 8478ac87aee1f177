"""Alembic revisions of the fixture schema (Alembic loads them by path, not by import)."""
