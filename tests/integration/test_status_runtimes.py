"""``awa-sa status`` tells the finalize truth: live runtimes read as ``awa storage finalize`` does.

On an ``awa migrate`` cluster in mixed transition, a real awa-pg 0.6.9 runtime runs throughout.
Status must agree with finalize itself in every case, so each verdict is followed by the real
``awa storage finalize``:

* the real runtime alone is live but does not block (it reports ``queue_storage``, then
  ``canonical_drain_only`` once it has seen the routing flip);
* a runtime that reports ``canonical`` (an Awa from before queue storage: its row takes the
  column's default) blocks while it is live, and status names it;
* the same runtime seen just outside finalize's window blocks nothing, and one with a longer
  snapshot interval, seen as long ago, still blocks: the window is finalize's, not a guess.

The runtime is waited for by reading its row, never by sleeping.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from command_line import awa_sa_in_process
from conftest import Cluster, run_awa

from awa_sa.tools.status import ClusterStatus, read_status, runtime_instances

pytestmark = pytest.mark.slow  # real awa-pg runtimes, live and gone

ROW_DEADLINE_SECS = 60.0


@dataclass
class Idle:
    n: int


def pg_url(cluster: Cluster) -> str:
    return sa.make_url(cluster.url).set(drivername="postgresql").render_as_string(False)


async def first_snapshot(engine: sa.Engine) -> None:
    """Wait until the runtime has written its first snapshot row."""
    deadline = time.monotonic() + ROW_DEADLINE_SECS
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            found = conn.execute(sa.select(sa.func.count()).select_from(runtime_instances))
            if found.scalar_one():
                return
        await asyncio.sleep(0.1)
    pytest.fail("the awa-pg runtime never reported a snapshot")


@pytest.fixture
async def real_runtime(real_cluster: Cluster) -> AsyncIterator[awa.AsyncClient]:
    """A real awa-pg runtime (role auto) on the cluster, started after the routing flip."""
    client = awa.AsyncClient(pg_url(real_cluster))

    @client.task(Idle, queue="status_q")
    async def handle(job: Any) -> None:
        return None

    await client.start([("status_q", 1)], queue_storage_schema="awa_qs")
    try:
        await first_snapshot(real_cluster.engine)
        yield client
    finally:
        await client.shutdown()
        await client.close()


@pytest.fixture
def real_cluster(real_engine: sa.Engine, real_db_url: str, pg: Any) -> Cluster:
    cluster = Cluster("real", pg, real_db_url, real_engine)
    cluster.set_phase("mixed_transition", "awa_qs")
    return cluster


def older_runtime(engine: sa.Engine, seen_secs_ago: int, snapshot_interval_ms: int) -> str:
    """A runtime of an Awa from before queue storage: no storage_capability of its own."""
    instance = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO awa.runtime_instances (instance_id, hostname, pid, version, "
                " started_at, last_seen_at, snapshot_interval_ms, healthy, postgres_connected, "
                " poll_loop_alive, heartbeat_alive, shutting_down, leader) "
                "VALUES (:id, 'old-worker', 4242, '0.4.0', now() - interval '1 hour', "
                " now() - make_interval(secs => :ago), :interval, true, true, true, true, "
                " false, false)"
            ),
            {"id": instance, "ago": seen_secs_ago, "interval": snapshot_interval_ms},
        )
    return f"old-worker:4242 ({instance})"


def finalize(cluster: Cluster) -> str:
    """``awa storage finalize``: "" when it passed, else its refusal."""
    try:
        run_awa(cluster.pg, cluster.dbname, "storage", "finalize")
    except RuntimeError as refused:
        return str(refused)
    return ""


def status(cluster: Cluster) -> tuple[ClusterStatus, str]:
    text = awa_sa_in_process("status", "--url", cluster.url)
    assert text.returncode == 0, text.stderr
    return read_status(cluster.engine), text.stdout


async def test_a_real_runtime_is_live_and_does_not_block(
    real_cluster: Cluster, real_runtime: awa.AsyncClient
) -> None:
    st, text = await asyncio.to_thread(status, real_cluster)
    assert st.runtimes is not None
    [runtime] = st.runtimes
    # Its first snapshot says queue_storage; once it has seen the flip, canonical_drain_only.
    assert runtime.capability in ("queue_storage", "canonical_drain_only")
    assert (runtime.role, runtime.version) == ("auto", "0.6.9")
    assert st.finalize_blockers == ()
    assert st.finalize_ready
    assert "finalize     can pass" in text
    assert f"runtimes     {runtime.name}: " in text
    assert await asyncio.to_thread(finalize, real_cluster) == ""  # and awa agrees


async def test_a_live_canonical_runtime_blocks_and_is_named(
    real_cluster: Cluster, real_runtime: awa.AsyncClient
) -> None:
    name = older_runtime(real_cluster.engine, seen_secs_ago=1, snapshot_interval_ms=10_000)
    st, text = await asyncio.to_thread(status, real_cluster)
    assert [r.name for r in st.finalize_blockers] == [name]
    assert not st.finalize_ready
    assert st.as_dict()["finalize_blocked_by"] == [name]
    assert (
        f"finalize     blocked by runtime {name}: it reports storage_capability canonical" in text
    )
    assert "can pass" not in text
    refusal = await asyncio.to_thread(finalize, real_cluster)
    assert "1 canonical-only runtime(s) are still live" in refusal  # awa refuses too


@pytest.mark.parametrize(
    ("seen_secs_ago", "snapshot_interval_ms", "blocks"),
    [
        (45, 10_000, False),  # 3 x 10 s is under the 30 s floor: 30 s, so gone
        (45, 20_000, True),  # 3 x 20 s = 60 s: still live
        (40, 13_999, False),  # whole seconds: 13 s, 3 x 13 = 39 s, so gone
    ],
)
async def test_the_live_window_is_finalizes(
    real_cluster: Cluster,
    real_runtime: awa.AsyncClient,
    seen_secs_ago: int,
    snapshot_interval_ms: int,
    blocks: bool,
) -> None:
    name = older_runtime(real_cluster.engine, seen_secs_ago, snapshot_interval_ms)
    st, text = await asyncio.to_thread(status, real_cluster)
    assert st.runtimes is not None
    assert (name in [r.name for r in st.runtimes]) is blocks
    assert st.finalize_ready is not blocks
    assert (f"blocked by runtime {name}" in text) is blocks
    refusal = await asyncio.to_thread(finalize, real_cluster)
    assert bool(refusal) is blocks, refusal


def test_the_fixture_records_no_runtimes(engine: sa.Engine) -> None:
    """The fixture omits awa.runtime_instances: status says so rather than "none live"."""
    st = read_status(engine)
    assert st.runtimes is None
    assert st.as_dict()["live_runtimes"] is None
