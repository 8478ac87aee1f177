"""``awa-sa sql`` lists every statement the library can send, exactly as it is compiled."""

from __future__ import annotations

from command_line import assert_one_line_error, awa_sa_cmd, printed_blocks
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

from awa_sa import queue_storage as qs
from awa_sa import statements
from awa_sa.tools.listing import compile_statement


def expected_statements(schema: str) -> list[str]:
    return [compile_statement(build(), schema) for build in statements.all_builders()]


def test_sql_lists_every_builder_exactly_as_compiled() -> None:
    proc = awa_sa_cmd("sql", "--schema", "awa_qs")
    assert proc.returncode == 0, proc.stderr
    printed = [sql for _, sql in printed_blocks(proc.stdout)]
    expected = expected_statements("awa_qs")
    assert sorted(printed) == sorted(expected)
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
    assert lock in printed


def test_sql_default_schema_is_awa() -> None:
    proc = awa_sa_cmd("sql")
    assert proc.returncode == 0, proc.stderr
    assert "awa.deferred_jobs" in proc.stdout
    assert sorted(sql for _, sql in printed_blocks(proc.stdout)) == sorted(
        expected_statements("awa")
    )


def test_sql_rejects_invalid_schema() -> None:
    assert_one_line_error(awa_sa_cmd("sql", "--schema", "Bad-Name"), "invalid SQL identifier")
