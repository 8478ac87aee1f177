"""Read-only status of an Awa v040 cluster: where routing points and what still blocks finalize.

An operator mid-transition wants one answer: "can ``awa storage finalize`` pass yet, and if not,
what is left?". Finalize (``awa.storage_finalize()``) refuses for two reasons, and status reads
both the way it does:

* a canonical live backlog. ``awa.canonical_live_backlog()`` answers with one number and only on
  a real cluster; here the same quantity is derived from per-state counts of the tables
  themselves, so it also works on the test fixture (which omits that function) and shows
  *which* states remain;
* a live runtime that reports ``storage_capability = 'canonical'`` in ``awa.runtime_instances``
  (one that cannot run queue storage, such as an Awa older than queue storage, whose row takes
  the column's default). "Live" is finalize's own rule: seen within three snapshot intervals
  (whole seconds, at least one each), and never less than 30 seconds. awa-pg 0.6's runtimes
  report ``queue_storage`` or ``canonical_drain_only`` and never block it.

It also says which plane the cluster's attempts are on and what awa-sa can do with them
(:attr:`ClusterStatus.plane`, :func:`explain`), and whether the cluster is still *fresh*: a
cluster ``awa migrate`` left canonical is finalized straight to queue storage by the first
``auto`` runtime that starts while ``awa.jobs`` is empty and no runtime was seen in the last
90 seconds (``awa.storage_auto_finalize_if_fresh``), so a service that starts its worker before
enqueuing anything never has a canonical attempt.

Everything runs in one ``READ ONLY`` transaction that is rolled back: looking must never write,
and a single snapshot keeps the phase and the counts consistent with each other.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa

from awa_sa.core.errors import InvalidSchemaName
from awa_sa.tables import queue_storage
from awa_sa.tables.canonical import (
    AWA_SCHEMA,
    Timestamp,
    jobs_hot,
    scheduled_jobs,
    storage_transition_state,
)
from awa_sa.tools.errors import NotAnAwaCluster, UnsupportedSchemaVersion
from awa_sa.tools.planes import PLANES, WHAT_AWA_SA_CAN_DO

schema_version = sa.Table(
    "schema_version",
    sa.MetaData(),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("applied_at", Timestamp, nullable=False),
    schema=AWA_SCHEMA,
)
"""The migrations Awa has applied; only ``status`` reads it, so it is declared here."""

runtime_instances = sa.Table(
    "runtime_instances",
    sa.MetaData(),
    sa.Column("instance_id", sa.Uuid, primary_key=True),
    sa.Column("hostname", sa.Text),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("version", sa.Text, nullable=False),
    sa.Column("last_seen_at", Timestamp, nullable=False),
    sa.Column("snapshot_interval_ms", sa.BigInteger, nullable=False),
    sa.Column("storage_capability", sa.Text, nullable=False),
    sa.Column("transition_role", sa.Text, nullable=False),
    schema=AWA_SCHEMA,
)
"""The snapshots Awa's runtimes report (the columns finalize reads, and who they are)."""

BLOCKING_CAPABILITY = "canonical"
"""The capability that makes ``awa.storage_finalize()`` refuse while its runtime is live."""

SUPPORTED_SCHEMA_VERSION = 40
"""awa-sa speaks exactly the v040 schema (awa-cli 0.6.x); v041+ changed the ring cursor."""

PATCHED_FAMILY = "awa-cli 0.6.8+"
"""Clusters with the ``wait_free_dirty_marks`` schema patch, which ``awa migrate`` of 0.6.8 and
later applies to v040: dirty marks are rows appended to ``awa.admin_dirty_*_marks``."""
UNPATCHED_FAMILY = "awa-cli 0.6.6-0.6.7"
"""v040 as 0.6.6 and 0.6.7 build it: dirty marks are keys in ``awa.admin_dirty_queues`` and
``awa.admin_dirty_kinds``, written with ``ON CONFLICT DO NOTHING`` (docs/contract.md)."""

