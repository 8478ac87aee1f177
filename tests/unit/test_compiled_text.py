"""Every statement compiles to the same text on every SQLAlchemy line CI runs, for every driver.

``compiled_statements.json`` holds the text (and the placeholder order of the positional
drivers) of every registered builder's statement, as SQLAlchemy 2.1.9 compiles it for each
driver's dialect with the queue-storage schema ``awa_qs``. CI runs this file on the newest 2.1,
the newest 2.0 and the 2.0 floor, so a line that compiled anything differently fails here rather
than in a service. One difference is known: before 2.0.37 the asyncpg dialect typed the bind
inside a ``CAST`` its own way (``CAST($2::INTEGER AS SMALLINT)`` where 2.1 writes
``CAST($2 AS SMALLINT)``, ``CAST($1 AS BYTEA)`` where 2.1 writes ``CAST($1::BYTEA AS BYTEA)``).
There the texts are compared without the bind's own type; the values awa-sa sends fit both (the
driver walk runs on that floor). After a deliberate change to a statement, rewrite the file on
2.1: ``AWA_SA_WRITE_COMPILED=1 python -m pytest tests/unit/test_compiled_text.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import asyncpg, pg8000, psycopg, psycopg2

from awa_sa import statements
from awa_sa.core import compiled

EXPECTED = Path(__file__).with_name("compiled_statements.json")
DIALECTS = {
    "psycopg": psycopg.PGDialect_psycopg,
    "psycopg2": psycopg2.PGDialect_psycopg2,
    "pg8000": pg8000.PGDialect_pg8000,
    "asyncpg": asyncpg.PGDialect_asyncpg,
}

BEFORE_2_0_37 = tuple(int(p) for p in sa.__version__.split(".")[:3]) < (2, 0, 37)
_BIND_TYPE_IN_CAST = re.compile(r"CAST\((\$\d+)::\w+ AS ")


def untyped_binds_in_casts(sql: str) -> str:
    return _BIND_TYPE_IN_CAST.sub(r"CAST(\1 AS ", sql)


def compile_all() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for driver, dialect_class in DIALECTS.items():
        dialect = dialect_class()
        for build in statements.all_builders():
            args = ", ".join(f"{k}={v!r}" for k, v in sorted(build.keywords.items()))
            text = compiled.compile_statement(build(), dialect, "awa_qs")
            out[f"{driver} {build.func.__name__}({args})"] = {
                "sql": text.sql,
                "positions": None if text.positions is None else list(text.positions),
            }
    return out


def test_every_statement_compiles_to_the_recorded_text() -> None:
    now = compile_all()
    if os.environ.get("AWA_SA_WRITE_COMPILED"):
        EXPECTED.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    expected = json.loads(EXPECTED.read_text())
    assert sorted(now) == sorted(expected)
    for key, recorded in expected.items():
        got, want = now[key], recorded
        if BEFORE_2_0_37 and key.startswith("asyncpg "):
            got = {**got, "sql": untyped_binds_in_casts(got["sql"])}
            want = {**want, "sql": untyped_binds_in_casts(want["sql"])}
        assert got == want, key
