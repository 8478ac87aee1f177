"""What a handler asked for (a re-schedule or an ending), a batch item, and what became of it.

Plain frozen values: they cross thread and event-loop boundaries and are compared in tests.
A delay is checked when the kind is built, so a NaN never gets as far as a connection.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from awa_sa.core.errors import ValidationError


def check_delay(delay_secs: object) -> None:
    """Refuse a delay PostgreSQL would mangle or reject, before any statement is built."""
    # bool is an int, and `Snooze(True)` is a bug, not one second.
    if isinstance(delay_secs, bool) or not isinstance(delay_secs, int | float):
        raise ValidationError(f"delay_secs must be a number of seconds, got {delay_secs!r}")
    try:
        finite = math.isfinite(delay_secs)
    except OverflowError:  # an int too large for a double
        finite = False
    if not finite:
        # PostgreSQL turns NaN into a huge negative interval and infinity into an error.
        raise ValidationError(f"delay_secs must be finite, got {delay_secs!r}")
    if delay_secs < 0:
        # Awa's SQL would take one (a run_at in the past); its worker never sends one, its
        # delays being durations (docs/contract.md#differences).
        raise ValidationError(f"delay_secs must not be negative, got {delay_secs!r}")


@dataclass(frozen=True, slots=True)
class Snooze:
    """Run again after ``delay_secs``; the attempt that just ran is not counted.

    A delay PostgreSQL would mangle is refused when the kind is built, before any connection::

        >>> Snooze(30)
        Snooze(delay_secs=30)
        >>> Snooze(float("nan"))
        Traceback (most recent call last):
        ...
        awa_sa.core.errors.ValidationError: delay_secs must be finite, got nan

    The third attempt snoozes, so the job's next claim is its third attempt again::

        >>> from awa_sa import reschedule_canonical_attempt
        >>> from awa_sa.testing import running_attempt
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(conn, attempt=3)
        >>> reschedule_canonical_attempt(engine, job_id, lease, Snooze(30)).attempt
        2
    """

    delay_secs: float

    def __post_init__(self) -> None:
        check_delay(self.delay_secs)


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """Retry after ``delay_secs``; the attempt counts."""

    delay_secs: float

    def __post_init__(self) -> None:
        check_delay(self.delay_secs)


@dataclass(frozen=True, slots=True)
class RetryBackoff:
    """Retry after ``awa.backoff_duration(attempt, max_attempts)``, computed by the database.

    The delay grows with the attempt, as Awa's own retries do::

        >>> from awa_sa import reschedule_canonical_attempt
        >>> from awa_sa.testing import running_attempt
        >>> with engine.begin() as conn:
        ...     job_id, lease = running_attempt(conn, attempt=1)
        ...     started = conn.exec_driver_sql("SELECT now()").scalar_one()
        >>> outcome = reschedule_canonical_attempt(engine, job_id, lease, RetryBackoff())
        >>> outcome.run_at > started
        True
    """


Kind = Snooze | RetryAfter | RetryBackoff
"""The re-schedules: the attempt runs again later."""


@dataclass(frozen=True, slots=True)
class Complete:
    """The handler succeeded: the attempt ends ``completed`` (awa-pg: the handler returns)."""


@dataclass(frozen=True, slots=True)
class Cancel:
    """End the job ``cancelled``, with ``cancelled: <reason>`` in its errors (``awa.Cancel``)."""

    reason: str = "cancelled by handler"

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str):
            raise ValidationError(f"Cancel reason must be a str, got {self.reason!r}")


@dataclass(frozen=True, slots=True)
class Fail:
    """The handler failed with *error* (the text of the error entry), as Awa's worker decides.

    ``terminal`` (``awa.TerminalError``): the job ends ``failed`` now, the entry marked
    ``"terminal": true``. Otherwise a retryable failure: retried with Awa's backoff while the
    attempt is below ``max_attempts``, and ``failed`` (no ``terminal`` key) on the final one,
    decided from the attempt's own row. :meth:`of` writes the text as the worker does.
    """

    error: str
    terminal: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.error, str):
            raise ValidationError(f"Fail error must be a str, got {self.error!r}")
        if not isinstance(self.terminal, bool):
            raise ValidationError(f"Fail terminal must be a bool, got {self.terminal!r}")

    @classmethod
    def of(cls, exc: BaseException, *, terminal: bool = False) -> Fail:
        """The failure of *exc*, its text as awa-pg 0.6.9 writes it (observed): the exception's
        ``<qualname>: <message>``, then its traceback without the exception line -- whole when
        it has at most :data:`TRACEBACK_LINES` lines, else ``... (N frames truncated, full
        trace in logs)`` and its last ones."""
        trace = "Traceback (most recent call last):\n" + "".join(
            traceback.format_tb(exc.__traceback__)
        )
        lines = trace.splitlines()
        if len(lines) > TRACEBACK_LINES:
            dropped = len(lines) - TRACEBACK_LINES
            kept = "\n".join(lines[-TRACEBACK_LINES:])
            trace = f"... ({dropped} frames truncated, full trace in logs)\n{kept}"
        return cls(f"{type(exc).__qualname__}: {exc}\n{trace}", terminal)


TRACEBACK_LINES = 10
"""How many lines of a traceback awa-pg keeps in an error entry."""


Result = Kind | Complete | Cancel | Fail
"""Every way a handler can end its attempt."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One item of a batch: the arguments of one single call, checked when the batch is.

    Not validated here, so that a bad item is reported with its position in the batch.
    """

    job_id: int
    run_lease: int
    kind: Kind
    error: Any = None
    progress: Any = None


@dataclass(frozen=True, slots=True)
class Settle:
    """One item of ``settle_canonical_attempts``: any result, checked when the batch is."""

    job_id: int
    run_lease: int
    result: Result
    error: Any = None
    progress: Any = None


@dataclass(frozen=True, slots=True)
class Rescheduled:
    """The same canonical row, moved to ``awa.scheduled_jobs`` under the same id."""

    job_id: int
    run_at: datetime
    attempt: int


@dataclass(frozen=True, slots=True)
class Migrated:
    """Moved to ``S.deferred_jobs`` under a fresh id from ``S.job_id_seq``."""

    job_id: int
    run_at: datetime
    attempt: int


@dataclass(frozen=True, slots=True)
class CancelledDuplicate:
    """A newer job owns the unique key; the successor was recorded cancelled in ``S.done_entries``.

    Awa's executor treats this like :class:`Stale` (no retry event) but commits the write.
    """

    job_id: int


@dataclass(frozen=True, slots=True)
class Stale:
    """The ``(id, running, run_lease)`` guard matched nothing; nothing was changed."""


Outcome = Rescheduled | Migrated | CancelledDuplicate | Stale
"""What a re-schedule did."""


@dataclass(frozen=True, slots=True)
class Completed:
    """The attempt ended ``completed``, its row left in ``awa.jobs_hot`` under its id."""

    job_id: int


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The job ended ``cancelled``, its row left in ``awa.jobs_hot`` under its id."""

    job_id: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The job ended ``failed``: a terminal failure, or a retryable one on its final attempt."""

    job_id: int
    terminal: bool


Ending = Outcome | Completed | Cancelled | Failed
"""What a settle did: an ending, or what a re-schedule does."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """One item of ``settle_attempts``: a running attempt of either plane and its result."""

    attempt: Any
    """The ``RunningAttempt`` that ``running_attempts`` or ``attempt_of`` returned."""
    result: Result
    error: Any = None
    progress: Any = None
