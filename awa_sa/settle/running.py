"""Where ``(job_id, run_lease)`` come from: the running attempts of both storage planes.

A reschedule needs the pair a claim left. An Awa worker's handler knows its job's id and
attempt but not the lease (awa-pg's ``Job`` does not expose it); an admin tool knows neither.
Both read it here, from the rows the claim wrote.

During and after a storage transition a cluster has two planes, and their ids collide:
canonical jobs draw ids from ``awa.jobs_id_seq``, queue-storage jobs from ``<qs>.job_id_seq``,
both starting at 1, and both planes start ``run_lease`` at 1. ``(job_id, run_lease)`` alone can
therefore name two running attempts at once, so every attempt listed here names its plane
(``storage``) and, on queue storage, the receipt that identifies its claim exactly.

* **Canonical**: a ``running`` row of ``awa.jobs_hot``.
* **Queue storage** (the routing schema, once routing is queue storage): an open receipt. A
  claim on a queue with a deadline writes one ``lease_claims`` row; on a queue without one it
  writes one position of a compact ``lease_claim_batches`` row. A receipt is open while no
  closure evidence names it: no ``lease_claim_closures`` row, no ``lease_claim_closure_batches``
  range holding its ``receipt_id``, no ``closed_at``, and no ``done_entries``,
  ``deferred_jobs`` or ``dlq_entries`` row under its ``(job_id, run_lease)`` (this is how Awa's
  own runtime enumerates running receipts). A receipt that ``register_callback`` materialised
  into ``leases`` is listed from its ``leases`` row while that row is ``running`` (its handler
  is still running: the same attempt a canonical ``jobs_hot`` row with a callback id is), and
  not once it is ``waiting_external``. Kind, args and created_at come from the job's
  ``ready_entries`` row, which a claim leaves as it was; the heartbeat from ``attempt_state``,
  falling back to the claim time as Awa's rescue does.

The statements are :mod:`awa_sa.settle.statements.listings`'s: built once, every filter a parameter
(NULL: no filter), the queue-storage one reaching its schema only through
``schema_translate_map``, and reading only the job's receipts when ``job_id`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timedelta
from typing import Any, Protocol
from weakref import WeakKeyDictionary

from sqlalchemy import Connection, Engine

from awa_sa.core.compiled import execute
from awa_sa.core.driver_errors import translated
from awa_sa.core.errors import AmbiguousAttempt, AttemptNotFound, ValidationError
from awa_sa.settle.statements.job_receipts import LOOKUP_BINDS, claim_of_job
from awa_sa.settle.statements.listings import (
    DEFAULT_SCHEMA,
    CanonicalListing,
    Filters,
    Listed,
    LookupReads,
    attempt_lookup,
    canonical_attempts,
    filter_binds,
    listed,
    queue_storage_attempts,
)
from awa_sa.tables.queue_storage import translate_map

CANONICAL = "canonical"
"""``RunningAttempt.storage`` of an attempt in ``awa.jobs_hot``."""


@dataclass(frozen=True, slots=True)
class RunningAttempt:
    """One running attempt, as a reschedule, a settle and an admin screen need it.

    ``storage`` is the plane that holds it: :data:`CANONICAL`, or the name of the
    queue-storage schema. The claim is ``(job_id, run_lease)`` within that plane; on queue
    storage ``claim_slot`` and ``receipt_id`` name its receipt (``receipt_id`` is unique in
    the schema), and a compact receipt also has ``claim_batch_id`` and ``claim_batch_index``
    (its 1-based position in the ``lease_claim_batches`` row): such an attempt is listed, and
    ``settle`` refuses it (``CompactReceipt``). All four are None on the canonical plane, and
    for a materialised lease whose receipt was a compact one (a lease is matched to its receipt
    through ``lease_claims`` only).
    """

    job_id: int
    run_lease: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    attempted_at: datetime
    """When the claim was made (database clock)."""
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    running_for: timedelta
    """``now() - attempted_at`` on the database's clock, as of the query."""
    storage: str
    created_at: datetime
    """When the job was enqueued: with ``job_id``, ``kind`` and ``queue`` it tells two planes'
    jobs apart even where their ids and leases collide."""
    args: Any
    claim_slot: int | None = None
    receipt_id: int | None = None
    claim_batch_id: int | None = None
    claim_batch_index: int | None = None
    _ready_slot: int | None = dataclass_field(default=None, repr=False, compare=False)
    """Private: the receipt's ready slot, where :func:`attempt_of` found it, so that the settle
    reads only that slot's partitions; None otherwise (the settle then finds it itself)."""

    @property
    def on_queue_storage(self) -> bool:
        """Whether the attempt is a queue-storage receipt (settled in its schema)."""
        return self.storage != CANONICAL


class JobLike(Protocol):
    """What :func:`attempt_of` reads from a job: awa-pg's ``Job`` has all of it."""

    @property
    def id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def created_at(self) -> str | datetime: ...


def _attempt(row: Listed, storage: str) -> RunningAttempt:
    return RunningAttempt(storage=storage, **row._asdict())


