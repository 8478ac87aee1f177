"""The queue-storage tables a read statement names: the placeholder's, or one schema's own.

awa-sa's registered statements name the placeholder schema and get the routing schema's name
at compile time (``schema_translate_map``), like every other statement. A selectable handed to
a service is compiled by the service's own ``execute``, which knows no translate map, so it
names the schema itself: copies of the declarations under that name, made once per name.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import MetaData, Table

from awa_sa.read.statements.candidates import Tables
from awa_sa.tables import queue_storage, runtime
from awa_sa.tables.queue_storage import QS_PLACEHOLDER, translate_map


def _declared() -> list[Table]:
    """Every queue-storage table declared, the runtime's own (a real cluster's) too."""
    tables = [*queue_storage.metadata.tables.values(), *runtime.metadata.tables.values()]
    return [table for table in tables if table.schema == QS_PLACEHOLDER]


@cache
def placeholder() -> Tables:
    """The shared declarations, under the placeholder schema."""
    return Tables({table.name: table for table in _declared()})


@cache
def of_schema(schema: str) -> Tables:
    """The declarations copied under *schema* (a checked name: InvalidSchemaName otherwise)."""
    translate_map(schema)
    copies = MetaData(schema=schema)
    return Tables({table.name: table.to_metadata(copies, schema=schema) for table in _declared()})
