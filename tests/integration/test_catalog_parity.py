"""The Alembic fixture agrees with ``v040_catalog.json`` for every object it creates.

The catalog was dumped from a database built by awa-cli 0.6.9. The same reader is also run
against such a database: if the reader mis-read a fact, the real cluster would disagree with
its own dump, so a clean fixture result cannot be the reader's blind spot.

Every test reads one module-wide clone per template; tests that change the schema (drift, a
late substrate) do it inside a transaction that is rolled back, since PostgreSQL DDL is
transactional.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from catalog_facts import (
    Facts,
    cloned_database,
    diff,
    expected_objects,
    expected_seed_rows,
    live_objects,
    load_catalog,
    object_diff,
    read_seed_rows,
)

import awa_sa_schema
from awa_sa.statements import ROUTING_BODY_MD5
from awa_sa.testing.server import EmbeddedPostgres

SCHEMAS = ("awa", "awa_qs")

_TRANSITIONS = (
    "RETURNS TABLE(current_engine text, active_engine text, prepared_engine text, state text, "
    "transition_epoch bigint, details jsonb, entered_at timestamp with time zone, "
    "updated_at timestamp with time zone, finalized_at timestamp with time zone)"
)
_STORAGE_FUNCTIONS = "the fixture sets phases by writing rows (docs/architecture.md#phases)"
_PRODUCER = "producer path, never reached by the reschedule (docs/architecture.md#fixture)"

# Catalog objects the fixture leaves out on purpose, with the reason. The parity test fails if
# the fixture grows one of them without updating this list, or drops anything else.
OMITTED: dict[str, str] = {
    "relation awa.runtime_instances": (
        "only the storage_* transition gates read runtime snapshots; the fixture has no such "
        "functions"
    ),
    "relation awa.admin_dirty_queues": "legacy dirty keys; the patched triggers write *_marks",
    "relation awa.admin_dirty_kinds": "legacy dirty keys; the patched triggers write *_marks",
    f"function awa.storage_status() {_TRANSITIONS}": _STORAGE_FUNCTIONS,
    f"function awa.storage_prepare(p_engine text, p_details jsonb) {_TRANSITIONS}": (
        _STORAGE_FUNCTIONS
    ),
    f"function awa.storage_enter_mixed_transition() {_TRANSITIONS}": _STORAGE_FUNCTIONS,
    f"function awa.storage_abort() {_TRANSITIONS}": (
        _STORAGE_FUNCTIONS
        + "; it also counts rows in 14 queue-storage tables, 5 of which the fixture omits"
    ),
    f"function awa.storage_finalize() {_TRANSITIONS}": _STORAGE_FUNCTIONS,
    "function awa.storage_auto_finalize_if_fresh(p_schema text) RETURNS boolean": (
        _STORAGE_FUNCTIONS
    ),
    "function awa.canonical_live_backlog() RETURNS bigint": (
        "only the finalize gate calls it, and finalize is omitted"
    ),
    "function awa.release_queue_storage_unique_claim(p_job_id bigint, p_unique_key bytea, "
    "p_unique_states text, p_state awa.job_state) RETURNS void": (
        "not called by the reschedule, which only acquires claims (docs/contract.md#claims)"
    ),
    "function awa.reserve_enqueue_seq(p_queue text, p_priority smallint, "
    "p_enqueue_shard smallint, p_count bigint) RETURNS bigint": _PRODUCER,
    "function awa_qs.reserve_enqueue_seq(p_queue text, p_priority smallint, "
    "p_enqueue_shard smallint, p_count bigint) RETURNS bigint": _PRODUCER,
}


@pytest.fixture(scope="module")
def catalog() -> Facts:
    return load_catalog()


@pytest.fixture(scope="module")
def expected(catalog: Facts) -> dict[str, Facts]:
    return expected_objects(catalog)


@pytest.fixture(scope="module")
def fixture_db(pg: EmbeddedPostgres, fixture_template: str) -> Iterator[sa.Engine]:
    with cloned_database(pg, fixture_template) as engine:
        yield engine


@pytest.fixture(scope="module")
def awa_cli_db(pg: EmbeddedPostgres, real_template: str) -> Iterator[sa.Engine]:
    with cloned_database(pg, real_template) as engine:
        yield engine


@pytest.fixture
def fixture_conn(fixture_db: sa.Engine) -> Iterator[sa.Connection]:
    with fixture_db.connect() as conn:
        conn.begin()
        try:
            yield conn
        finally:
            conn.rollback()


def _live(engine: sa.Engine) -> dict[str, Facts]:
    with engine.connect() as conn:
        return live_objects(conn, SCHEMAS)


def test_fixture_objects_match_the_catalog(
    fixture_db: sa.Engine, expected: dict[str, Facts]
) -> None:
    assert object_diff(expected, _live(fixture_db)) == []


def test_fixture_creates_the_catalog_minus_the_documented_omissions(
    fixture_db: sa.Engine, expected: dict[str, Facts]
) -> None:
    live = _live(fixture_db)
    assert sorted(expected.keys() - live.keys()) == sorted(OMITTED)
    assert sorted(live.keys() - expected.keys()) == []


def test_reader_agrees_with_a_cluster_built_by_awa_cli(
    awa_cli_db: sa.Engine, expected: dict[str, Facts]
) -> None:
    live = _live(awa_cli_db)
    assert sorted(expected.keys() - live.keys()) == []
    assert object_diff(expected, live) == []


@pytest.mark.parametrize("source", ["fixture_db", "awa_cli_db"])
def test_seed_rows_match_the_catalog(
    request: pytest.FixtureRequest, source: str, catalog: Facts
) -> None:
    engine: sa.Engine = request.getfixturevalue(source)
    with engine.connect() as conn:
        assert diff(expected_seed_rows(catalog), read_seed_rows(conn, SCHEMAS)) == []


def test_a_substrate_added_later_matches_the_catalog(
    fixture_conn: sa.Connection, catalog: Facts
) -> None:
    """install_queue_storage on an existing fixture yields awa_qs's facts under the new name."""
    awa_sa_schema.install_queue_storage(fixture_conn, "tenant_7")
    awa_sa_schema.install_queue_storage(fixture_conn, "tenant_7")  # a second call changes nothing
    renamed = json.loads(
        json.dumps(catalog["queue_storage_schemas"]["awa_qs"]).replace("awa_qs", "tenant_7")
    )
    everything = expected_objects(
        {
            "relations": {},
            "sequences": {},
            "functions": {},
            "enums": {},
            "queue_storage_schemas": {"tenant_7": renamed},
        }
    )
    wanted = {k: v for k, v in everything.items() if "reserve_enqueue_seq" not in k}
    live = live_objects(fixture_conn, ["tenant_7"])
    assert sorted(live) == sorted(wanted)
    assert object_diff(wanted, live) == []


