"""Every input checked before anything reaches the database (docs/contract.md#validation).

A refusal here is a :class:`~awa_sa.core.errors.ValidationError` raised before a connection is even
checked out, so bad input can never leave a job half changed. What passes becomes a
:class:`Call`: the kind as the caller gave it, and the typed parameters of the statements.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from awa_sa.core.errors import CompactReceipt, MaterialisedAttempt, ValidationError
from awa_sa.settle.results import (
    Attempt,
    Cancel,
    Complete,
    Fail,
    Kind,
    Result,
    RetryAfter,
    RetryBackoff,
    Settle,
    Snooze,
    check_delay,
)
from awa_sa.settle.running import RunningAttempt
from awa_sa.settle.statements.attempts import KindTag, MoveItem
from awa_sa.settle.statements.endings import EndItem, EndTag
from awa_sa.settle.statements.receipt_settles import ReceiptItem, ReceiptTag

_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""``\\u0000`` as an escape in JSON text, not a literal backslash followed by ``u0000``."""
_DAY = 86_400.0
# psycopg must be able to hand run_at back as a Python datetime; a day of slack covers any
# difference between our clock and the database's.
_RUN_AT_MIN = datetime(1, 1, 1, tzinfo=UTC).timestamp() + _DAY
_RUN_AT_MAX = datetime(9999, 12, 31, tzinfo=UTC).timestamp() - _DAY


@dataclass(frozen=True, slots=True)
class Call:
    """One validated request: the kind asked for and the statements' parameters."""

    kind: Kind
    item: MoveItem

    @property
    def job_id(self) -> int:
        return self.item.job_id

    @property
    def bare(self) -> bool:
        """Whether the caller named the attempt by ``(job_id, run_lease)`` alone, not by the
        ``RunningAttempt`` it read (which names its plane, kind, queue and attempt too)."""
        return self.item.kind is None


def prepare(
    job_id: object,
    run_lease: object,
    kind: object,
    error: object,
    progress: object,
    *,
    named: RunningAttempt | None = None,
) -> Call:
    """One attempt's arguments as a :class:`Call`, or the reason they can never succeed.

    *named*: the canonical attempt the caller read, whose kind, queue and attempt the guard
    checks too.
    """
    job_id = _bigint("job_id", job_id)
    run_lease = _bigint("run_lease", run_lease)
    if not isinstance(kind, Snooze | RetryAfter | RetryBackoff):
        raise ValidationError(f"kind must be Snooze, RetryAfter or RetryBackoff, got {kind!r}")
    tag, delay = _rescheduling(kind)
    item = MoveItem(
        job_id,
        run_lease,
        tag,
        delay,
        _json_text("error", error),
        _json_text("progress", progress),
    )
    if named is not None:
        item = item._replace(kind=named.kind, queue=named.queue, attempt=named.attempt)
    return Call(kind, item)


def _rescheduling(kind: Kind) -> tuple[KindTag, float | None]:
    """A re-schedule's tag, and its delay (checked) for Snooze and RetryAfter."""
    if isinstance(kind, RetryBackoff):
        return "retry_backoff", None
    return ("snooze" if isinstance(kind, Snooze) else "retry_after"), _delay(kind)


def _delay(kind: Snooze | RetryAfter) -> float:
    check_delay(kind.delay_secs)
    delay = float(kind.delay_secs)
    now = time.time()
    if not _RUN_AT_MIN - now <= delay <= _RUN_AT_MAX - now:
        raise ValidationError(f"delay_secs={kind.delay_secs!r} puts run_at outside years 1..9999")
    return delay


@dataclass(frozen=True, slots=True)
class EndCall:
    """One validated ending: the result asked for and the ending statement's parameters."""

    kind: Complete | Cancel | Fail
    item: EndItem

    @property
    def job_id(self) -> int:
        return self.item.job_id

    @property
    def bare(self) -> bool:
        """As :attr:`Call.bare`."""
        return self.item.kind is None


