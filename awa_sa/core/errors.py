"""One exception root, so a caller can catch everything awa-sa raises with one clause.

* :class:`ValidationError` -- the input can never succeed. Raised before any statement runs
  where that is possible; otherwise (an invalid routing schema name, non-object metadata on the
  taken row) before anything is written, and the write that would follow is rolled back.
* :class:`UniqueConflict` -- SQLSTATE 23505. On the canonical path it propagates and the
  attempt stays running, as in Awa (docs/contract.md#errors). A claim that another job holds on
  the queue-storage path is not an error: the attempt ends as ``CancelledDuplicate``.
* :class:`NotAnAwaDatabase` -- a :class:`DatabaseError`: Awa's relations or functions are
  missing (42P01, 42883 on an ``awa.`` object), so the database was never built by ``awa migrate``.
* :class:`DatabaseError` -- any other driver error (interval overflow, lock timeout,
  serialization failure, lost connection, refused connection). ``sqlstate`` is exposed;
  ``__cause__`` is the SQLAlchemy exception, whose ``orig`` is the driver's own. The SQLSTATE,
  constraint name and message are read the same way from every supported driver
  (:mod:`awa_sa.core.driver_errors`), and a connection that could not be made or was lost is
  classified by cause, alike on every driver (:data:`CONNECTION_LOST`, :data:`CANNOT_CONNECT`).
* :class:`ReadOnlyTransaction` -- the :class:`DatabaseError` for 25006: the session landed on a
  standby, a demoted primary or a database set read-only. Its own type, so a caller can route
  it (reconnect to the primary) without reading SQLSTATEs.

One warning, not an error: :class:`PrivatePathUnavailable`, once per process, where a private
SQLAlchemy or driver name awa-sa uses has moved and the public path is taken instead
(docs/architecture.md#private-names).

Whatever is raised, nothing the operation did is committed. With an ``Engine`` its own
transaction is rolled back. With a ``Connection`` the caller's transaction is left either
untouched (the error came from a savepoint-wrapped queue-storage branch, or before any write) or
aborted by PostgreSQL (a failed canonical statement), and the caller must roll it back.
"""

from __future__ import annotations

from collections.abc import Sequence

from awa_sa.core.internals import PrivatePathUnavailable  # noqa: F401 -- re-exported for callers

UNIQUE_VIOLATION = "23505"
READ_ONLY = "25006"
UNDEFINED_OBJECTS = ("42P01", "42883")
"""PostgreSQL's undefined_table and undefined_function."""
CONNECTION_LOST = "08006"
"""The SQLSTATE of a connection lost during a call (PostgreSQL's ``connection_failure``).

Drivers disagree here: psycopg 3 reports the server's farewell (57P01 after
``pg_terminate_backend``), asyncpg its own 08003, psycopg2 and pg8000 nothing at all, and a
network failure gives no server code anywhere. One value lets a caller's retry policy treat
them alike; the driver's own exception stays available as ``__cause__``. Whether the call's
work was committed is unknown only if the loss came at COMMIT; awa-sa's calls are safe to
repeat either way (a repeat is ``Stale``).
"""
CANNOT_CONNECT = "08001"
"""The SQLSTATE of a connection that could not be made and that the server did not refuse
itself (``sqlclient_unable_to_establish_sqlconnection``): nothing listening, a network failure,
no host with the asked ``target_session_attrs``. A refusal the server reported keeps the
server's own code (3D000, 28000, 28P01, 53300, 57P03 ...), on every driver, so a retry
policy never retries a misconfiguration as if the network had failed.
"""


class AwaSAError(Exception):
    """Root of every error awa-sa raises."""


class ValidationError(AwaSAError, ValueError):
    """The input can never succeed; nothing was written."""


class InvalidSchemaName(ValidationError):
    """A queue-storage schema name that is not a plain lower-case SQL identifier."""

    def __init__(self, schema: str) -> None:
        super().__init__(f"invalid SQL identifier: {schema!r}")
        self.schema = schema


