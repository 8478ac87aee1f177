"""Cluster status: phase, routing and backlog counts, on the fixture and on a real cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from conftest import Cluster

from awa_sa.tables import queue_storage as qs
from awa_sa.tables.canonical import jobs_hot, scheduled_jobs
from awa_sa.tools.errors import NotAnAwaCluster, UnsupportedSchemaVersion
from awa_sa.tools.planes import WHAT_AWA_SA_CAN_DO, explain
from awa_sa.tools.status import read_status, read_status_in, schema_version

# phase -> (state, epoch, routing) as awa's CLI leaves them, routing to awa_qs once flipped.
EXPECTED = {
    "canonical": ("canonical", 0, None),
    "prepared": ("prepared", 1, None),
    "mixed_transition": ("mixed_transition", 2, "awa_qs"),
    "active": ("active", 3, "awa_qs"),
    "aborted": ("canonical", 3, None),
}


def add_canonical(conn: sa.Connection, table: sa.Table, states: Sequence[str]) -> None:
    for state in states:
        conn.execute(
            sa.insert(table).values(
                kind="status_test",
                queue="q",
                args={},
                state=state,
                run_lease=1 if state == "running" else 0,
                attempt=1 if state == "running" else 0,
            )
        )


def add_deferred(conn: sa.Connection, schema: str, states: Sequence[str]) -> None:
    conn = conn.execution_options(schema_translate_map=qs.translate_map(schema))
    for state in states:
        new_id = conn.execute(sa.select(qs.job_id_seq.next_value())).scalar_one()
        conn.execute(
            sa.insert(qs.deferred_jobs).values(
                job_id=new_id,
                kind="status_test",
                queue="q",
                args={},
                state=state,
                priority=2,
                attempt=0,
                run_lease=0,
                max_attempts=25,
                run_at=sa.func.now(),
                created_at=sa.func.now(),
            )
        )


# awa's CLI step that enters each phase from the one before it (docs/architecture.md#real-cluster).
CLI_STEP = {
    "prepared": (
        "storage",
        "prepare",
        "--engine",
        "queue_storage",
        "--details",
        '{"schema": "awa_qs"}',
    ),
    "mixed_transition": ("storage", "enter-mixed-transition", "--quiesced"),
    "active": ("storage", "finalize"),
    "aborted": ("storage", "abort"),
}


def advance(cluster: Cluster, phase: str) -> None:
    """One step along the transition, the way Awa's own CLI takes it."""
    cluster.awa(*CLI_STEP[phase])


def check_phase(cluster: Cluster, phase: str) -> None:
    st = read_status(cluster.engine)
    state, epoch, routing = EXPECTED[phase]
    assert (st.phase, st.epoch, st.routing_schema) == (state, epoch, routing), phase
    assert st.schema_version == 40
    # `awa migrate` installs the substrate in `awa`: installed in every phase.
    assert st.queue_storage_installed
    if phase in ("prepared", "mixed_transition", "active"):
        assert st.queue_storage_schema == "awa_qs"
    else:
        assert st.queue_storage_schema is None


@pytest.mark.parametrize(
    "path",
    [
        ("canonical", "prepared", "mixed_transition", "active"),
        ("canonical", "prepared", "mixed_transition", "aborted"),
    ],
    ids=["to-active", "to-abort"],
)
def test_phase_and_routing(cluster: Cluster, path: tuple[str, ...]) -> None:
    """Each phase along a transition path, read after the step that entered it."""
    check_phase(cluster, path[0])
    for phase in path[1:]:
        advance(cluster, phase)
        check_phase(cluster, phase)


