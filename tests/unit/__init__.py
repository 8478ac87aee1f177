"""Tests that need no database: statement compilation, the listing, input validation.

A package, so its modules and conftest never clash by name with those of tests/integration.
"""
