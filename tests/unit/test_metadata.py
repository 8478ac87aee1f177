"""The library's declared tables cover every relation its statements read or write.

That they match a real database column for column is tests/integration/test_metadata_reflection.py.
"""

from __future__ import annotations

from sqlalchemy.sql import visitors
from sqlalchemy.sql.dml import UpdateBase
from sqlalchemy.sql.expression import Alias, TableClause

from awa_sa import statements
from awa_sa.tables import canonical as tables
from awa_sa.tables import queue_storage
from awa_sa.tables import runtime as runtime_tables

QS = queue_storage.QS_PLACEHOLDER
WRITTEN = [
    ("DELETE", "awa.jobs_hot"),
    ("INSERT", "awa.job_unique_claims"),
    ("INSERT", "awa.scheduled_jobs"),
    ("UPDATE", "awa.jobs_hot"),
    ("INSERT", f"{QS}.deferred_jobs"),
    ("INSERT", f"{QS}.done_entries"),
    ("INSERT", f"{QS}.queue_claim_heads"),
    ("INSERT", f"{QS}.queue_enqueue_heads"),
    ("INSERT", f"{QS}.queue_lanes"),
    ("INSERT", f"{QS}.queue_terminal_count_deltas"),
    ("DELETE", "awa.job_unique_claims"),
    ("DELETE", f"{QS}.attempt_state"),
    ("INSERT", f"{QS}.lease_claim_closures"),
    ("INSERT", f"{QS}.lease_claim_closure_batches"),
    ("INSERT", f"{QS}.receipt_completion_batches"),
    ("UPDATE", f"{QS}.lease_claims"),
    ("DELETE", "awa.scheduled_jobs"),
    ("INSERT", "awa.jobs_hot"),
    ("DELETE", f"{QS}.deferred_jobs"),
    ("DELETE", f"{QS}.done_entries"),
    ("DELETE", f"{QS}.dlq_entries"),
    ("INSERT", f"{QS}.ready_entries"),
    ("INSERT", f"{QS}.ready_segments"),
    ("INSERT", f"{QS}.ready_tombstones"),
    ("DELETE", f"{QS}.leases"),
    ("INSERT", "awa.queue_meta"),
    ("UPDATE", "awa.queue_meta"),
    ("INSERT", f"{QS}.dlq_entries"),
    ("UPDATE", f"{QS}.leases"),
    ("INSERT", f"{QS}.attempt_state"),
]
"""Each verb and relation the statements write: the canonical move and its claims, the
endings in place, the queue-storage rows of a migrated or cancelled attempt, and the settle of
a queue-storage attempt (its closure, its next row, its claim), and the administering of
canonical jobs (the view's DELETE and INSERT), the cancel of a deferred queue-storage job, and
the queue-storage retry (a terminal row deleted, the job enqueued again) and discard, and the
cancel and retry of a callback wait (its lease deleted), a queue's pause and resume, a failed
job filed in the dead-letter queue, and the callback calls (a wait resumed or its timeout
moved: its lease updated, the callback result stored in its ``attempt_state`` row)."""


def _writes() -> list[tuple[str, TableClause]]:
    """Each DML of every builder, CTEs included: its verb and the table it writes."""
    found = []
    for builder in statements.all_builders():
        for element in visitors.iterate(builder()):
            if isinstance(element, UpdateBase):
                table: object = element.table
                if isinstance(table, Alias):  # a shorter name in the statement's text
                    table = table.element
                assert isinstance(table, TableClause), table
                found.append((element.__visit_name__.upper(), table))
    return found


def test_metadata_covers_every_relation_the_library_writes() -> None:
    """Walked from the builders, each table written is one of the library's own metadata: not
    a lightweight ``sa.table()``, and not the suite's observed_tables, which it never writes."""
    library = {id(t) for t in tables.metadata.sorted_tables}
    library |= {id(t) for t in queue_storage.metadata.sorted_tables}
    library |= {id(t) for t in runtime_tables.metadata.sorted_tables}
    writes = _writes()
    assert sorted({(verb, table.fullname) for verb, table in writes}) == sorted(WRITTEN)
    assert [table.fullname for _, table in writes if id(table) not in library] == []


def test_every_relation_a_statement_reaches_is_a_declared_table() -> None:
    """Walked from the builders, so a new statement cannot name a table nobody declared (a
    lightweight ``sa.table()``, or a second ``Table`` for an existing name)."""
    declared = {id(table) for table in tables.metadata.sorted_tables}
    declared |= {id(table) for table in queue_storage.metadata.sorted_tables}
    declared |= {id(table) for table in runtime_tables.metadata.sorted_tables}
    declared |= {id(table) for table in tables.postgres_catalog.sorted_tables}
    reached = {
        element
        for builder in statements.all_builders()
        for element in visitors.iterate(builder())
        if isinstance(element, TableClause)
    }
    assert reached
    assert [t.fullname for t in reached if id(t) not in declared] == []