@dataclass(frozen=True, slots=True)
class ReceiptCall:
    """One validated settle of a queue-storage attempt, in its schema (``storage``)."""

    kind: Result
    item: ReceiptItem
    schema: str

    @property
    def job_id(self) -> int:
        return self.item.job_id


AnyCall = Call | EndCall | ReceiptCall


def prepare_result(
    job_id: object,
    run_lease: object,
    result: object,
    error: object,
    progress: object,
    *,
    named: RunningAttempt | None = None,
) -> AnyCall:
    """Any result's arguments as a call: an ending as :class:`EndCall`, else :func:`prepare`."""
    if not isinstance(result, Complete | Cancel | Fail):
        if not isinstance(result, Snooze | RetryAfter | RetryBackoff):
            raise ValidationError(
                "result must be Complete, Cancel, Fail, Snooze, RetryAfter or RetryBackoff, "
                f"got {result!r}"
            )
        return prepare(job_id, run_lease, result, error, progress, named=named)
    if error is not None:
        raise ValidationError("error= is for a re-schedule; Cancel and Fail carry their own text")
    tag, message = _ending(result)
    item = EndItem(
        _bigint("job_id", job_id),
        _bigint("run_lease", run_lease),
        tag,
        message,
        _json_text("progress", progress),
    )
    if named is not None:
        item = item._replace(kind=named.kind, queue=named.queue, attempt=named.attempt)
    return EndCall(result, item)


def _ending(result: Complete | Cancel | Fail) -> tuple[EndTag, str | None]:
    """An ending's tag, and its text (the cancel reason, the failure's error) checked."""
    if isinstance(result, Complete):
        return "complete", None
    if isinstance(result, Cancel):
        return "cancel", _text("Cancel reason", result.reason)
    return ("fail_terminal" if result.terminal else "fail"), _text("Fail error", result.error)


def prepare_receipt(
    attempt: RunningAttempt, result: object, error: object, progress: object
) -> ReceiptCall:
    """A queue-storage attempt's settle as a :class:`ReceiptCall`, or why it can never be made.

    ``error`` is for a re-schedule, as on the canonical plane; ``progress`` None keeps the
    progress the attempt last flushed, as the runtime does.
    """
    delay: float | None = None
    message: str | None = None
    tag: ReceiptTag
    if isinstance(result, Complete | Cancel | Fail):
        tag, message = _ending(result)
    elif isinstance(result, Snooze | RetryAfter | RetryBackoff):
        tag, delay = _rescheduling(result)
    else:
        raise ValidationError(
            "result must be Complete, Cancel, Fail, Snooze, RetryAfter or RetryBackoff, "
            f"got {result!r}"
        )
    if error is not None and message is not None:
        raise ValidationError("error= is for a re-schedule; Cancel and Fail carry their own text")
    if attempt.claim_slot is None or attempt.receipt_id is None:
        # Only a lease materialised from a compact receipt lists without its receipt: a queue
        # without a deadline, refused as its compact receipts are.
        raise MaterialisedAttempt(attempt.job_id, attempt.run_lease, attempt.storage)
    if attempt.claim_batch_id is not None:
        # A heartbeat rescue older than the commit would still run it again: refused before
        # any statement, so a batch holding one writes nothing (docs/contract.md#compact-receipts).
        raise CompactReceipt(attempt.job_id, attempt.run_lease, attempt.storage, attempt.queue)
    item = ReceiptItem(
        attempt.job_id,
        attempt.run_lease,
        attempt.claim_slot,
        attempt.receipt_id,
        None,  # batch_id and batch_index: the statement's compact branch is cancel_job's alone
        None,
        tag,
        message,
        None if message is not None else _json_text("error", error),
        _json_text("progress", progress),
        delay,
        attempt.kind,
        attempt.queue,
        attempt.attempt,
        attempt._ready_slot,
    )
    return ReceiptCall(result, item, attempt.storage)


