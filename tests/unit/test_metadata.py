"""The declared tables cover every relation the library or its tests read or write.

That they match a real database column for column is tests/integration/test_metadata_reflection.py.
"""

from __future__ import annotations

import observed_tables
from sqlalchemy.sql import visitors
from sqlalchemy.sql.expression import TableClause

from awa_sa import queue_storage, statements, tables
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


def test_metadata_covers_every_relation_the_library_writes() -> None:
    names = {t.name for t in CANONICAL + QUEUE_STORAGE}
    assert {
        "jobs_hot",
        "scheduled_jobs",
        "job_unique_claims",
        "storage_transition_state",
        "runtime_storage_backends",
        "deferred_jobs",
        "done_entries",
        "queue_lanes",
        "queue_enqueue_heads",
        "queue_claim_heads",
        "queue_ring_state",
        "queue_terminal_count_deltas",
        "ready_entries",
    } <= names


def test_every_relation_a_statement_reaches_is_a_declared_table() -> None:
    """Walked from the builders, so a new statement cannot name a table nobody declared (a
    lightweight ``sa.table()``, or a second ``Table`` for an existing name)."""
    declared = {id(table) for table in tables.metadata.sorted_tables}
    declared |= {id(table) for table in queue_storage.metadata.sorted_tables}
    reached = {
        element
        for builder in statements.all_builders()
        for element in visitors.iterate(builder())
        if isinstance(element, TableClause)
    }
    assert reached
    assert [t.fullname for t in reached if id(t) not in declared] == []