def test_counts_and_finalize_gate(cluster: Cluster) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        add_canonical(conn, jobs_hot, ["running", "running", "available", "completed", "failed"])
        add_canonical(conn, scheduled_jobs, ["scheduled", "retryable", "retryable"])
        add_deferred(conn, "awa_qs", ["scheduled", "retryable", "retryable", "retryable"])
        add_deferred(conn, "awa", ["scheduled"])  # not the routing target: not counted
    st = read_status(cluster.engine)
    assert st.jobs_hot == {"available": 1, "running": 2, "completed": 1, "failed": 1}
    assert st.scheduled_jobs == {"scheduled": 1, "retryable": 2}
    assert st.deferred_jobs == {"scheduled": 1, "retryable": 3}
    assert st.canonical_live_backlog == 3 + 3
    assert not st.finalize_ready
    with cluster.engine.connect() as conn:
        real = conn.execute(sa.select(sa.func.awa.canonical_live_backlog())).scalar_one()
    assert real == st.canonical_live_backlog


def test_finalize_ready_once_canonical_drains(cluster: Cluster) -> None:
    cluster.set_phase("mixed_transition", "awa_qs")
    with cluster.engine.begin() as conn:
        add_canonical(conn, jobs_hot, ["completed", "cancelled"])
        add_deferred(conn, "awa_qs", ["retryable"])
    st = read_status(cluster.engine)
    assert st.canonical_live_backlog == 0
    assert st.finalize_ready
    assert st.as_dict()["finalize_ready"] is True


def test_prepared_without_named_schema_defaults_to_awa(cluster: Cluster) -> None:
    cluster.set_phase("prepared", "awa")
    st = read_status(cluster.engine)
    assert (st.phase, st.routing_schema, st.queue_storage_schema) == ("prepared", None, "awa")


def test_status_runs_read_only(engine: sa.Engine) -> None:
    """The read itself is accepted by a READ ONLY transaction, so it cannot have written."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        st = read_status_in(conn)
        ro = conn.exec_driver_sql("SHOW transaction_read_only").scalar_one()
        conn.rollback()
    assert ro == "on"
    assert st.phase == "canonical"


def test_missing_singleton_reads_as_canonical(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.exec_driver_sql("DELETE FROM awa.storage_transition_state")
        st = read_status_in(conn)
        conn.rollback()
    assert (st.phase, st.epoch, st.routing_schema) == ("canonical", None, None)


def test_not_an_awa_cluster(clone_database: Callable[[str], str]) -> None:
    engine = sa.create_engine(clone_database("template1"), poolclass=sa.NullPool)
    with pytest.raises(NotAnAwaCluster, match="not an Awa cluster"):
        read_status(engine)
    engine.dispose()


@pytest.mark.parametrize("version", [41, None])
def test_wrong_schema_version(engine: sa.Engine, version: int | None) -> None:
    with engine.begin() as conn:
        if version is None:
            conn.execute(sa.delete(schema_version))
        else:
            conn.execute(
                sa.insert(schema_version).values(
                    version=version, description="future", applied_at=sa.func.now()
                )
            )
    with pytest.raises(UnsupportedSchemaVersion, match="supports v040") as info:
        read_status(engine)
    assert info.value.version == version


# --- the plane, and whether a fresh cluster auto-finalizes --------------------------------

PLANE = {
    "canonical": "canonical",
    "prepared": "prepared",
    "mixed_transition": "mixed",
    "active": "queue storage",
    "aborted": "canonical",
}


@pytest.mark.parametrize("phase", sorted(PLANE))
def test_the_plane_and_what_awa_sa_can_do_there(cluster: Cluster, phase: str) -> None:
    cluster.set_phase(phase, "awa_qs")
    st = read_status(cluster.engine)
    assert st.plane == st.as_dict()["plane"] == PLANE[phase]
    assert st.as_dict()["awa_sa"] == WHAT_AWA_SA_CAN_DO[PLANE[phase]]
    [plane, *rest] = explain(st)
    assert plane == f"plane        {PLANE[phase]}: {WHAT_AWA_SA_CAN_DO[PLANE[phase]]}"
    if phase in ("mixed_transition", "active"):
        assert "awa_sa.settle" in plane
        assert rest == []
    if phase == "prepared":
        assert st.auto_finalizes is False
        assert rest == ["fresh        stays canonical: queue_storage is prepared"]


def test_the_fixture_cannot_tell_whether_a_runtime_was_seen(engine: sa.Engine) -> None:
    """The fixture omits awa.runtime_instances: fresh is "unknown", not a guess."""
    st = read_status(engine)
    assert (st.recent_runtimes, st.auto_finalizes) == (None, None)
    assert explain(st)[1].startswith("fresh        awa.jobs is empty; whether a runtime")
    with engine.begin() as conn:
        add_canonical(conn, jobs_hot, ["completed"])  # terminal rows count too
    st = read_status(engine)
    assert st.auto_finalizes is False
    assert explain(st)[1] == "fresh        stays canonical: awa.jobs holds 1 job(s)"


@dataclass
class Noop:
    n: int


def start_and_stop_an_auto_runtime(url: str) -> None:
    """What a service does first: start its worker (role auto, every default)."""

    async def run() -> None:
        client = awa.AsyncClient(
            sa.make_url(url).set(drivername="postgresql").render_as_string(False)
        )

        @client.task(Noop, queue="fresh_q")
        async def handle(job: Any) -> None:
            return None

        await client.start([("fresh_q", 1)])
        await client.shutdown()
        await client.close()

    asyncio.run(run())


def seen_runtime(engine: sa.Engine, secs_ago: int) -> None:
    """A runtime's snapshot row, last written *secs_ago* seconds ago."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO awa.runtime_instances (instance_id, hostname, pid, version, "
                " started_at, last_seen_at, snapshot_interval_ms, healthy, postgres_connected, "
                " poll_loop_alive, heartbeat_alive, shutting_down, leader) "
                "VALUES (:id, 'earlier-worker', 4242, '0.6.9', now() - interval '1 hour', "
                " now() - make_interval(secs => :ago), 10000, true, true, true, true, false, false)"
            ),
            {"id": uuid.uuid4(), "ago": secs_ago},
        )


