"""The declared tables equal what SQLAlchemy reflects, on the fixture and on a real cluster.

Statements are compiled from these tables; a column that is missing, renamed, retyped or of
the wrong nullability here would pass every fixture test and break in production.
"""

from __future__ import annotations

import observed_tables
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from awa_sa.tables import canonical as tables
from awa_sa.tables import queue_storage
from awa_sa.tables import runtime as runtime_tables
from awa_sa.tools.status import schema_version

CANONICAL = [
    *tables.metadata.sorted_tables,
    *observed_tables.metadata.sorted_tables,
    schema_version,
]
QUEUE_STORAGE = [
    *queue_storage.metadata.sorted_tables,
    *observed_tables.queue_storage_metadata.sorted_tables,
]


def _shape(table: sa.Table) -> tuple[list[tuple[str, str, bool]], list[str]]:
    columns = [(c.name, _type_name(c.type), bool(c.nullable)) for c in table.columns]
    return columns, sorted(c.name for c in table.primary_key.columns)


def _type_name(type_: sa.types.TypeEngine[object]) -> str:
    """A comparable name: the PostgreSQL spelling, with array element types kept."""
    return type_.compile(dialect=postgresql.dialect()).lower()


def _reflect(conn: sa.Connection, name: str, schema: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(), schema=schema, autoload_with=conn)


def assert_matches(
    engine: sa.Engine, schema_for: dict[str, str], real_only: list[sa.Table] | None = None
) -> None:
    with engine.connect() as conn:
        for declared in CANONICAL + QUEUE_STORAGE + (real_only or []):
            schema = schema_for.get(str(declared.schema), str(declared.schema))
            live = _reflect(conn, declared.name, schema)
            assert _shape(declared) == _shape(live), f"{schema}.{declared.name}"
        seq = queue_storage.job_id_seq
        found = conn.execute(
            sa.text(
                "select data_type from information_schema.sequences "
                "where sequence_schema = :s and sequence_name = :n"
            ),
            {"s": schema_for[queue_storage.QS_PLACEHOLDER], "n": seq.name},
        ).scalar_one()
        assert found == "bigint"


@pytest.mark.parametrize("qs_schema", ["awa", "awa_qs"])
def test_fixture_matches_metadata(engine: sa.Engine, qs_schema: str) -> None:
    assert_matches(engine, {queue_storage.QS_PLACEHOLDER: qs_schema})


@pytest.mark.parametrize("qs_schema", ["awa", "awa_qs"])
def test_real_cluster_matches_metadata(real_engine: sa.Engine, qs_schema: str) -> None:
    """Also the tables the fixture schema lacks (awa_sa.tables.runtime)."""
    real_only = runtime_tables.metadata.sorted_tables
    assert_matches(real_engine, {queue_storage.QS_PLACEHOLDER: qs_schema}, real_only)


def test_drift_is_detected(real_engine: sa.Engine) -> None:
    """The comparison can fail: a dropped NOT NULL on a scratch clone is reported."""
    with real_engine.begin() as conn:
        conn.execute(sa.text("alter table awa_qs.deferred_jobs alter column kind drop not null"))
    with pytest.raises(AssertionError, match=r"awa_qs\.deferred_jobs"):
        assert_matches(real_engine, {queue_storage.QS_PLACEHOLDER: "awa_qs"})
