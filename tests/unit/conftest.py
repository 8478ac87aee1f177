"""Unit tests run without PostgreSQL: one that asks for the session server fails at once."""

from __future__ import annotations

from typing import NoReturn

import pytest


@pytest.fixture(scope="session")
def pg() -> NoReturn:
    """Shadows the session server of tests/conftest.py, and every fixture built on it."""
    pytest.fail("tests/unit runs without a database server; this test belongs in tests/integration")
