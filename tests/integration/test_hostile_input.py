"""Hostile input (issue #6), property-based: a correct outcome, or a clear error and no change.

Hypothesis draws delays (non-finite, huge, tiny, negative, not numbers), error and progress
JSON (deep, large, unicode, lone surrogates, U+0000 in strings and keys, NaN, huge integers,
values JSON cannot represent), job ids and leases at and beyond the bigint bounds (with rows
that really have those ids), attempts at the smallint bounds, and queue-storage schema names
coming back from routing (quotes, dots, upper case, 63/64+ characters, blanks, existing and
missing schemas), written into ``storage_transition_state.details`` or the marker row.

For every example, either

* the call succeeds, and the rows read back are what docs/contract.md says (state, attempt, run_at,
  the appended error, the progress; the successor in the right schema), or
* it raises an :class:`awa_sa.AwaSAError` -- a :class:`ValidationError` wherever the input
  alone is at fault -- and a fingerprint of every table is exactly as before.

Each test runs on one clone; examples reset what they touch (the routing rows, the job they
insert) instead of getting a fresh database, since function-scoped fixtures do not reset per
example.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import re
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jobs import advance_sequence, insert_job
from racing import fingerprint

from awa_sa import (
    AwaSAError,
    DatabaseError,
    InvalidSchemaName,
    Migrated,
    Outcome,
    Rescheduled,
    RetryAfter,
    RetryBackoff,
    Snooze,
    Stale,
    ValidationError,
    reschedule_canonical_attempt,
)

SETTINGS = settings(
    max_examples=int(os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=not os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES"),  # reproducible by default
)
BIGINT = 2**63
SMALLINT = 2**15
IDENT = re.compile(r"[a-z_][a-z0-9_]*")
QS_IDS = 5_000_000
_keys = itertools.count()


# --------------------------------------------------------------------------------------------
# Strategies


def nest(depth: int, leaf: Any = "x", as_dict: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_dict else [value]
    return value


class Payload:
    """A JSON-ish value with a short repr: Hypothesis prints failing examples, and a value
    nested 3000 deep or a megabyte long would break or flood that report."""

    def __init__(self, value: Any, label: str | None = None) -> None:
        self.value = value
        self.label = label

    def __repr__(self) -> str:
        return self.label or f"Payload({self.value!r:.120})"


def nested(depth: int, as_dict: bool = False) -> Payload:
    return Payload(nest(depth, as_dict=as_dict), f"nested({depth}, as_dict={as_dict})")


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
_raw_hostile = st.one_of(
    st.none(),
    json_values,
    st.text(max_size=6).map(lambda s: s + "\x00"),  # jsonb cannot store U+0000
    st.text(max_size=6).map(lambda s: {s + "\x00": 1}),
    st.sampled_from(["\ud800", "a\udfffb", {"\udc00": 1}]),  # lone surrogates
    st.sampled_from([math.nan, math.inf, [-math.inf]]),
    st.sampled_from([10**400, -(10**4000)]),
    st.sampled_from([b"bytes", {1, 2}, Decimal("1.5"), dt.datetime(2020, 1, 1), object()]),
    st.sampled_from([(1, "tuple"), {1: "int key"}, {(1, 2): "tuple key"}]),
).map(Payload)
hostile_json = st.one_of(
    _raw_hostile,
    st.builds(nested, st.integers(min_value=1, max_value=3000), st.booleans()),
    st.sampled_from(
        [
            Payload(10**5000, "10**5000"),  # beyond Python's int-to-str limit
            Payload("x" * 1_000_000, "'x' * 1_000_000"),
            Payload(["y" * 1000] * 300, "['y' * 1000] * 300"),
            Payload("ü☃😀" * 1000, "'ü☃😀' * 1000"),
        ]
    ),
)
delays = st.one_of(
    st.floats(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -0.0, 5e-324, 1e-7, 0.5, 86400 * 365.25 * 7000, 1e11, 3e11, -6e10]),
    st.sampled_from([None, "30", True, [1]]),
)


@st.composite
def kinds(draw: st.DrawFn) -> tuple[str, Any]:
    return draw(st.sampled_from(["snooze", "retry_after", "backoff"])), draw(delays)


def build_kind(tag: str, delay: Any) -> Snooze | RetryAfter | RetryBackoff:
    if tag == "snooze":
        return Snooze(delay)
    if tag == "retry_after":
        return RetryAfter(delay)
    return RetryBackoff()


# --------------------------------------------------------------------------------------------
# Checks


def _call(
    engine: sa.Engine, job_id: Any, lease: Any, kind: Any, *, error: Any, progress: Any
) -> Outcome | AwaSAError:
    """The outcome, or the AwaSAError raised -- after checking that nothing changed.

    Anything else raised (a raw driver error, a RecursionError) propagates and fails the test.
    """
    before = fingerprint(engine)
    failure: AwaSAError | None = None
    try:
        return reschedule_canonical_attempt(
            engine, job_id, lease, kind, error=error, progress=progress
        )
    except AwaSAError as exc:
        failure = exc
    assert str(failure)
    assert fingerprint(engine) == before, f"{failure!r} but the database changed"
    return failure


def _json_problem(value: Any) -> bool:
    """Would a faithful encoder have to refuse *value*? (NaN, U+0000, surrogates, ...)."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        return True
    return _has_nul(value)


