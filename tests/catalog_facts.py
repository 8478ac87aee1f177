"""Read catalog facts from a live database in the shape of ``v040_catalog.json``, and diff them.

The same reader runs against the Alembic fixture and against a database built by the published
awa CLI; agreement on the latter is what makes agreement on the former mean something. Facts
are read with PostgreSQL's own printers (``format_type``, ``pg_get_expr``,
``pg_get_constraintdef``, ``pg_get_indexdef``, ``pg_get_triggerdef``, ``pg_get_partkeydef``,
``pg_get_function_*``), exactly as the JSON was produced, so equal text means equal DDL.

Also here: :func:`cloned_database`, a module-wide private copy of a template database, because
catalog reads are read-only and a clone per test would dominate the suite's run time.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from conftest import _janitor

import awa_sa_schema
from awa_sa.testing.server import EmbeddedPostgres

# The catalog dumped from an awa-cli 0.6.9 database, shipped beside the fixture it describes.
CATALOG_PATH = Path(awa_sa_schema.__file__).with_name("v040_catalog.json")

# Facts in the JSON that are prose for humans, not something a catalog query can return.
PROSE_KEYS = frozenset({"description", "row_and_advisory_locks_taken"})

# Lane sequences are created on demand per (queue, priority, shard); they are data, not schema.
LANE_SEQUENCE = re.compile(r"^queue_(enqueue|claim)_seq_[0-9a-f]{32}$")

Facts = dict[str, Any]


def load_catalog(path: Path = CATALOG_PATH) -> Facts:
    data: Facts = json.loads(path.read_text())
    return data


# --------------------------------------------------------------------------- expected objects


def expected_objects(catalog: Facts) -> dict[str, Facts]:
    """Every object the catalog records, keyed ``"<kind> <qualified name or signature>"``.

    Canonical objects and each queue-storage schema's objects are merged: for ``S = awa`` both
    live in the same PostgreSQL schema, and a key says which object it is, not where the JSON
    happened to list it.
    """
    objects: dict[str, Facts] = {}

    def add(kind: str, entries: Mapping[str, Facts]) -> None:
        for name, facts in entries.items():
            objects[f"{kind} {name}"] = {k: v for k, v in facts.items() if k not in PROSE_KEYS}

    add("relation", catalog["relations"])
    add("sequence", catalog["sequences"])
    add("function", catalog["functions"])
    for name, labels in catalog["enums"].items():
        objects[f"enum {name}"] = {"labels": labels}
    for schema in catalog["queue_storage_schemas"].values():
        add("relation", schema["relations"])
        add("sequence", schema["sequences"])
        add("function", schema["functions"])
    return objects


# ------------------------------------------------------------------------------- live objects


def live_objects(conn: sa.Connection, schemas: Iterable[str]) -> dict[str, Facts]:
    """Every relation, sequence, function and enum in *schemas*, keyed like expected_objects.

    Partitions are reported inside their parent (as in the JSON), and lane sequences are left
    out because they are created at run time.
    """
    schema_list = list(schemas)
    objects: dict[str, Facts] = {}
    for name in _relation_names(conn, schema_list):
        objects[f"relation {name}"] = read_relation(conn, name)
    for name in _sequence_names(conn, schema_list):
        objects[f"sequence {name}"] = read_sequence(conn, name)
    for signature, facts in read_functions(conn, schema_list).items():
        objects[f"function {signature}"] = facts
    for name, labels in read_enums(conn, schema_list).items():
        objects[f"enum {name}"] = {"labels": labels}
    return objects


def _rows(conn: sa.Connection, sql: str, **params: Any) -> list[sa.Row[Any]]:
    return list(conn.execute(sa.text(sql), params))


def _relation_names(conn: sa.Connection, schemas: list[str]) -> list[str]:
    rows = _rows(
        conn,
        """
        SELECT n.nspname || '.' || c.relname AS name
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = ANY(:schemas) AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND NOT c.relispartition
        ORDER BY 1
        """,
        schemas=schemas,
    )
    return [r.name for r in rows]


def _sequence_names(conn: sa.Connection, schemas: list[str]) -> list[str]:
    rows = _rows(
        conn,
        """
        SELECT n.nspname AS schema, c.relname AS name
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = ANY(:schemas) AND c.relkind = 'S'
        ORDER BY 1, 2
        """,
        schemas=schemas,
    )
    return [f"{r.schema}.{r.name}" for r in rows if not LANE_SEQUENCE.match(r.name)]


_KINDS = {
    "r": "table",
    "p": "partitioned table",
    "v": "view",
    "m": "materialized view",
    "f": "foreign table",
}


def read_relation(conn: sa.Connection, qualified: str) -> Facts:
    """Columns, keys, checks, indexes, triggers, options and partitions of one relation."""
    oid, relkind, reloptions, comment = conn.execute(
        sa.text(
            "SELECT c.oid, c.relkind, c.reloptions, obj_description(c.oid, 'pg_class') "
            "FROM pg_class AS c WHERE c.oid = CAST(:name AS regclass)"
        ),
        {"name": qualified},
    ).one()
    facts: Facts = {
        "kind": _KINDS[relkind],
        "columns": _columns(conn, oid),
        "primary_key": _primary_key(conn, oid),
        "unique_constraints": _constraints(conn, oid, "u"),
        "check_constraints": _constraints(conn, oid, "c"),
        "foreign_keys": _constraints(conn, oid, "f"),
        "indexes": _indexes(conn, oid),
        "triggers": _triggers(conn, oid),
    }
    if reloptions:
        facts["reloptions"] = list(reloptions)
    if comment is not None:
        facts["comment"] = comment
    if relkind == "p":
        facts["partitioning"] = _partitioning(conn, oid)
    return facts


def _columns(conn: sa.Connection, oid: int) -> list[Facts]:
    rows = _rows(
        conn,
        """
        SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
               NOT a.attnotnull AS nullable, pg_get_expr(d.adbin, d.adrelid) AS "default"
        FROM pg_attribute AS a
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = :oid AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY a.attnum
        """,
        oid=oid,
    )
    return [dict(r._mapping) for r in rows]


def _primary_key(conn: sa.Connection, oid: int) -> Facts | None:
    row = conn.execute(
        sa.text(
            """
            SELECT c.conname AS name, pg_get_constraintdef(c.oid) AS definition,
                   ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY AS k(attnum, i)
                         JOIN pg_attribute AS a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
                         ORDER BY k.i) AS columns
            FROM pg_constraint AS c WHERE c.conrelid = :oid AND c.contype = 'p'
            """
        ),
        {"oid": oid},
    ).one_or_none()
    return None if row is None else {**row._mapping, "columns": list(row.columns)}


def _constraints(conn: sa.Connection, oid: int, contype: str) -> list[Facts]:
    rows = _rows(
        conn,
        """
        SELECT c.conname AS name, pg_get_constraintdef(c.oid) AS definition
        FROM pg_constraint AS c WHERE c.conrelid = :oid AND c.contype = :contype
        ORDER BY c.conname
        """,
        oid=oid,
        contype=contype,
    )
    return [dict(r._mapping) for r in rows]


def _indexes(conn: sa.Connection, oid: int) -> list[Facts]:
    rows = _rows(
        conn,
        """
        SELECT ic.relname AS name, i.indisunique AS unique, i.indisprimary AS primary,
               pg_get_indexdef(i.indexrelid) AS definition
        FROM pg_index AS i JOIN pg_class AS ic ON ic.oid = i.indexrelid
        WHERE i.indrelid = :oid
        ORDER BY ic.relname
        """,
        oid=oid,
    )
    return [dict(r._mapping) for r in rows]


# tgtype bits (pg_trigger.h): ROW 1, BEFORE 2, INSERT 4, DELETE 8, UPDATE 16, TRUNCATE 32,
# INSTEAD 64. Events are listed in the order pg_get_triggerdef prints them.
_EVENTS = (("INSERT", 4), ("DELETE", 8), ("UPDATE", 16), ("TRUNCATE", 32))
_WHEN = re.compile(r" WHEN \((.*)\) EXECUTE FUNCTION ", re.DOTALL)


def _triggers(conn: sa.Connection, oid: int) -> list[Facts]:
    rows = _rows(
        conn,
        """
        SELECT t.tgname AS name, t.tgtype AS tgtype, pg_get_triggerdef(t.oid) AS ddl,
               fn.nspname || '.' || p.proname AS function,
               t.tgoldtable AS old_table, t.tgnewtable AS new_table,
               ARRAY(SELECT a.attname FROM unnest(t.tgattr) WITH ORDINALITY AS k(attnum, i)
                     JOIN pg_attribute AS a ON a.attrelid = t.tgrelid AND a.attnum = k.attnum
                     ORDER BY k.i) AS update_of
        FROM pg_trigger AS t
        JOIN pg_proc AS p ON p.oid = t.tgfoid
        JOIN pg_namespace AS fn ON fn.oid = p.pronamespace
        WHERE t.tgrelid = :oid AND NOT t.tgisinternal
        ORDER BY t.tgname
        """,
        oid=oid,
    )
    triggers = []
    for r in rows:
        when = _WHEN.search(r.ddl)
        timing = "INSTEAD OF" if r.tgtype & 64 else "BEFORE" if r.tgtype & 2 else "AFTER"
        facts: Facts = {
            "name": r.name,
            "timing": timing,
            "events": [event for event, bit in _EVENTS if r.tgtype & bit],
            "level": "ROW" if r.tgtype & 1 else "STATEMENT",
            "when": when.group(1) if when else None,
            "function": r.function,
            "ddl": r.ddl,
        }
        if r.old_table is not None or r.new_table is not None:
            facts["transition_tables"] = {"old": r.old_table, "new": r.new_table}
        if r.update_of:
            facts["update_of_columns"] = list(r.update_of)
        triggers.append(facts)
    return triggers


def _partitioning(conn: sa.Connection, oid: int) -> Facts:
    key = conn.execute(sa.text("SELECT pg_get_partkeydef(:oid)"), {"oid": oid}).scalar_one()
    rows = _rows(
        conn,
        """
        SELECT c.oid, c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound
        FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = :oid
        ORDER BY c.relname
        """,
        oid=oid,
    )
    partitions = [
        {
            "name": r.name,
            "bound": r.bound,
            "indexes": _indexes(conn, r.oid),
            "constraints": _partition_constraints(conn, r.oid),
        }
        for r in rows
    ]
    return {"key": key, "partition_count": len(partitions), "partitions": partitions}


def _partition_constraints(conn: sa.Connection, oid: int) -> list[Facts]:
    rows = _rows(
        conn,
        """
        SELECT c.conname AS name, c.contype AS type, pg_get_constraintdef(c.oid) AS definition
        FROM pg_constraint AS c WHERE c.conrelid = :oid
          AND c.contype <> 'n'  -- PostgreSQL 18 lists NOT NULL here too; attnotnull has it
        ORDER BY c.conname
        """,
        oid=oid,
    )
    return [dict(r._mapping) for r in rows]


def read_sequence(conn: sa.Connection, qualified: str) -> Facts:
    row = conn.execute(
        sa.text(
            """
            SELECT format_type(s.seqtypid, NULL) AS data_type, s.seqstart AS start_value,
                   s.seqmin AS min_value, s.seqmax AS max_value, s.seqincrement AS increment_by,
                   s.seqcycle AS cycle, s.seqcache AS cache_size,
                   ARRAY(SELECT tn.nspname || '.' || tc.relname || '.' || a.attname
                         FROM pg_depend AS d
                         JOIN pg_attrdef AS ad ON d.classid = 'pg_attrdef'::regclass
                                              AND ad.oid = d.objid
                         JOIN pg_class AS tc ON tc.oid = ad.adrelid
                         JOIN pg_namespace AS tn ON tn.oid = tc.relnamespace
                         JOIN pg_attribute AS a ON a.attrelid = ad.adrelid AND a.attnum = ad.adnum
                         WHERE d.refclassid = 'pg_class'::regclass AND d.refobjid = s.seqrelid
                         ORDER BY 1) AS used_as_column_default_by,
                   (SELECT tn.nspname || '.' || tc.relname || '.' || a.attname
                    FROM pg_depend AS d
                    JOIN pg_class AS tc ON tc.oid = d.refobjid
                    JOIN pg_namespace AS tn ON tn.oid = tc.relnamespace
                    JOIN pg_attribute AS a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                    WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid
                      AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i'))
                       AS owned_by
            FROM pg_sequence AS s WHERE s.seqrelid = CAST(:name AS regclass)
            """
        ),
        {"name": qualified},
    ).one()
    facts = dict(row._mapping)
    facts["used_as_column_default_by"] = list(row.used_as_column_default_by)
    return facts


_VOLATILITY = {"i": "IMMUTABLE", "s": "STABLE", "v": "VOLATILE"}


def read_functions(conn: sa.Connection, schemas: list[str]) -> dict[str, Facts]:
    """Plain functions (not procedures or aggregates) keyed by their printed signature."""
    rows = _rows(
        conn,
        """
        SELECT n.nspname AS schema, p.proname AS name,
               pg_get_function_identity_arguments(p.oid) AS identity_arguments,
               pg_get_function_arguments(p.oid) AS arguments_with_defaults,
               pg_get_function_result(p.oid) AS returns, l.lanname AS language,
               p.provolatile AS volatility, p.proisstrict AS strict,
               p.prosecdef AS security_definer, p.proconfig AS settings
        FROM pg_proc AS p
        JOIN pg_namespace AS n ON n.oid = p.pronamespace
        JOIN pg_language AS l ON l.oid = p.prolang
        WHERE n.nspname = ANY(:schemas) AND p.prokind = 'f'
        ORDER BY 1, 2, 3
        """,
        schemas=schemas,
    )
    functions: dict[str, Facts] = {}
    for r in rows:
        signature = f"{r.schema}.{r.name}({r.identity_arguments}) RETURNS {r.returns}"
        functions[signature] = {
            "name": r.name,
            "identity_arguments": r.identity_arguments,
            "arguments_with_defaults": r.arguments_with_defaults,
            "returns": r.returns,
            "language": r.language,
            "volatility": _VOLATILITY[r.volatility],
            "strict": r.strict,
            "security_definer": r.security_definer,
            "settings": None if r.settings is None else list(r.settings),
            "signature": signature,
        }
    return functions


def read_enums(conn: sa.Connection, schemas: list[str]) -> dict[str, list[str]]:
    rows = _rows(
        conn,
        """
        SELECT n.nspname || '.' || t.typname AS name,
               ARRAY(SELECT e.enumlabel FROM pg_enum AS e WHERE e.enumtypid = t.oid
                     ORDER BY e.enumsortorder) AS labels
        FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
        WHERE n.nspname = ANY(:schemas) AND t.typtype = 'e'
        ORDER BY 1
        """,
        schemas=schemas,
    )
    return {r.name: list(r.labels) for r in rows}


# ------------------------------------------------------------------------------------ diffing

# Lists whose order is not a fact: compared as sets of named items so a difference names the
# item. Column order IS a fact, so "columns" is compared position by position.
_NAMED_LISTS = frozenset(
    {
        "check_constraints",
        "unique_constraints",
        "foreign_keys",
        "indexes",
        "triggers",
        "partitions",
        "constraints",
    }
)


def diff(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Human-readable differences between two fact trees; empty when they are equal."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[str] = []
        for key in sorted(expected.keys() | actual.keys()):
            where = f"{path}.{key}" if path else key
            if key not in actual:
                out.append(f"{where}: missing (expected {expected[key]!r})")
            elif key not in expected:
                out.append(f"{where}: unexpected {actual[key]!r}")
            elif key in _NAMED_LISTS and isinstance(expected[key], list):
                out += diff(_by_name(expected[key]), _by_name(actual[key]), where)
            else:
                out += diff(expected[key], actual[key], where)
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [
                f"{path}: expected {len(expected)} items {expected!r}, got {len(actual)} {actual!r}"
            ]
        out = []
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            out += diff(e, a, f"{path}[{i}]")
        return out
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []


def _by_name(items: list[Any]) -> dict[str, Any]:
    return {str(item["name"]): item for item in items}


def object_diff(expected: Mapping[str, Facts], live: Mapping[str, Facts]) -> list[str]:
    """Differences for every object present on both sides, prefixed with the object key."""
    out: list[str] = []
    for key in sorted(expected.keys() & live.keys()):
        out += [f"{key}: {line}" for line in diff(expected[key], live[key])]
    return out


# ------------------------------------------------------------------------------- seed rows

_TRANSITION_COLUMNS = (
    "singleton, current_engine, prepared_engine, state, transition_epoch, details, finalized_at"
)


def expected_seed_rows(catalog: Facts) -> Facts:
    """The rows a fresh v040 cluster starts with, as the catalog records them."""
    reference = catalog["reference_database"]
    return {
        "storage_transition_state": reference["storage_transition_state_row"],
        "schema_versions": reference["schema_versions_present"],
        "queue_ring_state": {
            schema: facts["seed_rows"]["queue_ring_state"]
            for schema, facts in catalog["queue_storage_schemas"].items()
        },
    }


def read_seed_rows(conn: sa.Connection, queue_storage_schemas: Iterable[str]) -> Facts:
    transition = _rows(conn, f"SELECT {_TRANSITION_COLUMNS} FROM awa.storage_transition_state")
    versions = conn.execute(sa.text("SELECT version FROM awa.schema_version ORDER BY 1"))
    rings = {
        schema: [
            dict(r._mapping)
            for r in _rows(
                conn,
                "SELECT singleton, current_slot, generation, slot_count "
                f'FROM "{schema}".queue_ring_state',
            )
        ]
        for schema in queue_storage_schemas
    }
    return {
        "storage_transition_state": [dict(r._mapping) for r in transition],
        "schema_versions": list(versions.scalars()),
        "queue_ring_state": rings,
    }


# ---------------------------------------------------------------------- shared clones


@contextmanager
def cloned_database(pg: EmbeddedPostgres, template: str) -> Iterator[sa.Engine]:
    """A private copy of *template* for a whole test module.

    Cloning a template costs a second or more (several for the awa-cli one), so read-only
    checks and tests that roll their transaction back share one copy instead of one each.
    """
    name = f"shared_{uuid.uuid4().hex[:16]}"
    janitor = _janitor(pg, name, template=template)
    janitor.init()
    engine = sa.create_engine(pg.database_url(name))
    try:
        yield engine
    finally:
        engine.dispose()
        janitor.drop()