class UniqueConflict(AwaSAError):
    """Another job holds the unique key (SQLSTATE 23505).

    On the canonical path this propagates and the attempt stays running, as in Awa. A claim
    upsert that acquires nothing raises nothing: that is a lost claim, ``CancelledDuplicate``.
    """

    def __init__(self, constraint: str | None, message: str = "") -> None:
        super().__init__(message or f"unique conflict on {constraint}")
        self.constraint = constraint


class DuplicateJob(UniqueConflict):
    """A new job's unique key is held by another job; nothing of it was written.

    Raised by ``awa_sa.enqueue`` (and a batch's ``on_duplicate="raise"``) after the insert's
    savepoint was rolled back, so the caller's transaction goes on and can still commit its
    other rows. ``existing_id`` is the job holding the key when it could be read (None when
    the holder settled in between), ``unique_key`` the 16-byte key, ``index`` the position of
    the refused job in a batch.
    """

    def __init__(
        self,
        kind: str,
        unique_key: bytes,
        existing_id: int | None,
        index: int | None = None,
        constraint: str | None = None,
    ) -> None:
        holder = "another job" if existing_id is None else f"job {existing_id}"
        at = "" if index is None else f"jobs[{index}]: "
        super().__init__(
            constraint,
            f"{at}a {kind} job with unique key {unique_key.hex()} exists already ({holder})",
        )
        self.kind = kind
        self.unique_key = unique_key
        self.existing_id = existing_id
        self.index = index


class DatabaseError(AwaSAError):
    """The database refused a statement for a reason other than a unique conflict.

    ``sqlstate`` is :data:`CONNECTION_LOST` for a connection lost during a call whatever the
    driver, the server's code or :data:`CANNOT_CONNECT` for one that could not be made, and
    None when the failure carried no SQLSTATE (an expected row that was missing, SQLAlchemy
    refusing a connection that already failed).
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message if sqlstate is None else f"[{sqlstate}] {message}")
        self.sqlstate = sqlstate


class ReadOnlyTransaction(DatabaseError):
    """SQLSTATE 25006: the session cannot write (hot standby, demoted primary, or
    ``default_transaction_read_only``). Nothing was written; retrying on the same connection
    fails the same way, so reconnect to the primary (``target_session_attrs=read-write``).
    """


class NotAnAwaDatabase(DatabaseError):
    """A relation or function of Awa's schema is missing: not an Awa v040 database.

    Recognised from the error of the statement that needed it, the first one of a call (which
    fails as a whole, so nothing was written), rather than checked beforehand: a check would
    cost every call a round trip to catch a mistake made once, when a service is first pointed
    at a database.
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(
            f"not an Awa v040 database ({message}); build it with `awa migrate` (awa-cli 0.6.x)",
            sqlstate,
        )


class AttemptNotFound(AwaSAError, LookupError):
    """No running attempt is the job's current claim, in either storage plane.

    The claim was settled (by its worker, a rescue, a cancel or awa-sa) or claimed again with
    a later attempt since the job was handed over; nothing was read that could be settled.
    """

    def __init__(self, job_id: int, attempt: int) -> None:
        super().__init__(f"no running attempt {attempt} of job {job_id} matches it exactly")
        self.job_id = job_id
        self.attempt = attempt


class AmbiguousAttempt(AwaSAError, LookupError):
    """More than one running attempt matches the job on every attribute it carries.

    Two planes' jobs would have to share id, attempt, kind, queue and enqueue time to the
    microsecond; awa-sa refuses to pick one. ``candidates`` are the matching attempts.
    """

    def __init__(self, job_id: int, attempt: int, candidates: Sequence[object]) -> None:
        super().__init__(
            f"{len(candidates)} running attempts match attempt {attempt} of job {job_id}"
        )
        self.job_id = job_id
        self.attempt = attempt
        self.candidates = tuple(candidates)


