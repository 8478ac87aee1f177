"""A SQL function under a schema that ``schema_translate_map`` renders, as a table's is.

Its own module: the statements' builders need it (:mod:`awa_sa.tables.queue_storage`), the execution
paths do not.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import NullType

from awa_sa.core.internals import lookup

__all__ = ["SchemaTranslatedFunction"]


class SchemaTranslatedFunction(FunctionElement[None]):
    """A SQL function under a schema that ``schema_translate_map`` renders, as a table's is.

    ``sqlalchemy.func`` cannot put a function under a translated schema. A FunctionElement
    whose (undocumented) ``_use_schema_map`` is set has its ``schema`` resolved by the
    compiler's ``preparer.schema_for_object``, as a table's is. Where SQLAlchemy no longer
    reads that flag (``lookup.PATHS.schema_map``), the schema is looked up in the compiler's
    ``schema_translate_map`` here. Subclasses set ``name`` and ``schema``.
    tests/unit/test_statements.py (the lane sequences under ``awa_qs``).
    """

    type = NullType()
    inherit_cache = True
    _use_schema_map = True
    schema: str


@compiles(SchemaTranslatedFunction)
def _compile_schema_translated(
    element: SchemaTranslatedFunction, compiler: SQLCompiler, **kw: Any
) -> str:
    preparer = compiler.preparer
    if lookup.PATHS.schema_map:
        schema = preparer.schema_for_object(element)
    else:
        translated = (compiler.schema_translate_map or {}).get(element.schema, element.schema)
        schema = cast(str, translated)  # a map names a schema for a schema
    arguments = compiler.process(element.clauses, **kw)
    return f"{preparer.quote_schema(schema)}.{element.name}({arguments})"