TERMINAL_STATES = frozenset({"completed", "failed", "cancelled"})
"""States that do not count towards the finalize gate in ``jobs_hot``."""

FRESH_WINDOW_SECS = 90
"""``awa.storage_auto_finalize_if_fresh`` declines while any runtime was seen this recently."""


@dataclass(frozen=True)
class Runtime:
    """A live runtime, as its last snapshot in ``awa.runtime_instances`` describes it."""

    instance_id: uuid.UUID
    hostname: str | None
    pid: int
    version: str
    capability: str
    role: str
    last_seen_at: datetime

    @property
    def name(self) -> str:
        """How an operator finds the process: host and pid, then the id finalize would count."""
        return f"{self.hostname or '?'}:{self.pid} ({self.instance_id})"

    @property
    def blocks_finalize(self) -> bool:
        return self.capability == BLOCKING_CAPABILITY

    def as_dict(self) -> dict[str, object]:
        return {
            "instance_id": str(self.instance_id),
            "hostname": self.hostname,
            "pid": self.pid,
            "version": self.version,
            "storage_capability": self.capability,
            "transition_role": self.role,
            "last_seen_at": self.last_seen_at.isoformat(),
        }


@dataclass(frozen=True)
class ClusterStatus:
    """One consistent snapshot of the transition singleton and the backlogs."""

    schema_version: int
    phase: str
    """``storage_transition_state.state``; ``"canonical"`` when the singleton row is missing."""
    epoch: int | None
    current_engine: str | None
    prepared_engine: str | None
    routing_schema: str | None
    """``awa.active_queue_storage_schema()``: where new writes go; None means canonical."""
    queue_storage_schema: str | None
    """The schema being transitioned to (routing target, or the prepared one), if any."""
    queue_storage_installed: bool
    """Whether the queue-storage substrate is installed: in ``queue_storage_schema``, or, where
    no schema is in play, in :data:`DEFAULT_SCHEMA`, where ``awa migrate`` installs it."""
    release_family: str
    """Which awa-cli releases build the schema as found: :data:`PATCHED_FAMILY` or
    :data:`UNPATCHED_FAMILY` (the releases differ in the dirty-mark tables the triggers write)."""
    jobs_hot: Mapping[str, int] = field(default_factory=dict)
    scheduled_jobs: Mapping[str, int] = field(default_factory=dict)
    deferred_jobs: Mapping[str, int] = field(default_factory=dict)
    runtimes: tuple[Runtime, ...] | None = None
    """The live runtimes, by finalize's rule; None when ``awa.runtime_instances`` does not exist
    (the test fixture omits it)."""
    recent_runtimes: int | None = None
    """Runtimes seen within :data:`FRESH_WINDOW_SECS` (auto-finalize's own window, which is not
    finalize's); None without ``awa.runtime_instances``."""

    @property
    def plane(self) -> str:
        """Where attempts are: ``canonical``, ``prepared``, ``mixed`` or ``queue storage``.

        An aborted transition is back to ``canonical``; a phase Awa never writes reads as
        itself.
        """
        return PLANES.get(self.phase, self.phase)

    @property
    def jobs(self) -> int:
        """What ``SELECT count(*) FROM awa.jobs`` answers while routing is canonical.

        The view shows ``awa.jobs_hot`` and ``awa.scheduled_jobs`` then, terminal rows
        included, and auto-finalize counts them all.
        """
        return sum(self.jobs_hot.values()) + sum(self.scheduled_jobs.values())

    @property
    def auto_finalizes(self) -> bool | None:
        """Whether the first ``auto`` runtime to start now would finalize to queue storage.

        ``awa.storage_auto_finalize_if_fresh`` does so when the phase is ``canonical`` with no
        prepared engine, ``awa.jobs`` is empty and no runtime was seen in the last 90 s. None
        when that last condition cannot be read (no ``awa.runtime_instances``).
        """
        if self.phase != "canonical" or self.prepared_engine is not None or self.jobs:
            return False
        if self.recent_runtimes is None:
            return None
        return self.recent_runtimes == 0

    @property
    def canonical_live_backlog(self) -> int:
        """What ``awa.canonical_live_backlog()`` returns: finalize refuses while it is > 0."""
        live_hot = sum(n for state, n in self.jobs_hot.items() if state not in TERMINAL_STATES)
        return live_hot + sum(self.scheduled_jobs.values())

    @property
    def finalize_blockers(self) -> tuple[Runtime, ...]:
        """The live runtimes that make finalize refuse, whatever the backlog."""
        return tuple(r for r in self.runtimes or () if r.blocks_finalize)

    @property
    def finalize_ready(self) -> bool:
        """Whether ``awa storage finalize`` would pass now: both halves of its gate."""
        return (
            self.phase == "mixed_transition"
            and self.canonical_live_backlog == 0
            and not self.finalize_blockers
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "schema_version": self.schema_version,
            "phase": self.phase,
            "epoch": self.epoch,
            "current_engine": self.current_engine,
            "prepared_engine": self.prepared_engine,
            "routing": self.routing_schema or "canonical",
            "queue_storage_schema": self.queue_storage_schema,
            "queue_storage_installed": self.queue_storage_installed,
            "release_family": self.release_family,
            "jobs_hot": dict(self.jobs_hot),
            "scheduled_jobs": dict(self.scheduled_jobs),
            "deferred_jobs": dict(self.deferred_jobs),
            "canonical_live_backlog": self.canonical_live_backlog,
            "live_runtimes": None
            if self.runtimes is None
            else [runtime.as_dict() for runtime in self.runtimes],
            "finalize_blocked_by": [runtime.name for runtime in self.finalize_blockers],
            "finalize_ready": self.finalize_ready,
            "plane": self.plane,
            "awa_sa": WHAT_AWA_SA_CAN_DO.get(self.plane),
            "runtimes_seen_in_90s": self.recent_runtimes,
            "auto_finalizes_on_first_auto_runtime": self.auto_finalizes,
        }


