"""Unit tests run without PostgreSQL: one that asks for the session server fails at once."""

from __future__ import annotations

from typing import NoReturn

import pytest

_REFUSAL = "tests/unit runs without a database server; this test belongs in tests/integration"


@pytest.fixture(scope="session")
def pg() -> NoReturn:
    """Shadows the session server of tests/conftest.py, and every fixture built on it."""
    pytest.fail(_REFUSAL)


@pytest.fixture(scope="session")
def awa_databases() -> NoReturn:
    """Shadows the testing kit's server and template, which the suite's fixtures build on."""
    pytest.fail(_REFUSAL)
