"""Every statement builder compiles for PostgreSQL without a database, once per schema.

``awa_sa.core.compiled`` compiles each statement once per (statement object, dialect, schema) and
sends the text, so a builder must hand back the same object every time, carry values only as
named bind parameters (the text is reused for every call), and leave the queue-storage schema to
``schema_translate_map`` (the same object serves every schema).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import pytest
from sqlalchemy.dialects.postgresql import psycopg

from awa_sa import statements
from awa_sa.settle.statements.migration import Successor
from awa_sa.tables import queue_storage
from awa_sa.tables.canonical import CALLBACK_COLUMNS, scheduled_jobs

DIALECT = psycopg.dialect()


class Batched(Protocol):
    """A moving statement's builder: scalars for one attempt, arrays for a batch."""

    def __call__(self, *, batch: bool) -> Any: ...


BUILDERS = statements.all_builders()
IDS = [f"{b.func.__name__}{b.keywords or ''}" for b in BUILDERS]


def _compile(stmt: Any, schema: str | None = None) -> str:
    kw: dict[str, Any] = {}
    if schema is not None:
        kw = {"schema_translate_map": queue_storage.translate_map(schema)}
        kw["render_schema_translate"] = True
    return str(stmt.compile(dialect=DIALECT, **kw))


@pytest.mark.parametrize("builder", BUILDERS, ids=IDS)
def test_same_object_every_call(builder: Callable[[], Any]) -> None:
    assert builder() is builder()


@pytest.mark.parametrize("builder", BUILDERS, ids=IDS)
def test_only_named_bind_parameters(builder: Callable[[], Any]) -> None:
    """No Python literal slipped in as an auto-named parameter (``param_1``, ``job_id_1``)."""
    compiled = builder().compile(dialect=DIALECT)
    assert all(name.startswith(("guard_", "b_")) for name in compiled.params), compiled.params


QS_OBJECTS = sorted(
    [table.name for table in queue_storage.metadata.tables.values()]
    + [queue_storage.job_id_seq.name, queue_storage.ensure_lane_sequences.name]
)
"""Every queue-storage relation, sequence and function a statement can name."""


def _qualifiers(sql: str) -> set[str]:
    """The schema in front of each mention of a queue-storage object ("" when unqualified)."""
    found = set()
    for name in QS_OBJECTS:
        for match in re.finditer(rf"(?:([\w]+)\.)?\b{name}\b", sql):
            found.add(match.group(1) or "")
    return found


@pytest.mark.parametrize("builder", BUILDERS, ids=IDS)
def test_schema_only_through_translate_map(builder: Callable[[], Any]) -> None:
    """Each queue-storage object is named under the routed schema, whatever that is, and nowhere
    else: never unqualified (the search path would pick one) nor under a schema of its own."""
    untranslated = _qualifiers(_compile(builder()))
    assert untranslated <= {queue_storage.QS_PLACEHOLDER}
    for schema in ("awa", "awa_qs", "qs_probe"):
        translated = _qualifiers(_compile(builder(), schema))
        assert translated == ({schema} if untranslated else set()), schema


def test_routing_lock_is_a_share_lock() -> None:
    sql = _compile(statements.routing_lock())
    assert "FROM awa.storage_transition_state" in sql
    assert sql.rstrip().endswith("FOR SHARE")


@pytest.mark.parametrize("batch", [False, True])
def test_canonical_move_reads_routing_only_when_routed(batch: bool) -> None:
    routed = _compile(statements.canonical_move(routed=True, batch=batch))
    direct = _compile(statements.canonical_move(routed=False, batch=batch))
    assert "head AS MATERIALIZED" in routed
    assert "awa.active_queue_storage_schema()" in routed
    assert "active_queue_storage_schema" not in direct
    for sql in (routed, direct):
        assert sql.count("DELETE FROM awa.jobs_hot") == 1
        assert sql.count("INSERT INTO awa.scheduled_jobs") == 1
        assert "callback_id IS NULL" not in sql  # no callback exclusion canonically
        # The kind is a per-row value: one statement serves a mixed batch.
        backoff = "WHEN (taken.tag = 'retry_backoff') THEN awa.backoff_duration("
        assert backoff + "CAST(taken.attempt AS SMALLINT)" in sql
        assert "ELSE make_interval(0, 0, 0, 0, 0, 0, taken.delay)" in sql
        assert "ELSE 300000 END" in sql  # run_at must load as a Python datetime