def _regclass_exists(conn: sa.Connection, name: str) -> bool:
    # to_regclass answers NULL instead of raising, so a missing relation does not abort the
    # transaction we still want to read from.
    found = conn.execute(sa.select(sa.func.to_regclass(sa.literal(name)).is_not(None))).scalar()
    return bool(found)


def _counts_by_state(
    conn: sa.Connection, table: sa.Table, translate: dict[str | None, str | None] | None = None
) -> dict[str, int]:
    state = table.c.state
    stmt = sa.select(sa.cast(state, sa.Text), sa.func.count()).group_by(state).order_by(state)
    if translate is not None:
        conn = conn.execution_options(schema_translate_map=translate)
    return {str(s): int(n) for s, n in conn.execute(stmt)}


def _check_version(conn: sa.Connection) -> int:
    if not _regclass_exists(conn, "awa.schema_version"):
        raise NotAnAwaCluster("not an Awa cluster: awa.schema_version does not exist")
    version = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar()
    if version != SUPPORTED_SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            None if version is None else int(version), SUPPORTED_SCHEMA_VERSION
        )
    return int(version)


DEFAULT_SCHEMA = "awa"
"""The queue-storage schema of a runtime that names none: ``awa migrate`` installs it."""


def _target_schema(
    phase: str, routing: str | None, details: Mapping[str, object] | None
) -> str | None:
    """The queue-storage schema in play: routing's answer, else the one ``prepare`` named."""
    if routing:
        return routing
    if phase == "prepared":
        named = (details or {}).get("schema")
        # Blank counts as missing, and awa's own last fallback is the schema 'awa'.
        return named if isinstance(named, str) and named.strip() else DEFAULT_SCHEMA
    return None


def _translate_or_none(schema: str | None) -> dict[str | None, str | None] | None:
    """A name awa could never route to is reported as not installed, not as a crash."""
    if schema is None:
        return None
    try:
        return queue_storage.translate_map(schema)
    except InvalidSchemaName:
        return None