def _read(conn: Connection, filters: Filters, *, own: bool) -> list[RunningAttempt]:
    # Core execution, not awa_sa.core.compiled: these reads want SQLAlchemy's result processing
    # (JSON args, intervals) alike on every driver.
    binds = filter_binds(filters)
    listing = CanonicalListing.read(conn.execute(canonical_attempts(), binds).all())
    found = [_attempt(row, CANONICAL) for row in listing.attempts]
    if listing.routing is None:
        return found
    return _receipts(conn, filters, listing.routing, found, own=own)


def _receipts(
    conn: Connection,
    filters: Filters,
    routing: str,
    found: list[RunningAttempt],
    *,
    own: bool,
    lookup: bool = False,
) -> list[RunningAttempt]:
    """*found* and the open receipts of the routing schema that match *filters*: with *lookup*
    (``attempt_of``) the job's ``lease_claims`` receipt by its identity first."""
    binds = filter_binds(filters)
    options = {"schema_translate_map": translate_map(routing)}
    if lookup:
        # The job's open lease_claims receipt by its identity (a plan of few partitions, flat
        # with history); a compact or materialised receipt, or none, by the listing below.
        rows = conn.execute(claim_of_job(), _lookup_binds(filters), execution_options=options)
        claims = rows.all()
        if claims:
            found += [_claim(row, routing) for row in claims]
            return _ordered(found, filters)
    if own and filters.job_id is None:
        # In our own transaction only: the estimate of listing every receipt is large enough
        # for PostgreSQL to JIT-compile the plan, a third of a second on a fresh cluster.
        conn.exec_driver_sql("SET LOCAL jit = off")
    statement = queue_storage_attempts(by_job=filters.job_id is not None)
    receipts = listed(conn.execute(statement, binds, execution_options=options).all())
    found += [_attempt(row, routing) for row in receipts]
    return _ordered(found, filters)


def _lookup_binds(filters: Filters) -> dict[str, Any]:
    binds = filter_binds(filters)
    return {name: binds[f"f_{name[2:]}"] for name in LOOKUP_BINDS}


def _look_up(conn: Connection, filters: Filters) -> list[RunningAttempt]:
    """``attempt_of``'s reads (:func:`look_up`)."""
    return look_up(conn, filters)[0]


def look_up(
    conn: Connection, filters: Filters, *, lock: bool = False
) -> tuple[list[RunningAttempt], bool]:
    """``attempt_of``'s reads: one statement (:func:`attempt_lookup`) when routing is canonical
    or names :data:`DEFAULT_SCHEMA` and the job's receipt there is a ``lease_claims`` row; the
    routing schema's reads after it otherwise. With *lock*, that receipt is locked as the
    settle's lock statement locks it; the answer says whether it was.

    The statement carries the receipt leg only where the engine's last lookup found routing
    not canonical (:data:`_receipts_expected`): a lookup without it that finds routing moved
    asks again with it, one round trip more, once per engine and transition.
    """
    binds = {**_lookup_binds(filters), "b_schema": DEFAULT_SCHEMA}
    engine = conn.engine
    with_receipts: LookupReads = "locked" if lock else "receipts"
    expected = _receipts_expected.get(engine, True)
    rows = execute(
        conn,
        attempt_lookup(reads=with_receipts if expected else "canonical"),
        binds,
        DEFAULT_SCHEMA,
    )
    routing: str | None = rows[0].routing
    if (routing is not None) != expected:
        _receipts_expected[engine] = routing is not None
        if not expected:
            rows = execute(conn, attempt_lookup(reads=with_receipts), binds, DEFAULT_SCHEMA)
            routing = rows[0].routing
    canonical = [_claim(row, CANONICAL) for row in rows if row.on_queue_storage is False]
    if routing is None:
        return _ordered(canonical, filters), False
    claims = [_claim(row, routing) for row in rows if row.on_queue_storage]
    if claims:  # only ever read in DEFAULT_SCHEMA, and only while routing names it
        return _ordered(canonical + claims, filters), lock
    # Another schema: its lookup, then its listing; DEFAULT_SCHEMA, looked up already: its listing.
    lookup = routing != DEFAULT_SCHEMA
    return _receipts(conn, filters, routing, canonical, own=False, lookup=lookup), False


_receipts_expected: WeakKeyDictionary[Engine, bool] = WeakKeyDictionary()
"""Per engine: did its last lookup find routing other than canonical? Unknown: assumed so. A
stale answer costs a round trip, never a wrong one: routing is read in the statement itself."""


def routing_seen_canonical(engine: Engine) -> bool:
    """Did *engine*'s last lookup find routing canonical? (:data:`_receipts_expected`)"""
    return not _receipts_expected.get(engine, True)


def _claim(row: Any, storage: str) -> RunningAttempt:
    fields = {name: getattr(row, name) for name in Listed._fields}
    return RunningAttempt(storage=storage, **fields, _ready_slot=row.ready_slot)