@pytest.mark.parametrize("batch", [False, True])
def test_one_statement_locks_the_singleton_and_routes_from_its_columns(batch: bool) -> None:
    sql = _compile(statements.move_if_canonical(batch=batch))
    routing = sql.split("routing AS MATERIALIZED", 1)[1].split("head AS MATERIALIZED", 1)[0]
    assert "FROM awa.storage_transition_state AS transition" in routing
    assert routing.rstrip().rstrip(",").rstrip().endswith("singleton FOR SHARE)")
    # awa.active_storage_engine()'s expression, not a call: the function's snapshot is stale.
    assert "active_storage_engine()'" in sql  # only inside the guard's to_regprocedure
    assert "awa.active_storage_engine()" not in sql.replace("'awa.active_storage_engine()'", "")
    assert "awa.active_queue_storage_schema()" not in sql.replace(
        "'awa.active_queue_storage_schema()'", ""
    )
    assert "THEN coalesce(transition.prepared_engine, " in routing
    assert "coalesce(routing.engine, 'canonical') = 'queue_storage' AS queue_storage" in sql
    lookup = "(SELECT md5(prosrc) \nFROM pg_catalog.pg_proc \nWHERE oid = to_regprocedure"
    for name, md5 in statements.ROUTING_BODY_MD5.items():  # both, each by its oid, known
        assert f"{lookup}('{name}')) = '{md5}'" in sql
    last = list(statements.ROUTING_BODY_MD5.values())[-1]
    assert f"'{last}') IS true AS guarded" in sql  # a missing function (NULL) is not known
    # head reads the locked row in its FROM before its shared-key check reads jobs_hot.
    head = sql.split("head AS MATERIALIZED", 1)[1]
    assert "FROM (SELECT 1 AS one) AS one LEFT OUTER JOIN routing ON true)" in head
    assert sql.count("DELETE FROM awa.jobs_hot") == 1
    assert "(SELECT head.guarded \nFROM head)" in sql


def test_one_statement_moves_column_for_column_as_the_canonical_move() -> None:
    for batch in (False, True):
        one = _compile(statements.move_if_canonical(batch=batch))
        today = _compile(statements.canonical_move(routed=False, batch=batch))
        tail = "moved AS \n(INSERT INTO awa.scheduled_jobs"
        assert (
            one.split(tail, 1)[1].split(" SELECT head.", 1)[0]
            == (today.split(tail, 1)[1].split(" SELECT head.", 1)[0])
        )


@pytest.mark.parametrize(
    "builder", [partial(statements.canonical_move, routed=True), statements.take_and_allocate]
)
def test_moving_statements_take_a_batch_as_arrays(builder: Batched) -> None:
    """One row per attempt, its position kept, the first of each (job_id, lease) winning."""
    sql = _compile(builder(batch=True), "awa_qs")
    assert "unnest(%(guard_id)s::BIGINT[], %(guard_lease)s::BIGINT[], %(b_tag)s::TEXT[]" in sql
    columns = "job_id, lease, tag, delay, error, new_progress, want_kind, want_queue, want_attempt"
    assert f"WITH ORDINALITY AS item({columns}, ord)" in sql
    assert "SELECT DISTINCT ON (item.job_id, item.lease)" in sql
    assert "ORDER BY item.job_id, item.lease, item.ord" in sql
    assert "GROUP BY candidate.unique_key" in sql  # the shared-key check
    single = _compile(builder(batch=False), "awa_qs")  # scalars: a plan PostgreSQL can cache
    assert "unnest" not in single
    assert "CAST(%(guard_id)s::BIGINT AS BIGINT) AS job_id" in single
    assert "false AS shared_key" in single