class QueueStorageAttempt(ValidationError):
    """A bare ``(job_id, run_lease)`` names an open claim of the routing schema; nothing was
    written.

    Raised by the canonical calls: during a storage transition the planes' ids and leases
    collide, so that pair may mean a different job than the canonical row it also names
    (``canonical_too``). ``awa_sa.settle``, given the ``RunningAttempt``, settles either plane.
    Never answered as ``Stale``, which means the attempt was settled already.
    """

    def __init__(self, job_id: int, run_lease: int, schema: str, *, canonical_too: bool) -> None:
        where = f"an open claim of queue-storage schema {schema}"
        if canonical_too:
            also = (
                "; it also names a running canonical attempt: pass the RunningAttempt "
                "(awa_sa.attempt_of) to awa_sa.settle to say which"
            )
        else:
            also = "; pass its RunningAttempt (awa_sa.attempt_of) to awa_sa.settle"
        super().__init__(f"(job_id={job_id}, run_lease={run_lease}) names {where}{also}")
        self.job_id = job_id
        self.run_lease = run_lease
        self.schema = schema
        self.canonical_too = canonical_too


class MaterialisedAttempt(ValidationError):
    """The queue-storage attempt was materialised into a ``leases`` row (its handler registered
    a callback) from a compact receipt: its queue claims without a deadline. awa-sa refuses to
    settle it before any statement, as it refuses every compact receipt; nothing was written.

    A running lease whose receipt is a ``lease_claims`` row (a queue with a deadline, awa-pg's
    default) is settled as the runtime ends it (docs/contract.md#materialised). Settle this one
    with awa-pg's callback calls, or let its handler return.
    """

    def __init__(self, job_id: int, run_lease: int, schema: str) -> None:
        super().__init__(
            f"(job_id={job_id}, run_lease={run_lease}) is a callback attempt materialised into "
            f"{schema}.leases from a compact receipt (a queue without a deadline); awa-sa does "
            "not settle those (nothing was written)"
        )
        self.job_id = job_id
        self.run_lease = run_lease
        self.schema = schema


class CompactReceipt(ValidationError):
    """The queue-storage attempt holds a compact receipt (its queue claims without a
    deadline); awa-sa refuses to settle it, and nothing was written.

    A compact receipt is one position of a ``lease_claim_batches`` row. A heartbeat rescue
    whose statement snapshot predates the settle's commit re-reads no row the settle can
    write, so it could close the receipt and run the job again after awa-sa committed
    (docs/contract.md#compact-receipts): no settle from outside Awa is exactly once there.
    ``index`` is the refused item's position in a batch.
    """

    def __init__(
        self, job_id: int, run_lease: int, schema: str, queue: str, index: int | None = None
    ) -> None:
        at = "" if index is None else f"settlements[{index}]: "
        super().__init__(
            f"{at}(job_id={job_id}, run_lease={run_lease}) of queue {queue!r} holds a compact "
            f"receipt in {schema}.lease_claim_batches: its queue claims without a deadline, and "
            "a heartbeat rescue could run it again after awa-sa's commit (nothing was written). "
            "Give the queue a deadline (awa-pg's deadline_duration_ms, default 300 s) to settle "
            "its attempts with awa-sa, or let the handler return"
        )
        self.job_id = job_id
        self.run_lease = run_lease
        self.schema = schema
        self.queue = queue
        self.index = index


class QueueStorageJobs(ValidationError):
    """Routing points at queue storage and awa-sa cannot do this there; nothing was written
    (docs/administer.md).

    On queue storage awa-sa writes what awa-pg's own calls write; the few cases it cannot write
    as awa-pg does (a terminal or unknown job's cancel; a job whose unique mask claims
    ``cancelled`` but not its own state) are refused, each with its reason in
    docs/contract.md#refused; use awa-pg's ``Client`` there.
    """

    def __init__(self, verb: str, schema: str, why: str) -> None:
        super().__init__(
            f"{verb}: routing points at queue storage (schema {schema!r}) and {why} "
            f"(nothing was written): use awa-pg's Client there"
        )
        self.verb = verb
        self.schema = schema