def _ordered(found: list[RunningAttempt], filters: Filters) -> list[RunningAttempt]:
    found.sort(key=lambda a: (a.attempted_at, a.job_id, a.on_queue_storage))
    return found if filters.limit is None else found[: filters.limit]


def _list(
    bind: Engine | Connection, filters: Filters, *, job: bool = False
) -> list[RunningAttempt]:
    with translated():
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                return _look_up(conn, filters) if job else _read(conn, filters, own=True)
        return _look_up(bind, filters) if job else _read(bind, filters, own=False)


def running_attempts(
    bind: Engine | Connection,
    *,
    queue: str | None = None,
    kind: str | None = None,
    running_for: timedelta | None = None,
    job_id: int | None = None,
    attempt: int | None = None,
    limit: int | None = None,
) -> list[RunningAttempt]:
    """The running attempts of both planes that match every filter given, oldest claim first.

    ``running_for`` keeps the attempts claimed at least that long ago. ``job_id`` with
    ``attempt`` narrows to one job's current claim *per plane*: during a transition the same
    pair can name a canonical and a queue-storage attempt, both listed, each with its
    ``storage``; a handler should use :func:`attempt_of`, which matches its job exactly.

    Round trips: one on a cluster whose routing is canonical (the attempts of ``awa.jobs_hot``
    and the routing schema in one statement), two once routing is queue storage (then the
    open receipts of the routing schema), and with an ``Engine`` and no ``job_id`` one more
    before those: ``SET LOCAL jit = off`` in its own transaction, since PostgreSQL would
    JIT-compile the listing of every receipt (a third of a second on a fresh cluster). A
    ``Connection`` reads in its transaction; an ``Engine`` opens one connection for the reads.
    From async code: :func:`awa_sa.asyncio.running_attempts`.
    """
    filters = Filters(queue, kind, running_for, job_id, attempt, None, limit)
    return _list(bind, filters)


def _created_at(job: Any) -> datetime:
    """The job's ``created_at`` as a datetime: awa-pg gives RFC 3339 text, lossless to the µs."""
    value = getattr(job, "created_at", None)
    if isinstance(value, datetime):
        stamp = value
    elif isinstance(value, str):
        try:
            stamp = datetime.fromisoformat(value)
        except ValueError:
            raise ValidationError(f"job.created_at is not an RFC 3339 time: {value!r}") from None
    else:
        raise ValidationError(f"job.created_at must be a datetime or RFC 3339 text: {value!r}")
    if stamp.tzinfo is None:
        raise ValidationError(f"job.created_at has no time zone: {value!r}")
    return stamp


def job_filters(job: Any) -> Filters:
    """The filters that name *job*'s claim: every attribute a handler's job carries."""
    values: dict[str, Any] = {}
    for name, field, type_ in (
        ("id", "job_id", int),
        ("attempt", "attempt", int),
        ("kind", "kind", str),
        ("queue", "queue", str),
    ):
        value = getattr(job, name, None)
        if not isinstance(value, type_) or isinstance(value, bool):
            raise ValidationError(f"job.{name} must be {type_.__name__}: {value!r}")
        values[field] = value
    return Filters(**values, created_at=_created_at(job))


def attempt_of(bind: Engine | Connection, job: JobLike | Any) -> RunningAttempt:
    """The running attempt that is *job*'s current claim, in whichever plane holds it.

    *job* is the awa-pg ``Job`` a handler received, or any object with its ``id``,
    ``attempt``, ``kind``, ``queue`` and ``created_at`` (RFC 3339 text or an aware datetime).
    Every one of them must match: during a storage transition a canonical and a
    queue-storage job can share ``id`` and ``attempt`` (and their leases), and only kind,
    queue and the enqueue time tell them apart.

    Raises :class:`AttemptNotFound` when nothing running matches (the claim was settled,
    rescued or re-claimed since), :class:`AmbiguousAttempt` when more than one does, and
    :class:`ValidationError` for a job lacking those attributes. One round trip while routing
    is canonical or names :data:`~awa_sa.settle.statements.listings.DEFAULT_SCHEMA` and the job's
    receipt is a ``lease_claims`` row (``attempt_lookup``: routing, the job's canonical row and
    that receipt, in one snapshot; one more, once, when an engine first finds routing moved off
    canonical); in another routing schema a second, the same receipt lookup there
    (``claim_of_job``). The lookup finds the job's open receipt by its whole identity,
    reading only the receipt's own slots, flat as finished jobs accumulate: closed as the
    runtime's fast completion fences it, by ``closed_at``, a closure or a closure batch (the
    settle checks every kind of evidence again under the receipt's lock). A compact or
    materialised receipt, or none, is then read as :func:`running_attempts` reads it, in one
    more. From async code:
    :func:`awa_sa.asyncio.attempt_of`.
    """
    filters = job_filters(job)
    found = _list(bind, filters, job=True)
    assert filters.job_id is not None  # job_filters sets both
    assert filters.attempt is not None
    if not found:
        raise AttemptNotFound(filters.job_id, filters.attempt)
    if len(found) > 1:
        raise AmbiguousAttempt(filters.job_id, filters.attempt, found)
    return found[0]
