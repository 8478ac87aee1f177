"""The mailer's tests, written with nothing but the awa-sa testing kit.

``awa_engine`` (the pytest plugin) gives each test a fresh Awa v040 database; ``running_attempt``
puts a claimed job in it, ``set_phase`` flips routing as ``awa storage`` would, and ``locate``
says where the job is afterwards.
"""

from __future__ import annotations

from typing import Any

import mailer
import pytest
import sqlalchemy as sa

from awa_sa import CancelledDuplicate, Migrated, Rescheduled, Stale
from awa_sa.testing import locate, running_attempt, set_phase

SMTP_DOWN = TimeoutError("smtp.example.com timed out")


@pytest.fixture
def engine(awa_engine: sa.Engine) -> sa.Engine:
    mailer.create_tables(awa_engine)
    return awa_engine


def claimed(engine: sa.Engine, **job: Any) -> tuple[int, int]:
    """A send_email job as Awa's worker holds it while the handler runs."""
    with engine.begin() as conn:
        return running_attempt(
            conn, kind="send_email", queue="mail", args={"to": "ada@example.com"}, **job
        )


def recorded(engine: sa.Engine) -> list[tuple[Any, ...]]:
    table = mailer.failed_deliveries
    query = sa.select(table.c.job_id, table.c.run_lease, table.c.outcome, table.c.retry_job_id)
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(query)]


def test_a_failed_send_is_retried_under_its_id_and_recorded(engine: sa.Engine) -> None:
    job_id, lease = claimed(engine)
    outcome = mailer.on_delivery_failure(engine, job_id, lease, SMTP_DOWN)
    assert isinstance(outcome, Rescheduled)
    with engine.connect() as conn:
        where = locate(conn, job_id)
    assert where is not None
    assert (where.relation, where.state, where.attempt) == ("awa.scheduled_jobs", "retryable", 1)
    assert where.errors[-1]["error"] == "TimeoutError: smtp.example.com timed out"
    assert recorded(engine) == [(job_id, lease, "Rescheduled", job_id)]


def test_once_routing_flips_the_retry_moves_to_queue_storage(engine: sa.Engine) -> None:
    job_id, lease = claimed(engine)
    with engine.begin() as conn:
        set_phase(conn, "mixed_transition")  # routes new work to awa_qs
    outcome = mailer.on_delivery_failure(engine, job_id, lease, SMTP_DOWN)
    assert isinstance(outcome, Migrated)
    with engine.connect() as conn:
        where = locate(conn, outcome)
        assert locate(conn, job_id) is None  # the canonical id exists no more
    assert where is not None
    assert (where.relation, where.state) == ("awa_qs.deferred_jobs", "retryable")
    assert recorded(engine) == [(job_id, lease, "Migrated", outcome.job_id)]


def test_a_duplicate_is_recorded_but_not_retried(engine: sa.Engine) -> None:
    # This send does not hold its key while running, so a newer send to Ada takes it.
    job_id, lease = claimed(engine, unique_key=b"ada@example.com", unique_states="11001000")
    claimed(engine, unique_key=b"ada@example.com")
    with engine.begin() as conn:
        set_phase(conn, "mixed_transition")
    outcome = mailer.on_delivery_failure(engine, job_id, lease, SMTP_DOWN)
    assert isinstance(outcome, CancelledDuplicate)
    with engine.connect() as conn:
        where = locate(conn, outcome)
    assert where is not None
    assert (where.relation, where.state) == ("awa_qs.done_entries", "cancelled")
    assert recorded(engine) == [(job_id, lease, "CancelledDuplicate", None)]


def test_a_stale_attempt_is_neither_retried_nor_recorded(engine: sa.Engine) -> None:
    job_id, lease = claimed(engine)
    outcome = mailer.on_delivery_failure(engine, job_id, lease + 1, SMTP_DOWN)
    assert outcome == Stale()
    with engine.connect() as conn:
        where = locate(conn, job_id)
    assert where is not None
    assert (where.relation, where.state) == ("awa.jobs_hot", "running")
    assert recorded(engine) == []


def test_no_retry_without_its_record(engine: sa.Engine) -> None:
    job_id, lease = claimed(engine)
    earlier = (job_id, lease, "Rescheduled", job_id)
    with engine.begin() as conn:  # this attempt's failure is somehow on record already
        conn.execute(
            mailer.failed_deliveries.insert().values(
                job_id=job_id, run_lease=lease, error="earlier", outcome="Rescheduled",
                retry_job_id=job_id,
            )
        )  # fmt: skip
    with pytest.raises(sa.exc.IntegrityError):
        mailer.on_delivery_failure(engine, job_id, lease, SMTP_DOWN)
    with engine.connect() as conn:
        where = locate(conn, job_id)
    assert where is not None
    assert (where.relation, where.state) == ("awa.jobs_hot", "running")  # the retry rolled back
    assert recorded(engine) == [earlier]
