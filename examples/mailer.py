"""An example service that embeds awa-sa: a mailer that settles its failed attempts itself.

Awa's worker claims ``send_email`` jobs and the handler sends the message. When sending fails,
the service does two things that must commit together: it fails the attempt as Awa's worker
would (``settle_canonical_attempt`` with ``Fail`` on the service's own ``Connection``: a retry
with backoff, or ``failed`` on the final attempt) and records the failure
in a table of its own, which support reads. A retry nobody recorded, or a record of a retry that
never happened, would both mislead; one transaction rules both out.

``test_mailer.py`` tests it with nothing but the awa-sa testing kit.
"""

from __future__ import annotations

import sqlalchemy as sa

from awa_sa import Ending, Fail, Migrated, Rescheduled, Stale, settle_canonical_attempt

metadata = sa.MetaData()

failed_deliveries = sa.Table(
    "failed_deliveries",
    metadata,
    sa.Column("job_id", sa.BigInteger, primary_key=True),
    sa.Column("run_lease", sa.BigInteger, primary_key=True),
    sa.Column("error", sa.Text, nullable=False),
    sa.Column("outcome", sa.Text, nullable=False),
    # The job that will try again: the same id, or a fresh one once Awa has moved the job to
    # queue storage. None when it failed for good, or a newer email to the same address made
    # this one a duplicate.
    sa.Column("retry_job_id", sa.BigInteger),
    sa.Column("recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)


def create_tables(engine: sa.Engine) -> None:
    metadata.create_all(engine)


def on_delivery_failure(engine: sa.Engine, job_id: int, run_lease: int, exc: Exception) -> Ending:
    """Fail the attempt ``(job_id, run_lease)`` as Awa would and record it, atomically.

    A ``Stale`` attempt was settled by someone else (rescued, cancelled, already retried):
    nothing is written and nothing recorded. If the record cannot be written the retry is
    rolled back with it and the error propagates; the attempt stays running until Awa rescues it.
    """
    with engine.begin() as conn:
        outcome = settle_canonical_attempt(
            conn, job_id, run_lease, Fail(f"{type(exc).__name__}: {exc}")
        )
        if isinstance(outcome, Stale):
            return outcome
        retry = outcome.job_id if isinstance(outcome, Rescheduled | Migrated) else None
        conn.execute(
            failed_deliveries.insert().values(
                job_id=job_id,
                run_lease=run_lease,
                error=str(exc),
                outcome=type(outcome).__name__,
                retry_job_id=retry,
            )
        )
    return outcome
