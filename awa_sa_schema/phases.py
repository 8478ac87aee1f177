"""Put the fixture into a storage phase by writing the rows awa-cli 0.6.9 leaves behind.

The fixture omits Awa's ``storage_*`` functions (``storage_abort`` alone counts rows in fourteen
tables the fixture does not have), so phases are set by writing the singleton and the marker
row directly, with the values observed on a real cluster (docs/architecture.md#phases). Like
every real transition, the write locks the singleton first (FOR UPDATE), so it serialises
against a reschedule holding its FOR SHARE lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import sqlalchemy as sa

from ._sql import check_schema_name
from .queue_storage import has_queue_storage


@dataclass(frozen=True)
class _Row:
    current_engine: str
    prepared_engine: str | None
    state: str
    epoch: int | None  # None: one more than the current epoch
    names_schema: bool  # details = {"schema": S} rather than {}
    finalized: bool
    marker: bool  # runtime_storage_backends('queue_storage', S) present


_ROWS = {
    "canonical": _Row("canonical", None, "canonical", 0, False, False, False),
    "prepared": _Row("canonical", "queue_storage", "prepared", 1, True, False, False),
    "mixed_transition": _Row(
        "canonical", "queue_storage", "mixed_transition", 2, True, False, True
    ),
    "active": _Row("queue_storage", None, "active", 3, True, True, True),
    "aborted": _Row("canonical", None, "canonical", None, False, False, False),
}
PHASES = tuple(_ROWS)
"""The phases, named once: by the rows each one leaves."""

_LOCK = sa.text(
    "SELECT state, transition_epoch FROM awa.storage_transition_state WHERE singleton FOR UPDATE"
)

_UPSERT = sa.text(
    """
    INSERT INTO awa.storage_transition_state AS s
        (singleton, current_engine, prepared_engine, state, transition_epoch, details,
         entered_at, updated_at, finalized_at)
    VALUES (true, :current_engine, :prepared_engine, :state, :epoch, CAST(:details AS jsonb),
            now(), now(), CASE WHEN :finalized THEN now() END)
    ON CONFLICT (singleton) DO UPDATE SET
        current_engine = EXCLUDED.current_engine,
        prepared_engine = EXCLUDED.prepared_engine,
        state = EXCLUDED.state,
        transition_epoch = EXCLUDED.transition_epoch,
        details = EXCLUDED.details,
        entered_at = EXCLUDED.entered_at,
        updated_at = EXCLUDED.updated_at,
        finalized_at = EXCLUDED.finalized_at
    """
)

_SET_MARKER = sa.text(
    """
    INSERT INTO awa.runtime_storage_backends (backend, schema_name, updated_at)
    VALUES ('queue_storage', :schema, now())
    ON CONFLICT (backend) DO UPDATE
        SET schema_name = EXCLUDED.schema_name, updated_at = EXCLUDED.updated_at
    """
)

_DELETE_MARKER = sa.text("DELETE FROM awa.runtime_storage_backends WHERE backend = 'queue_storage'")


def set_phase(connection: sa.Connection, phase: str, schema: str) -> None:
    """Write exactly the ``phase`` rows of docs/architecture.md#phases, routing to *schema*.

    No default schema here: the testing kit's ``awa_sa.testing.set_phase`` states the one
    default, and a test of the fixture names the schema it means (``canonical`` and ``aborted``
    ignore it).

    Phases: ``canonical`` (epoch 0), ``prepared`` (1), ``mixed_transition`` (2), ``active`` (3)
    and ``aborted``: back to canonical with the epoch one above the current one, details ``{}``
    and the marker row deleted. Refuses (ValueError) an unknown phase, a bad schema name,
    ``mixed_transition``/``active`` for a schema without a substrate, and ``aborted`` from
    ``active`` or without a singleton row (Awa cannot abort those either). A missing singleton
    row is recreated for the other phases. Runs in the caller's transaction; commit to publish.
    """
    row = _ROWS.get(phase)
    if row is None:
        raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
    check_schema_name(schema)
    if row.marker and not has_queue_storage(connection, schema):
        raise ValueError(
            f"cannot route to schema {schema!r} in phase {phase!r}: it has no queue-storage "
            "substrate (use awa_sa_schema.install_queue_storage first)"
        )
    current = connection.execute(_LOCK).one_or_none()
    epoch = row.epoch
    if epoch is None:
        if current is None or current.state == "active":
            where = "no singleton row" if current is None else "state 'active'"
            raise ValueError(f"cannot abort from {where}")
        epoch = int(current.transition_epoch) + 1
    details = {"schema": schema} if row.names_schema else {}
    connection.execute(
        _UPSERT,
        {
            "current_engine": row.current_engine,
            "prepared_engine": row.prepared_engine,
            "state": row.state,
            "epoch": epoch,
            "details": json.dumps(details),
            "finalized": row.finalized,
        },
    )
    if row.marker:
        connection.execute(_SET_MARKER, {"schema": schema})
    else:
        connection.execute(_DELETE_MARKER)
