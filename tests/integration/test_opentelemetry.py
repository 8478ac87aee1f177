"""opentelemetry-instrumentation-sqlalchemy records a span for every statement awa-sa sends.

The instrumentation listens to an engine's cursor events, and awa-sa sends its compiled text on
the caller's connection (``exec_driver_sql``), so each statement should be a span with its text.
The driver walk (every outcome and error, canonical and queue storage) runs on an instrumented
engine, and the spans are compared with the statements seen by a listener of our own.

The instrumentation declares ``sqlalchemy < 2.1``: on SQLAlchemy 2.0 it instruments as is; on 2.1
it instruments nothing unless ``instrument(skip_dep_check=True)`` (what the README tells a service
on 2.1 to do). The test runs both ways: in CI on the newest 2.1 and in the SQLAlchemy 2.0 venvs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from recording import recording
from test_drivers import Face, _name, seed, walk

from awa_sa.testing.server import EmbeddedPostgres

ON_2_0 = sa.__version__.startswith("2.0.")


def _text(span: Any) -> str | None:
    attributes = span.attributes or {}
    text = attributes.get("db.statement") or attributes.get("db.query.text")
    return None if text is None else str(text)


def test_every_statement_of_the_walk_is_a_span(
    pg: EmbeddedPostgres, clone_database: Callable[[str], str], fixture_template: str
) -> None:
    url = clone_database(fixture_template)
    observer = sa.create_engine(url, poolclass=sa.NullPool)
    with observer.begin() as conn:
        jobs = seed(conn)
    face = Face("psycopg", url)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = SQLAlchemyInstrumentor()
    instrumentor.instrument(engine=face.engine, tracer_provider=provider, skip_dep_check=not ON_2_0)
    try:
        with recording(face.engine, lambda sql: sql, events=()) as sent:
            walked = walk(face, Cluster("fixture", pg, url, observer), jobs)
    finally:
        instrumentor.uninstrument()
        face.dispose()
        observer.dispose()
    spans = exporter.get_finished_spans()
    # The other spans are the pool's new connections ("connect"), which carry no statement.
    assert {span.name for span in spans if _text(span) is None} == {"connect"}
    assert [text for span in spans if (text := _text(span)) is not None] == sent
    # The walk's own statements: every outcome, both storages, errors included.
    assert {_name(result) for result in walked.results} == {
        *("Stale", "Rescheduled", "Migrated", "CancelledDuplicate"),
        *("UniqueConflict", "DatabaseError", "ValidationError"),
    }
    assert {t.split(maxsplit=1)[0].upper() for t in sent} >= {"SELECT", "INSERT", "WITH"}
    assert any("awa_qs." in t for t in sent)
    assert any("awa.scheduled_jobs" in t for t in sent)


@pytest.mark.skipif(ON_2_0, reason="the dependency check refuses only SQLAlchemy 2.1")
def test_without_skip_dep_check_nothing_is_recorded_on_2_1(db_url: str) -> None:
    """Why the README's line is needed: the instrumentation's check turns it off on 2.1."""
    engine = sa.create_engine(db_url)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = SQLAlchemyInstrumentor()
    instrumentor.instrument(engine=engine, tracer_provider=provider)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    finally:
        instrumentor.uninstrument()
        engine.dispose()
    assert exporter.get_finished_spans() == ()
