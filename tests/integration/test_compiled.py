"""The compiled text the library sends: the listing's text, and the same rows as Core execution.

Executing the text with ``exec_driver_sql`` skips SQLAlchemy's per-call cache-key walk and
its bind and result processing; these tests pin down that nothing observable changes with it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import insert_job

import awa_sa_schema
from awa_sa import statements
from awa_sa.core import compiled
from awa_sa.core.internals import lookup
from awa_sa.settle.inputs import prepare
from awa_sa.settle.results import RetryAfter, Snooze
from awa_sa.settle.statements.attempts import item_binds
from awa_sa.tables import queue_storage
from awa_sa.tools import listing


def test_sent_text_is_the_listed_text(engine: sa.Engine) -> None:
    """The connection's own psycopg dialect renders what ``awa-sa sql`` prints, once."""
    with engine.connect():
        pass  # the dialect is initialised by the first connection
    for builder in statements.all_builders():
        for schema in ("awa", "awa_qs"):
            sent = compiled.compiled(builder(), engine.dialect, schema)
            assert sent.sql == listing.compile_statement(builder(), schema)
            assert compiled.compiled(builder(), engine.dialect, schema) is sent
            assert sent.defaults == {}  # every bind is required: a missing one is an error


def _both_ways(
    conn: sa.Connection, stmt: Any, params: dict[str, Any], schema: str | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of *stmt* executed as Core and as compiled text, each undone afterwards."""
    options = {"schema_translate_map": queue_storage.translate_map(schema)} if schema else {}
    out: list[list[dict[str, Any]]] = []
    for as_text in (False, True):
        savepoint = conn.begin_nested()
        if as_text:
            rows = compiled.execute(conn, stmt, params, schema)
        else:
            rows = conn.execute(stmt, params, execution_options=options).all()
        out.append([row._asdict() for row in rows])
        savepoint.rollback()
    return out[0], out[1]


def _same(core: list[dict[str, Any]], text: list[dict[str, Any]], *skip: str) -> None:
    """Same columns, same value types, same values (but *skip*)."""
    assert len(core) == len(text) > 0
    for a, b in zip(core, text, strict=True):
        assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in b.items()}
        assert {k: v for k, v in a.items() if k not in skip} == {
            k: v for k, v in b.items() if k not in skip
        }


@pytest.mark.parametrize("batch", [False, True])
def test_rows_and_types_match_core_execution(engine: sa.Engine, batch: bool) -> None:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
        jobs = [
            insert_job(
                conn,
                unique_key=b"k%d" % i,
                unique_states="11111000",
                metadata='{"a": 1}',
                tags=["t"],
                errors=['{"e": 1}'],
            )
            for i in range(2 if batch else 1)
        ]
    kinds = (Snooze(3), RetryAfter(4))
    calls = [prepare(j, 1, kind, {"x": 1}, [2]) for j, kind in zip(jobs, kinds, strict=False)]
    items = dict(item_binds([call.item for call in calls]))
    with engine.begin() as conn:
        core, text = _both_ways(conn, statements.take_and_allocate(batch=batch), items, "awa_qs")
        _same(core, text, "job_id")  # each run consumed its own nextval
        for row in text:
            assert isinstance(row["run_at"], datetime)
            assert row["run_at"].tzinfo is not None
            assert isinstance(row["unique_key"], bytes)
            for name in ("args", "state", "attempted_at", "created_at", "unique_states", "payload"):
                assert isinstance(row[name], str), name
        core, text = _both_ways(conn, statements.canonical_move(routed=False, batch=batch), items)
        _same(core, text)
        assert all(isinstance(row["run_at"], datetime) for row in text)
        assert all(row["run_at"].tzinfo is not None for row in text)
        claim: dict[str, Any] = {"b_unique_key": b"new", "b_job_id": 7}
        if batch:
            claim = {"b_unique_key": [b"new", b"new2"], "b_job_id": [7, 8]}
        _same(*_both_ways(conn, statements.claim_unique_keys(batch=batch), claim))
        _same(*_both_ways(conn, statements.ring_cursor(), {}, "awa_qs"))
        core, text = _both_ways(conn, statements.clock(), {})
        assert [type(v) for row in core + text for v in row.values()] == [str, str]


@pytest.mark.parametrize(
    "public",
    [
        pytest.param(
            False,
            marks=pytest.mark.skipif(lookup.PUBLIC_ONLY, reason="AWA_SA_PUBLIC_ONLY=1"),
            id="private",
        ),
        pytest.param(True, id="public"),
    ],
)
def test_lean_execution_is_exec_driver_sql_but_its_result(
    engine: sa.Engine, public: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``internals.lean_execute``: the same events, text, parameters, rows and errors as
    ``exec_driver_sql``; only the result differs (the rows, as named tuples). On the public
    path (a private name moved, or AWA_SA_PUBLIC_ONLY=1) it is ``exec_driver_sql`` itself."""
    from awa_sa.core.internals import lean_execute  # noqa: PLC0415 -- the internal under test

    monkeypatch.setattr(lookup, "PATHS", lookup.look_up(public_only=public))

    seen: list[tuple[str, str, Any]] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append(("before", statement, parameters))

    @sa.event.listens_for(engine, "after_cursor_execute")
    def after(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append(("after", statement, parameters))

    sql = "SELECT %(a)s::int AS a, 'x' AS b UNION ALL SELECT 2, 'y'"
    with engine.connect() as conn:
        rows = lean_execute(conn, sql, {"a": 1})
        assert conn.in_transaction()  # autobegun, as exec_driver_sql does
        plain = conn.exec_driver_sql(sql, {"a": 1}).all()
        assert rows == plain == [(1, "x"), (2, "y")]
        assert [r._asdict() for r in rows] == [r._asdict() for r in plain]
        assert [(r.a, r.b) for r in rows] == [(r.a, r.b) for r in plain]
        assert lean_execute(conn, "SELECT 1 WHERE false", {}) == []
        assert lean_execute(conn, "SET LOCAL lock_timeout = 0", {}) == []
        assert lean_execute(conn, "SELECT 1, 2 AS b", {})[0]._fields == ("_0", "b")
        with pytest.raises(sa.exc.DataError) as raised:
            lean_execute(conn, "SELECT 1 / %(z)s::int", {"z": 0})
        assert raised.value.statement == "SELECT 1 / %(z)s::int"
    assert seen[:2] == [("before", sql, {"a": 1}), ("after", sql, {"a": 1})]
    assert seen[2:4] == [("before", sql, {"a": 1}), ("after", sql, {"a": 1})]