def insert_terminal(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        add_canonical(conn, jobs_hot, ["completed"])


def phase_row(engine: sa.Engine) -> tuple[str, str, dict[str, Any]]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT state, current_engine, details FROM awa.storage_transition_state")
        ).one()
    return row.state, row.current_engine, row.details


@pytest.mark.parametrize(
    ("setup", "finalizes"),
    [
        pytest.param(lambda engine: None, True, id="fresh"),
        pytest.param(insert_terminal, False, id="one-completed-job"),
        pytest.param(lambda engine: seen_runtime(engine, 60), False, id="runtime-seen-60s-ago"),
        pytest.param(lambda engine: seen_runtime(engine, 120), True, id="runtime-seen-120s-ago"),
    ],
)
@pytest.mark.slow  # a real awa-pg runtime per case
def test_status_says_whether_the_first_auto_runtime_finalizes_and_it_does(
    real_engine: sa.Engine,
    real_db_url: str,
    setup: Callable[[sa.Engine], None],
    finalizes: bool,
) -> None:
    """The verdict, then a real awa-pg 0.6.9 ``auto`` runtime started on the same cluster."""
    setup(real_engine)
    st = read_status(real_engine)
    assert st.auto_finalizes is finalizes
    assert ("first `auto` runtime to start finalizes it" in explain(st)[1]) is finalizes
    start_and_stop_an_auto_runtime(real_db_url)
    state, engine_now, details = phase_row(real_engine)
    if finalizes:
        assert (state, engine_now) == ("active", "queue_storage")
        assert details == {"schema": "awa", "auto_finalized": True}
        assert read_status(real_engine).plane == "queue storage"
    else:
        assert (state, engine_now) == ("canonical", "canonical")
        assert read_status(real_engine).plane == "canonical"