@pytest.mark.parametrize(
    ("ddl", "expected_lines"),
    [
        pytest.param(
            "ALTER TABLE awa.deferred_jobs ALTER COLUMN payload SET NOT NULL",
            ["relation awa.deferred_jobs: columns[15].nullable: expected True, got False"],
            id="nullability",
        ),
        pytest.param(
            "ALTER TABLE awa_qs.queue_lanes ALTER COLUMN next_seq SET DEFAULT 2",
            ["relation awa_qs.queue_lanes: columns[2].default: expected '1', got '2'"],
            id="default",
        ),
        pytest.param(
            "DROP INDEX awa.idx_awa_jobs_hot_heartbeat",
            [
                "relation awa.jobs_hot: indexes.idx_awa_jobs_hot_heartbeat: missing (expected "
                "{'name': 'idx_awa_jobs_hot_heartbeat', 'unique': False, 'primary': False, "
                "'definition': \"CREATE INDEX idx_awa_jobs_hot_heartbeat ON awa.jobs_hot USING "
                "btree (heartbeat_at) WHERE (state = 'running'::awa.job_state)\"})"
            ],
            id="index",
        ),
        pytest.param(
            "ALTER FUNCTION awa.active_queue_storage_schema() VOLATILE",
            [
                "function awa.active_queue_storage_schema() RETURNS text: volatility: "
                "expected 'STABLE', got 'VOLATILE'"
            ],
            id="volatility",
        ),
    ],
)
def test_drift_is_reported_as_exactly_that_difference(
    fixture_conn: sa.Connection, expected: dict[str, Facts], ddl: str, expected_lines: list[str]
) -> None:
    fixture_conn.exec_driver_sql(ddl)
    assert object_diff(expected, live_objects(fixture_conn, SCHEMAS)) == expected_lines


# Functions whose bodies the fixture writes itself, with the reason. Every other function both
# databases have must have Awa's body byte for byte; the routing pair above all, because the
# one-statement canonical reschedule inlines it and guards that copy by these very bytes.
_FROM_PROSE = "written from the catalog's prose; test_fixture_functions checks it against Awa's"
_SUBSTRATE = "the fixture's queue-storage substrate (docs/architecture.md#fixture), same behaviour"
OWN_BODIES: dict[str, str] = {
    "awa.backoff_duration(smallint,smallint)": _FROM_PROSE,
    "awa.job_state_in_bitmask(bit,awa.job_state)": _FROM_PROSE,
    "awa.sync_job_unique_claims()": _FROM_PROSE,
    "awa.mark_dirty_keys_delete()": _FROM_PROSE + "; writes *_marks only",
    "awa.mark_dirty_keys_insert()": _FROM_PROSE + "; writes *_marks only",
    "awa.mark_dirty_keys_update()": _FROM_PROSE + "; writes *_marks only",
    "awa.notify_new_job()": _FROM_PROSE,
    "awa.ensure_lane_sequences(text,smallint,smallint)": _SUBSTRATE,
    "awa.queue_claim_head_sequence_sync()": _SUBSTRATE,
    "awa.queue_enqueue_head_sequence_sync()": _SUBSTRATE,
    "awa.queue_lane_sequence_name(text,text,smallint,smallint)": _SUBSTRATE,
    "awa.sequence_next_value(text)": _SUBSTRATE,
    "awa.set_sequence_next(text,bigint)": _SUBSTRATE,
}

_BODIES = sa.text(
    """
    SELECT p.oid::regprocedure::text AS function, md5(p.prosrc) AS body
    FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
    WHERE n.nspname = 'awa' AND p.prokind = 'f'
    """
)


def _bodies(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {row.function: row.body for row in conn.execute(_BODIES)}


def test_function_bodies_are_awa_clis_except_the_documented_ones(
    fixture_db: sa.Engine, awa_cli_db: sa.Engine
) -> None:
    fixture, real = _bodies(fixture_db), _bodies(awa_cli_db)
    differing = {name for name in fixture.keys() & real.keys() if fixture[name] != real[name]}
    assert sorted(differing) == sorted(OWN_BODIES)


@pytest.mark.parametrize("source", ["fixture_db", "awa_cli_db"])
def test_routing_bodies_are_the_ones_the_one_statement_path_inlines(
    request: pytest.FixtureRequest, source: str
) -> None:
    bodies = _bodies(request.getfixturevalue(source))
    assert {name: bodies[name] for name in ROUTING_BODY_MD5} == ROUTING_BODY_MD5