def live_runtimes(conn: sa.Connection) -> tuple[Runtime, ...] | None:
    """The runtimes finalize counts as live, oldest first; None without the table.

    The window is finalize's expression, term for term and in integer arithmetic, evaluated by
    the server against its own ``now()``, so the two never disagree about a runtime at the edge.
    """
    if not _regclass_exists(conn, "awa.runtime_instances"):
        return None
    ri = runtime_instances
    snapshot_secs = sa.func.greatest(ri.c.snapshot_interval_ms, 1000) // 1000
    window_secs = sa.func.greatest(sa.cast(snapshot_secs * 3, sa.Integer), 30)
    # make_interval(years, months, weeks, days, hours, mins, secs): secs => window_secs
    window = sa.func.make_interval(0, 0, 0, 0, 0, 0, window_secs)
    rows = conn.execute(
        sa.select(
            ri.c.instance_id,
            ri.c.hostname,
            ri.c.pid,
            ri.c.version,
            ri.c.storage_capability,
            ri.c.transition_role,
            ri.c.last_seen_at,
        )
        .where(ri.c.last_seen_at + window >= sa.func.now())
        .order_by(ri.c.last_seen_at, ri.c.instance_id)
    )
    return tuple(
        Runtime(
            instance_id=row.instance_id,
            hostname=row.hostname,
            pid=row.pid,
            version=row.version,
            capability=row.storage_capability,
            role=row.transition_role,
            last_seen_at=row.last_seen_at,
        )
        for row in rows
    )


def recent_runtimes(conn: sa.Connection) -> int | None:
    """How many runtimes were seen within auto-finalize's window; None without the table."""
    if not _regclass_exists(conn, "awa.runtime_instances"):
        return None
    ri = runtime_instances
    window = sa.func.make_interval(0, 0, 0, 0, 0, 0, FRESH_WINDOW_SECS)
    seen = sa.select(sa.func.count()).where(ri.c.last_seen_at + window >= sa.func.now())
    return int(conn.execute(seen).scalar_one())


def read_status_in(conn: sa.Connection) -> ClusterStatus:
    """Read the status inside the caller's transaction.

    Raises :class:`~awa_sa.tools.errors.StatusError` when the database is not a v040 cluster.
    """
    version = _check_version(conn)
    sts = storage_transition_state
    row = conn.execute(
        sa.select(
            sts.c.state,
            sts.c.transition_epoch,
            sts.c.current_engine,
            sts.c.prepared_engine,
            sts.c.details,
        ).where(sts.c.singleton)
    ).one_or_none()
    routing = conn.execute(sa.select(sa.func.awa.active_queue_storage_schema())).scalar()
    phase = row.state if row is not None else "canonical"
    target = _target_schema(phase, routing, row.details if row is not None else None)
    translate = _translate_or_none(target)
    # With no schema in play, the one `awa migrate` installs and a first `auto` runtime
    # finalizes to.
    installed = _regclass_exists(conn, f"{target or DEFAULT_SCHEMA}.deferred_jobs")
    deferred: dict[str, int] = {}
    if translate is not None and installed:
        deferred = _counts_by_state(conn, queue_storage.deferred_jobs, translate)
    return ClusterStatus(
        schema_version=version,
        phase=phase,
        epoch=None if row is None else int(row.transition_epoch),
        current_engine=None if row is None else row.current_engine,
        prepared_engine=None if row is None else row.prepared_engine,
        routing_schema=routing,
        queue_storage_schema=target,
        queue_storage_installed=installed,
        release_family=PATCHED_FAMILY
        if _regclass_exists(conn, "awa.admin_dirty_queue_marks")
        else UNPATCHED_FAMILY,
        jobs_hot=_counts_by_state(conn, jobs_hot),
        scheduled_jobs=_counts_by_state(conn, scheduled_jobs),
        deferred_jobs=deferred,
        runtimes=live_runtimes(conn),
        recent_runtimes=recent_runtimes(conn),
    )


def read_status(engine: sa.Engine) -> ClusterStatus:
    """Read the status in a fresh READ ONLY transaction, rolled back afterwards."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        try:
            return read_status_in(conn)
        finally:
            conn.rollback()