def retry_of(call: EndCall, attempt: int, at: str) -> Call:
    """The re-schedule with backoff of a retryable failure with attempts left, its error
    entry built as the worker builds it: the text, the attempt that failed, the clock."""
    entry = json.dumps({"error": call.item.message, "attempt": attempt, "at": at})
    item = MoveItem(
        call.item.job_id,
        call.item.run_lease,
        "retry_backoff",
        None,
        entry,
        call.item.progress,
        call.item.kind,
        call.item.queue,
        call.item.attempt,
    )
    return Call(RetryBackoff(), item)


def _text(name: str, value: str) -> str:
    """Text PostgreSQL can store: no U+0000, no lone surrogate."""
    if "\x00" in value:
        raise ValidationError(f"{name} contains U+0000, which PostgreSQL text cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{name} is not valid Unicode: {exc}") from exc
    return value


def prepare_all(attempts: object) -> list[Call]:
    """Validate a batch of re-schedules before any statement; a refusal names the item."""
    calls = prepare_batch(attempts, endings=False)
    return [call for call in calls if isinstance(call, Call)]


def prepare_batch(attempts: object, *, endings: bool = True) -> list[AnyCall]:
    """Validate a whole batch before any statement; a refusal names the item's index.

    *endings*: items are :class:`~awa_sa.settle.results.Settle` (or re-schedule ``Attempt``) of any
    result; otherwise ``Attempt`` re-schedules only.
    """
    if isinstance(attempts, str | bytes | Mapping) or not isinstance(attempts, Iterable):
        raise ValidationError(
            f"attempts must be an iterable of Attempt, got {type(attempts).__name__}"
        )
    accepted = (Attempt, Settle) if endings else (Attempt,)
    calls: list[AnyCall] = []
    for index, item in enumerate(attempts):
        if not isinstance(item, accepted):
            names = " or ".join(kind.__name__ for kind in accepted)
            raise ValidationError(
                f"attempts[{index}] must be an {names}, got {type(item).__name__}"
            )
        result = item.result if isinstance(item, Settle) else item.kind
        make = prepare_result if endings else prepare
        try:
            calls.append(make(item.job_id, item.run_lease, result, item.error, item.progress))
        except ValidationError as exc:
            raise ValidationError(f"attempts[{index}]: {exc}") from exc
    return calls


def _bigint(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an int, got {type(value).__name__}")
    if not _BIGINT_MIN <= value <= _BIGINT_MAX:
        raise ValidationError(f"{name}={value} is outside the bigint range")
    return value


def _json_text(name: str, value: object) -> str | None:
    """*value* as JSON text for a jsonb cast; jsonb's own refusals are caught here, early."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # lone surrogates
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"{name} is not JSON-serialisable: {exc}") from exc
    if _NUL_ESCAPE.search(text):
        raise ValidationError(f"{name} contains U+0000, which jsonb cannot store")
    return text


def items(calls: Sequence[Call]) -> list[MoveItem]:
    """The statements' parameters of *calls*, in order."""
    return [call.item for call in calls]


def first_of_each_pair(asked: Sequence[MoveItem | EndItem]) -> dict[tuple[int, int], int]:
    """Where each ``(job_id, run_lease)`` is first asked for: the item a statement's answer
    for that attempt belongs to (a repeat is Stale, as one by one)."""
    first: dict[tuple[int, int], int] = {}
    for index, item in enumerate(asked):
        first.setdefault((item.job_id, item.run_lease), index)
    return first


def settling(attempt: object, result: object, error: object, progress: object) -> AnyCall:
    """The validated call for :func:`settle`, or why it can never be made."""
    if not isinstance(attempt, RunningAttempt):
        raise ValidationError(
            f"attempt must be a RunningAttempt (from running_attempts or attempt_of), "
            f"got {type(attempt).__name__}"
        )
    if attempt.on_queue_storage:
        return prepare_receipt(attempt, result, error, progress)
    return prepare_result(attempt.job_id, attempt.run_lease, result, error, progress, named=attempt)