@pytest.mark.parametrize("batch", [False, True])
def test_the_guard_checks_a_named_identity_and_nothing_else(batch: bool) -> None:
    sql = _compile(statements.move_if_canonical(batch=batch))
    for name in ("kind", "queue", "attempt"):
        row = "hot" if not batch else "awa.jobs_hot"  # the batch checks it as it locks
        assert f"{row}.{name} = coalesce(asked.want_{name}, {row}.{name})" in sql


def test_scheduled_insert_lists_all_27_columns() -> None:
    sql = _compile(statements.canonical_move(routed=False, batch=True))
    insert = sql.split("INSERT INTO awa.scheduled_jobs (", 1)[1].split(")", 1)[0]
    assert [c.strip() for c in insert.split(",")] == [c.name for c in scheduled_jobs.c]


def test_take_excludes_callback_wiring_and_allocates_from_the_schema_sequence() -> None:
    sql = _compile(statements.take_and_allocate(batch=True), "awa_qs")
    for column in CALLBACK_COLUMNS:
        assert f"awa.jobs_hot.{column} IS NULL" in sql
    assert "nextval('awa_qs.job_id_seq')" in sql
    assert "jobs_id_seq" not in sql
    assert "FROM timed ORDER BY timed.ord" in sql  # fresh ids in the caller's order


def test_deferred_insert_lists_all_16_columns_in_order() -> None:
    sql = _compile(statements.insert_deferred(batch=True), "awa_qs")
    head = sql.split("INSERT INTO awa_qs.deferred_jobs (", 1)[1].split(")", 1)[0]
    assert [c.strip() for c in head.split(",")] == [c.name for c in queue_storage.deferred_jobs.c]
    assert "FROM unnest(%(b_job_id)s::BIGINT[]" in sql  # one row per successor
    assert "RETURNING" not in sql


def test_claim_upsert_always_targets_schema_awa() -> None:
    sql = _compile(statements.claim_unique_keys(batch=True), "awa_qs")
    assert "INSERT INTO awa.job_unique_claims" in sql
    assert "ON CONFLICT (unique_key) DO UPDATE" in sql
    assert "WHERE awa.job_unique_claims.job_id = excluded.job_id" in sql


def test_lane_functions_take_smallints() -> None:
    sql = _compile(statements.ensure_lane_sequences(), "awa_qs")
    assert "awa_qs.ensure_lane_sequences(" in sql
    assert sql.count("AS SMALLINT)") == 2


def test_cancelled_row_and_delta_in_one_statement() -> None:
    sql = _compile(statements.insert_cancelled(), "awa_qs")
    assert "INSERT INTO awa_qs.done_entries" in sql
    assert "INSERT INTO awa_qs.queue_terminal_count_deltas" in sql
    assert "'cancelled'::awa.job_state" in sql


def test_a_successor_is_a_deferred_row_field_for_column() -> None:
    """``Successor`` is read from the take by field name and bound to the insert the same way."""
    assert Successor._fields == tuple(c.name for c in queue_storage.deferred_jobs.c)


def test_the_one_statement_fits_psycopgs_query_cache() -> None:
    """psycopg 3 caches a query's conversion (``%(name)s`` to ``$n``) only up to a length;
    past it, it converts the text again on every call (``_query2pg_nocache``). The limit is
    read from psycopg itself where it has one (4096 bytes since 3.2; 3.1 caches every query,
    so it is held to the same 4096 there)."""
    from psycopg import _queries  # noqa: PLC0415 - private, read for its limit

    limit = getattr(_queries, "MAX_CACHED_STATEMENT_LENGTH", 4096)
    sql = _compile(statements.move_if_canonical(batch=False))
    assert len(sql.encode()) <= limit
