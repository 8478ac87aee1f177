"""``awa-sa sql`` lists every statement the library can send, exactly as it is compiled."""

from __future__ import annotations

import re
import subprocess

import pytest
from command_line import assert_one_line_error, awa_sa_in_process, printed_blocks
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

from awa_sa import statements
from awa_sa.tables import queue_storage as qs
from awa_sa.tools.listing import compile_statement


@pytest.fixture(scope="module")
def listed() -> subprocess.CompletedProcess[str]:
    """``awa-sa sql`` run once for the module's tests that read the default listing: each run
    compiles every statement (issue 39)."""
    return awa_sa_in_process("sql")


def expected_statements(schema: str) -> list[str]:
    return [compile_statement(build(), schema) for build in statements.all_builders()]


def same_tokens(printed: list[str], expected: list[str]) -> bool:
    """Equal but for whitespace, with every string literal intact: laid out, not changed."""
    for text in expected:
        if not all(literal in "\n".join(printed) for literal in re.findall(r"'[^']*'", text)):
            return False
    return sorted("".join(text.split()) for text in printed) == sorted(
        "".join(text.split()) for text in expected
    )


def test_sql_lists_every_builder_exactly_as_compiled() -> None:
    proc = awa_sa_in_process("sql", "--schema", "awa_qs")
    assert proc.returncode == 0, proc.stderr
    printed = [sql for _, sql in printed_blocks(proc.stdout)]
    expected = expected_statements("awa_qs")
    assert same_tokens(printed, expected)
    # The schema is rendered, never the placeholder; bind parameters keep their names.
    assert qs.QS_PLACEHOLDER not in proc.stdout
    assert "awa_qs.deferred_jobs" in proc.stdout
    assert "%(guard_id)s" in proc.stdout
    # And it is the same text as compiling the builder by hand with the translate map.
    lock = str(
        statements.routing_lock().compile(
            dialect=PGDialect_psycopg(),
            schema_translate_map={qs.QS_PLACEHOLDER: "awa_qs"},
            render_schema_translate=True,
        )
    )
    assert " ".join(lock.split()) in [" ".join(sql.split()) for sql in printed]


def test_sql_default_schema_is_awa(listed: subprocess.CompletedProcess[str]) -> None:
    proc = listed
    assert proc.returncode == 0, proc.stderr
    assert "awa.deferred_jobs" in proc.stdout
    printed = [sql for _, sql in printed_blocks(proc.stdout)]
    assert same_tokens(printed, expected_statements("awa"))


def test_sql_rejects_invalid_schema() -> None:
    assert_one_line_error(
        awa_sa_in_process("sql", "--schema", "Bad-Name"), "invalid SQL identifier"
    )


def test_sql_is_laid_out_for_review(listed: subprocess.CompletedProcess[str]) -> None:
    """Lines a reviewer can read, columns named after what they carry, comments without reST."""
    proc = listed
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100
    assert "anon_" not in proc.stdout
    assert "`" not in proc.stdout
    assert "END AS state," in proc.stdout  # the successor's state, labelled as its column


def test_status_without_a_database_names_both_ways_to_give_one() -> None:
    proc = awa_sa_in_process("status")  # $DATABASE_URL is unset for the command
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: no database given: pass --url URL, or set $DATABASE_URL"
    )
