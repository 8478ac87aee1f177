"""Move the kit's database between storage phases, as ``awa storage ...`` would leave it."""

from __future__ import annotations

from typing import Literal, get_args

import sqlalchemy as sa

Phase = Literal["canonical", "prepared", "mixed_transition", "active", "aborted"]
"""The storage phases, written once for the kit, its plugin and the suite (the fixture's rows
are keyed by the same names, which a unit test checks)."""
PHASES: tuple[Phase, ...] = get_args(Phase)

DEFAULT_SCHEMA = "awa_qs"
"""Where :func:`set_phase` routes when no schema is named: not Awa's own default ``awa``, so
that a test routed by default goes through the schema translation a real non-default
substrate needs. Both have a substrate in the kit's databases."""


def set_phase(conn: sa.Connection, phase: Phase, schema: str = DEFAULT_SCHEMA) -> None:
    """Write the transition singleton and routing marker of *phase*, routing to *schema*.

    From a fresh (canonical) database the rows are those the published CLI leaves after
    ``prepare --details '{"schema": S}'``, ``enter-mixed-transition``, ``finalize`` or ``abort``:
    the same epochs, details and marker row. Once ``mixed_transition`` or ``active`` is
    committed, a reschedule moves attempts into *schema* (:data:`DEFAULT_SCHEMA` unless named).
    Runs in *conn*'s transaction; commit it.
    Raises ``ValueError`` for an unknown phase or a schema without a substrate.

    Phases may be skipped: ``active`` straight from canonical leaves what prepare, enter and
    finalize leave. ``aborted`` returns to canonical one epoch up, so it matches the CLI's
    ``abort`` when it follows ``prepared`` or ``mixed_transition``, as the CLI requires.

    Mid-transition, a re-scheduled attempt moves to the queue-storage schema under a new id::

        >>> from awa_sa import Migrated, Snooze, reschedule_canonical_attempt
        >>> from awa_sa.testing import locate, running_attempt, set_phase
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(conn)
        ...     set_phase(conn, "mixed_transition")
        >>> moved = reschedule_canonical_attempt(engine, job_id, lease, Snooze(30))
        >>> isinstance(moved, Migrated)
        True
        >>> with engine.connect() as conn:
        ...     (locate(conn, job_id), locate(conn, moved).relation)
        (None, 'awa_qs.deferred_jobs')
    """
    # The fixture package imports Alembic; only a test that changes phase pays for that.
    from awa_sa_schema.phases import set_phase as write_phase_rows

    write_phase_rows(conn, phase, schema)