def _has_nul(value: Any) -> bool:
    """U+0000 in any string or key: walked with an explicit stack, so depth is no problem."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _same_json(conn: sa.Connection, stored: str, value: Any) -> bool:
    """jsonb equality of a stored jsonb expression and the JSON encoding of *value*."""
    return bool(
        conn.execute(
            sa.text(f"SELECT ({stored}) = CAST(:v AS jsonb)"), {"v": json.dumps(value)}
        ).scalar()
    )


def _check_written(
    engine: sa.Engine,
    out: Outcome,
    *,
    job_id: int,
    tag: str,
    delay: Any,
    error: Any,
    progress: Any,
    called_at: dt.datetime,
    schema: str | None,
    check_run_at: bool = True,
) -> None:
    state = "scheduled" if tag == "snooze" else "retryable"
    with engine.connect() as conn:
        if isinstance(out, Rescheduled):
            assert schema is None
            assert out.job_id == job_id
            row = conn.execute(
                sa.text(
                    "SELECT state::text, attempt, run_at, errors, progress IS NULL AS no_progress "
                    "FROM awa.scheduled_jobs WHERE id = :i"
                ),
                {"i": job_id},
            ).one()
            where = f"(SELECT {{}} FROM awa.scheduled_jobs WHERE id = {job_id})"
            error_expr = where.format("errors[array_upper(errors, 1)]")
            progress_expr = where.format("progress")
        else:
            assert isinstance(out, Migrated)
            assert schema is not None
            row = conn.execute(
                sa.text(
                    f"SELECT state::text, attempt, run_at, payload->'errors' AS errors, "
                    f"NOT (coalesce(payload, '{{}}') ? 'progress') AS no_progress "
                    f'FROM "{schema}".deferred_jobs WHERE job_id = :i'
                ),
                {"i": out.job_id},
            ).one()
            where = f'(SELECT {{}} FROM "{schema}".deferred_jobs WHERE job_id = {out.job_id})'
            error_expr = where.format("payload->'errors'->-1")
            progress_expr = where.format("payload->'progress'")
            assert not conn.execute(
                sa.text("SELECT count(*) FROM awa.jobs_hot WHERE id = :i"), {"i": job_id}
            ).scalar()
        assert row.state == state
        assert row.attempt == out.attempt
        assert row.run_at == out.run_at
        after = (row.run_at - called_at).total_seconds()
        if not check_run_at:
            pass
        elif tag == "backoff":
            assert 0 <= after <= 86_400 + 60
        else:
            assert float(delay) - 60 <= after <= float(delay) + 60, (after, delay)
        if error is not None:
            assert _same_json(conn, error_expr, error)
        if progress is None:
            assert row.no_progress
        else:
            assert _same_json(conn, progress_expr, progress)


def _fresh_job(engine: sa.Engine, **kw: Any) -> int:
    with engine.begin() as conn:
        return insert_job(conn, metadata='{"tenant": "acme"}', **kw)


def _set_routing(engine: sa.Engine, where: str | None, name: str | None) -> str | None:
    """Route canonical (``where`` None), or by ``details`` or the marker row, to *name*; return
    what ``awa.active_queue_storage_schema()`` now says."""
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM awa.runtime_storage_backends"))
        if where is None:
            conn.execute(
                sa.text(
                    "UPDATE awa.storage_transition_state SET state = 'canonical', "
                    "current_engine = 'canonical', prepared_engine = NULL, details = '{}'"
                )
            )
        else:
            details = json.dumps({"schema": name}) if where == "details" else "{}"
            conn.execute(
                sa.text(
                    "UPDATE awa.storage_transition_state SET state = 'mixed_transition', "
                    "current_engine = 'canonical', prepared_engine = 'queue_storage', "
                    "details = CAST(:d AS jsonb)"
                ),
                {"d": details},
            )
            if where == "marker":
                conn.execute(
                    sa.text(
                        "INSERT INTO awa.runtime_storage_backends (backend, schema_name) "
                        "VALUES ('queue_storage', :s)"
                    ),
                    {"s": name},
                )
        return conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()


def _has_substrate(engine: sa.Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) = 2 FROM pg_class c JOIN pg_namespace n "
                    "ON n.oid = c.relnamespace WHERE n.nspname = :s "
                    "AND c.relname IN ('deferred_jobs', 'job_id_seq')"
                ),
                {"s": schema},
            ).scalar()
        )


# --------------------------------------------------------------------------------------------
# Properties


@SETTINGS
@given(kind=kinds(), error_p=hostile_json, progress_p=hostile_json, route=st.booleans())
@example(kind=("snooze", 1.0), error_p=Payload("a\x00b"), progress_p=Payload(None), route=False)
@example(kind=("snooze", 1.0), error_p=Payload("\\u0000"), progress_p=Payload(None), route=True)
@example(kind=("snooze", 1.0), error_p=Payload(None), progress_p=Payload("\\\x00"), route=True)
@example(kind=("snooze", 1.0), error_p=Payload(None), progress_p=Payload({"k\x00": 1}), route=True)
@example(kind=("retry_after", 1.0), error_p=nested(5000), progress_p=Payload(None), route=True)
@example(kind=("retry_after", 1.0), error_p=nested(600), progress_p=Payload(None), route=False)
@example(kind=("snooze", math.nan), error_p=Payload(None), progress_p=Payload(None), route=False)
@example(kind=("snooze", 1e300), error_p=Payload(None), progress_p=Payload(None), route=False)
@example(kind=("retry_after", 3e11), error_p=Payload(None), progress_p=Payload(None), route=True)
@example(
    kind=("backoff", None),
    error_p=Payload(10**5000, "10**5000"),
    progress_p=Payload(None),
    route=False,
)
def test_hostile_delays_and_payloads(
    engine: sa.Engine, kind: tuple[str, Any], error_p: Payload, progress_p: Payload, route: bool
) -> None:
    """Canonical routing, or queue storage in ``awa_qs``; the job is a plain running attempt."""
    error, progress = error_p.value, progress_p.value
    tag, delay = kind
    schema = _set_routing(engine, "details" if route else None, "awa_qs")
    try:
        built = build_kind(tag, delay)
    except ValidationError:
        # Only what is not a finite, non-negative number of seconds is refused when the kind
        # is built.
        number = isinstance(delay, int | float) and not isinstance(delay, bool)
        assert not number or not math.isfinite(float(delay)) or delay < 0 or delay > 1e300, delay
        return
    job_id = _fresh_job(engine, attempt=2, run_lease=3)
    with engine.connect() as conn:
        called_at = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    out = _call(engine, job_id, 3, built, error=error, progress=progress)
    if isinstance(out, AwaSAError):
        if _json_problem(error) or _json_problem(progress):
            assert isinstance(out, ValidationError), f"{out!r} for a JSON problem"
        else:
            # The only other refusal: a delay that puts run_at beyond years 1..9999.
            assert isinstance(out, ValidationError), repr(out)
            assert "delay" in str(out), repr(out)
        return
    assert not _json_problem(error), f"accepted bad error {error!r:.80}"
    assert not _json_problem(progress), f"accepted bad progress {progress!r:.80}"
    _check_written(
        engine,
        out,
        job_id=job_id,
        tag=tag,
        delay=delay,
        error=error,
        progress=progress,
        called_at=called_at,
        schema=schema,
    )


ID_EDGES = [0, -1, 1, BIGINT - 1, -BIGINT, SMALLINT, -SMALLINT]
BEYOND = [BIGINT, -BIGINT - 1, 10**30, True, 1.0, "1", None]


@SETTINGS
@given(
    row_id=st.sampled_from(ID_EDGES),
    row_lease=st.sampled_from(ID_EDGES),
    call_id=st.sampled_from(["same", *ID_EDGES, *BEYOND]),
    call_lease=st.sampled_from(["same", *ID_EDGES, *BEYOND]),
    attempt=st.sampled_from([0, 1, 42, 43, 44, 46, SMALLINT - 1, -SMALLINT]),
    tag=st.sampled_from(["snooze", "retry_after", "backoff"]),
    route=st.booleans(),
)
def test_ids_leases_and_attempts_at_the_bounds(
    engine: sa.Engine,
    *,
    row_id: int,
    row_lease: int,
    call_id: Any,
    call_lease: Any,
    attempt: int,
    tag: str,
    route: bool,
) -> None:
    """A row whose id, lease and attempt sit at the bounds; a call whose id and lease match it,
    sit at other bounds, or are not bigints at all.
    """
    schema = _set_routing(engine, "details" if route else None, "awa_qs")
    with engine.begin() as conn:
        last = conn.execute(sa.text("SELECT last_value FROM awa_qs.job_id_seq")).scalar_one()
        if int(last) < QS_IDS:
            advance_sequence(conn, "awa_qs.job_id_seq", QS_IDS)
        # Reset: this example's row is the only one of its kind.
        conn.execute(sa.text("DELETE FROM awa.jobs_hot WHERE kind = 'edge'"))
        conn.execute(sa.text("DELETE FROM awa.scheduled_jobs WHERE kind = 'edge'"))
        conn.execute(
            sa.text(
                "INSERT INTO awa.jobs_hot (id, kind, state, attempt, run_lease, heartbeat_at, "
                "attempted_at) VALUES (:i, 'edge', 'running', :a, :l, now(), now())"
            ),
            {"i": row_id, "a": attempt, "l": row_lease},
        )
    job_id = row_id if call_id == "same" else call_id
    lease = row_lease if call_lease == "same" else call_lease
    with engine.connect() as conn:
        called_at = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    out = _call(engine, job_id, lease, build_kind(tag, 7.0), error={"edge": True}, progress=None)

    bigint = [
        isinstance(v, int) and not isinstance(v, bool) and -BIGINT <= v < BIGINT
        for v in (job_id, lease)
    ]
    if not all(bigint):
        assert isinstance(out, ValidationError), repr(out)
        return
    matches = (job_id, lease) == (row_id, row_lease)
    if not matches:
        assert out == Stale(), repr(out)
        return
    successor_attempt = max(attempt - 1, -SMALLINT) if tag == "snooze" else attempt
    # Backoff is not a dependable 24 h from attempt 43 (docs/contract.md#backoff).
    # On the real v040 function (and the fixture) it is random from 43 on: 2^A s plus the
    # jitter passes int64 microseconds and wraps; the result is "interval/timestamp out of
    # range", or a run_at anywhere -- even BC, which the driver cannot read back (an error
    # without SQLSTATE, raised before the commit).
    # A negative attempt far enough down underflows power(2, A) ("value out of range").
    wild = tag == "backoff" and (attempt >= 43 or attempt < -1074)
    if isinstance(out, AwaSAError):
        assert isinstance(out, DatabaseError), repr(out)
        overflow = out.sqlstate in ("22003", "22008")
        unreadable = out.sqlstate is None and "timestamp too" in str(out)
        assert overflow or (wild and unreadable), repr(out)
        assert successor_attempt < -SMALLINT or wild, repr(out)
        return
    assert successor_attempt >= -SMALLINT
    _check_written(
        engine,
        out,
        job_id=row_id,
        tag=tag,
        delay=7.0,
        error={"edge": True},
        progress=None,
        called_at=called_at,
        schema=schema,
        check_run_at=not wild,
    )


SCHEMA_NAMES = [
    "awa",
    "awa_qs",
    "AWA_QS",
    '"awa_qs"',
    "awa.awa_qs",
    "awa_qs; DROP TABLE awa.jobs_hot",
    "awa qs",
    "",
    " ",
    "\t",
    "é",
    "public",
    "pg_catalog",
    "x" * 63,
    "x" * 64,
    "a" * 200,
    "1abc",
    "_under",
    "awa_qs\\",
    "awa_qs'",
]


@SETTINGS
@given(
    name=st.one_of(
        st.sampled_from(SCHEMA_NAMES), st.text(max_size=70).filter(lambda s: "\x00" not in s)
    ),
    where=st.sampled_from(["details", "marker"]),
    tag=st.sampled_from(["snooze", "retry_after", "backoff"]),
)
def test_hostile_schema_names_from_routing(
    engine: sa.Engine, name: str, where: str, tag: str
) -> None:
    """Whatever routing returns: migrate into a real substrate, InvalidSchemaName for a name
    that is not a plain identifier, a DatabaseError for a plain name without a substrate --
    and in both error cases not a row, claim, mark or lane changed.
    """
    effective = _set_routing(engine, where, name)
    job_id = _fresh_job(
        engine,
        attempt=3,
        run_lease=1,
        unique_key=b"hostile-%d" % next(_keys),
        unique_states="11111000",
    )
    with engine.connect() as conn:
        called_at = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    out = _call(engine, job_id, 1, build_kind(tag, 5.0), error=None, progress={"p": name})
    assert effective is not None
    valid = bool(IDENT.fullmatch(effective)) and len(effective.encode()) <= 63
    if not valid:
        assert isinstance(out, InvalidSchemaName), repr(out)
    elif not _has_substrate(engine, effective):
        assert isinstance(out, DatabaseError), repr(out)
    else:
        assert isinstance(out, Migrated), repr(out)
        _check_written(
            engine,
            out,
            job_id=job_id,
            tag=tag,
            delay=5.0,
            error=None,
            progress={"p": name},
            called_at=called_at,
            schema=effective,
        )


def _deepest_encodable() -> int:
    """The deepest nested list ``json.dumps`` can encode from this stack depth."""
    deepest = 0
    for depth in range(10, 5000, 10):
        try:
            json.dumps(nest(depth))
        except RecursionError:
            break
        deepest = depth
    return deepest


def test_json_nested_just_below_the_encoder_limit(engine: sa.Engine) -> None:
    """Valid JSON that ``json.dumps`` encodes, nested deeper than a recursive walk of it can go.

    Either a correct outcome (it is valid JSON, and jsonb stores it) or a ValidationError --
    never a raw RecursionError from the U+0000 check that runs after the encoding.
    """
    depth = _deepest_encodable() - 30  # a little room for the library's own frames
    assert depth > 100
    for value in (nest(depth), nest(depth // 2, as_dict=True)):
        job_id = _fresh_job(engine, attempt=2, run_lease=3)
        with engine.connect() as conn:
            called_at = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        out = _call(engine, job_id, 3, RetryAfter(1.0), error=value, progress=None)
        if isinstance(out, AwaSAError):
            assert isinstance(out, ValidationError), repr(out)
            continue
        _check_written(
            engine,
            out,
            job_id=job_id,
            tag="retry_after",
            delay=1.0,
            error=value,
            progress=None,
            called_at=called_at,
            schema=None,
        )
