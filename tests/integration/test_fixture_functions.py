"""The fixture's hand-written functions and triggers behave like Awa's, observed on real rows.

Most tests run twice, on the Alembic fixture and on a database built by awa-cli 0.6.9 (the
``conn`` and ``any_engine`` params): the fixture's bodies were written from prose, so the only
convincing check is the same assertion passing against Awa's own functions.

``conn`` is one transaction on a clone shared by the whole module and rolled back after each
test. PostgreSQL DDL is transactional (lane sequences created by a test vanish with it), so every
test still starts from the template's state without paying for a clone of its own. Tests whose
point is what other sessions see after a commit use ``any_engine``, a fresh clone per test.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import sqlalchemy as sa
from catalog_facts import (
    cloned_database,
    expected_objects,
    live_objects,
    load_catalog,
    object_diff,
)

import awa_sa_schema

ROOT = Path(__file__).resolve().parents[2]
KEY = b"unique-key-1"
DEFAULT_MASK = "11111000"  # scheduled, available, running, completed, retryable


TEMPLATES = {"fixture": "fixture_template", "awa_cli": "real_template"}


class _SharedClones:
    """One clone per template for the module, made on first use (so -k fixture never runs awa)."""

    def __init__(self, request: pytest.FixtureRequest, stack: ExitStack) -> None:
        self._request = request
        self._stack = stack
        self._engines: dict[str, sa.Engine] = {}

    def engine(self, kind: str) -> sa.Engine:
        if kind not in self._engines:
            template = self._request.getfixturevalue(TEMPLATES[kind])
            pg = self._request.getfixturevalue("pg")
            self._engines[kind] = self._stack.enter_context(cloned_database(pg, template))
        return self._engines[kind]


@pytest.fixture(scope="module")
def shared_clones(request: pytest.FixtureRequest) -> Iterator[_SharedClones]:
    with ExitStack() as stack:
        yield _SharedClones(request, stack)


def _rolled_back(engine: sa.Engine) -> Iterator[sa.Connection]:
    with engine.connect() as connection:
        connection.begin()
        try:
            yield connection
        finally:
            connection.rollback()


@pytest.fixture(params=list(TEMPLATES))
def conn(request: pytest.FixtureRequest, shared_clones: _SharedClones) -> Iterator[sa.Connection]:
    yield from _rolled_back(shared_clones.engine(request.param))


@pytest.fixture
def fixture_conn(shared_clones: _SharedClones) -> Iterator[sa.Connection]:
    yield from _rolled_back(shared_clones.engine("fixture"))


@pytest.fixture(params=list(TEMPLATES))
def any_engine(request: pytest.FixtureRequest) -> sa.Engine:
    engine: sa.Engine = request.getfixturevalue(
        "engine" if request.param == "fixture" else "real_engine"
    )
    return engine


def _sqlstate(error: pytest.ExceptionInfo[sa.exc.DBAPIError]) -> str:
    return str(getattr(error.value.orig, "sqlstate", ""))


def _constraint(error: pytest.ExceptionInfo[sa.exc.DBAPIError]) -> str | None:
    diag = getattr(error.value.orig, "diag", None)
    return getattr(diag, "constraint_name", None)


# ------------------------------------------------------------------ awa.backoff_duration

_BACKOFF = "awa.backoff_duration(CAST(:a AS smallint), CAST(:m AS smallint))"


def _backoff_seconds(conn: sa.Connection, attempt: int, samples: int) -> list[float]:
    return list(
        conn.execute(
            sa.text(
                f"SELECT CAST(extract(epoch FROM {_BACKOFF}) AS float8) FROM generate_series(1, :n)"
            ),
            {"a": attempt, "m": 25, "n": samples},
        ).scalars()
    )


@pytest.mark.parametrize("attempt", [0, 1, 2, 10, 16])
def test_backoff_is_two_to_the_attempt_plus_up_to_a_quarter_jitter(
    conn: sa.Connection, attempt: int
) -> None:
    base = 2.0**attempt
    values = _backoff_seconds(conn, attempt, 2000)
    # make_interval keeps microseconds: a jitter just under the quarter rounds up to all of it.
    assert all(base <= v <= 1.25 * base for v in values)
    # The jitter really is random over the whole quarter, not a constant.
    assert min(values) < base * 1.02
    assert max(values) > base * 1.23
    assert len(set(values)) > 1900


def test_backoff_ignores_max_attempts(conn: sa.Connection) -> None:
    for max_attempts in (1, 1000, 0, -5):
        value = conn.execute(
            sa.text(f"SELECT CAST(extract(epoch FROM {_BACKOFF}) AS float8)"),
            {"a": 3, "m": max_attempts},
        ).scalar_one()
        assert 8 <= value < 10


@pytest.mark.parametrize("attempt", range(17, 43))
def test_backoff_is_capped_at_exactly_a_day(conn: sa.Connection, attempt: int) -> None:
    values = conn.execute(
        sa.text(f"SELECT DISTINCT {_BACKOFF} FROM generate_series(1, 200)"),
        {"a": attempt, "m": 25},
    ).scalars()
    assert list(values) == [dt.timedelta(hours=24)]


def _sample_outcomes(conn: sa.Connection, sql: str, attempt: int, samples: int) -> Counter[str]:
    """Run *sql* repeatedly, each in a savepoint, and count values and SQLSTATEs."""
    outcomes: Counter[str] = Counter()
    for _ in range(samples):
        try:
            with conn.begin_nested():
                value = conn.execute(sa.text(sql), {"a": attempt, "m": 25}).scalar_one()
        except sa.exc.DBAPIError as exc:
            outcomes[f"{getattr(exc.orig, 'sqlstate', '')} {str(exc.orig).splitlines()[0]}"] += 1
            continue
        if value == dt.timedelta(hours=24):
            outcomes["24:00:00"] += 1
        elif value < dt.timedelta(0):
            outcomes["negative"] += 1
        else:
            outcomes[f"other {value}"] += 1
    return outcomes


INTERVAL_OUT_OF_RANGE = "22008 interval out of range"


def test_backoff_at_43_overflows_unless_the_jitter_is_small(conn: sa.Connection) -> None:
    """Attempt 43 is not a dependable 24:00:00 (docs/contract.md#observed).

    On PostgreSQL 15.18/x86-64 (awa-cli's own function included) 2^43 s plus a jitter above a
    few percent overflows the interval sum, so most calls fail and the rest are capped.
    """
    outcomes = _sample_outcomes(conn, f"SELECT {_BACKOFF}", 43, 150)
    assert set(outcomes) <= {"24:00:00", INTERVAL_OUT_OF_RANGE}
    assert outcomes[INTERVAL_OUT_OF_RANGE] > 0


@pytest.mark.parametrize("attempt", [44, 45])
def test_backoff_at_44_and_45_is_negative_and_unusable(conn: sa.Connection, attempt: int) -> None:
    assert _sample_outcomes(conn, f"SELECT {_BACKOFF}", attempt, 50) == {"negative": 50}
    with pytest.raises(sa.exc.DataError) as error:
        conn.execute(sa.text(f"SELECT now() + {_BACKOFF}"), {"a": attempt, "m": 25})
    assert _sqlstate(error) == "22008"
    assert "timestamp out of range" in str(error.value)


@pytest.mark.parametrize("attempt", [46, 47, 100, 1023])
def test_backoff_beyond_45_is_never_a_usable_interval(conn: sa.Connection, attempt: int) -> None:
    outcomes = _sample_outcomes(conn, f"SELECT {_BACKOFF}", attempt, 60)
    assert set(outcomes) <= {"negative", INTERVAL_OUT_OF_RANGE}


@pytest.mark.parametrize("attempt", [1024, 32767])
def test_backoff_from_1024_overflows_float(conn: sa.Connection, attempt: int) -> None:
    with pytest.raises(sa.exc.DataError) as error:
        conn.execute(sa.text(f"SELECT {_BACKOFF}"), {"a": attempt, "m": 25})
    assert _sqlstate(error) == "22003"
    assert "value out of range: overflow" in str(error.value)


def test_backoff_of_null_is_the_cap(conn: sa.Connection) -> None:
    value = conn.execute(
        sa.text("SELECT awa.backoff_duration(NULL, CAST(25 AS smallint))")
    ).scalar_one()
    assert value == dt.timedelta(hours=24)


def test_backoff_needs_smallint_arguments(conn: sa.Connection) -> None:
    with pytest.raises(sa.exc.ProgrammingError) as error:
        conn.execute(sa.text("SELECT awa.backoff_duration(3, 25)"))
    assert _sqlstate(error) == "42883"


# ------------------------------------------------------------------------------ routing


def _routing(conn: sa.Connection) -> tuple[str | None, str | None]:
    row = conn.execute(
        sa.text("SELECT awa.active_storage_engine(), awa.active_queue_storage_schema()")
    ).one()
    return row[0], row[1]


def _transition_row(conn: sa.Connection) -> dict[str, Any]:
    row = conn.execute(sa.text("SELECT * FROM awa.storage_transition_state")).one()
    return dict(row._mapping)


def _markers(conn: sa.Connection) -> list[tuple[str, str, dt.datetime]]:
    rows = conn.execute(sa.text("SELECT * FROM awa.runtime_storage_backends ORDER BY backend"))
    return [(r.backend, r.schema_name, r.updated_at) for r in rows]


class Phase(NamedTuple):
    current_engine: str
    prepared_engine: str | None
    state: str
    epoch: int
    names_schema: bool  # details = {"schema": S}, else {}
    finalized: bool
    marker: bool  # runtime_storage_backends('queue_storage', S)
    active_engine: str
    routes: bool  # active_queue_storage_schema() = S, else NULL


C, QS = "canonical", "queue_storage"
PHASE_ROWS = {
    "canonical": Phase(C, None, C, 0, False, False, False, C, False),
    "prepared": Phase(C, QS, "prepared", 1, True, False, False, C, False),
    "mixed_transition": Phase(C, QS, "mixed_transition", 2, True, False, True, QS, True),
    "active": Phase(QS, None, "active", 3, True, True, True, QS, True),
    # From a fresh (epoch 0) cluster: one step up, as an abort always is.
    "aborted": Phase(C, None, C, 1, False, False, False, C, False),
}


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
@pytest.mark.parametrize("phase", list(PHASE_ROWS))
def test_set_phase_writes_the_observed_rows(conn: sa.Connection, phase: str, schema: str) -> None:
    expected = PHASE_ROWS[phase]
    awa_sa_schema.set_phase(conn, phase, schema)
    now = conn.execute(sa.text("SELECT now()")).scalar_one()
    assert _transition_row(conn) == {
        "singleton": True,
        "current_engine": expected.current_engine,
        "prepared_engine": expected.prepared_engine,
        "state": expected.state,
        "transition_epoch": expected.epoch,
        "details": {"schema": schema} if expected.names_schema else {},
        "entered_at": now,
        "updated_at": now,
        "finalized_at": now if expected.finalized else None,
    }
    assert _markers(conn) == ([(QS, schema, now)] if expected.marker else [])
    assert _routing(conn) == (expected.active_engine, schema if expected.routes else None)


def test_phases_in_sequence_count_epochs_like_the_cli(conn: sa.Connection) -> None:
    """prepare -> mixed -> abort on a fresh cluster ends at epoch 3, as catalog phase 4 shows."""
    catalog = load_catalog()["transition_phases_observed_with_cli"]
    for phase, observed in [
        ("prepared", "2_after_prepare_default_details"),
        ("mixed_transition", "3_after_enter_mixed_transition"),
        ("aborted", "4_after_abort_from_mixed_transition"),
    ]:
        awa_sa_schema.set_phase(conn, phase, "awa")  # `prepare` without details: Awa's default
        expected = catalog[observed]
        row = _transition_row(conn)
        for column in ("current_engine", "prepared_engine", "state", "details"):
            assert row[column] == expected["storage_transition_state"][column]
        assert row["transition_epoch"] == expected["storage_transition_state"]["transition_epoch"]
        assert [(b, s) for b, s, _ in _markers(conn)] == [
            (m["backend"], m["schema_name"]) for m in expected["runtime_storage_backends"]
        ]
        assert _routing(conn) == (
            expected["active_storage_engine"],
            expected["active_queue_storage_schema"],
        )


def test_set_phase_refuses_what_cannot_route(fixture_conn: sa.Connection) -> None:
    conn = fixture_conn
    for phase in ("mixed_transition", "active"):
        with pytest.raises(ValueError, match="no queue-storage substrate"):
            awa_sa_schema.set_phase(conn, phase, "not_installed")
    with pytest.raises(ValueError, match="invalid queue-storage schema name"):
        awa_sa_schema.set_phase(conn, "prepared", "Bad-Name")
    with pytest.raises(ValueError, match="unknown phase"):
        awa_sa_schema.set_phase(conn, "finalized", "awa_qs")
    assert _transition_row(conn)["transition_epoch"] == 0  # nothing was written
    # prepared only records a name; the CLI does not check it either.
    awa_sa_schema.set_phase(conn, "prepared", "not_installed")
    awa_sa_schema.set_phase(conn, "active", "awa_qs")
    with pytest.raises(ValueError, match="cannot abort from state 'active'"):
        awa_sa_schema.set_phase(conn, "aborted", "awa_qs")
    assert _routing(conn) == (QS, "awa_qs")


def test_set_phase_recreates_a_deleted_singleton(fixture_conn: sa.Connection) -> None:
    fixture_conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
    with pytest.raises(ValueError, match="cannot abort from no singleton row"):
        awa_sa_schema.set_phase(fixture_conn, "aborted", "awa_qs")
    awa_sa_schema.set_phase(fixture_conn, "mixed_transition", "awa_qs")
    assert _routing(fixture_conn) == (QS, "awa_qs")


def test_set_phase_can_route_to_a_substrate_added_later(fixture_conn: sa.Connection) -> None:
    with pytest.raises(ValueError, match="no queue-storage substrate"):
        awa_sa_schema.set_phase(fixture_conn, "mixed_transition", "late")
    awa_sa_schema.install_queue_storage(fixture_conn, "late")
    awa_sa_schema.set_phase(fixture_conn, "mixed_transition", "late")
    assert _routing(fixture_conn) == (QS, "late")


def _set_rows(conn: sa.Connection, assignments: str, marker: str | None) -> None:
    conn.execute(sa.text(f"UPDATE awa.storage_transition_state SET {assignments} WHERE singleton"))
    conn.execute(sa.text("DELETE FROM awa.runtime_storage_backends"))
    if marker is not None:
        conn.execute(
            sa.text("INSERT INTO awa.runtime_storage_backends VALUES ('queue_storage', :s)"),
            {"s": marker},
        )


MIXED = "state = 'mixed_transition', prepared_engine = 'queue_storage'"


@pytest.mark.parametrize(
    ("assignments", "marker", "expected"),
    [
        pytest.param(
            f"{MIXED}, details = '{{}}'",
            "awa_qs",
            ("queue_storage", "awa_qs"),
            id="marker-fallback",
        ),
        pytest.param(
            f"""{MIXED}, details = '{{"schema": ""}}'""",
            None,
            ("queue_storage", "awa"),
            id="blank-details-last-fallback",
        ),
        pytest.param(
            "current_engine = 'queue_storage'",
            None,
            ("queue_storage", "awa"),
            id="canonical-state-queue-storage-engine",
        ),
        pytest.param(
            """current_engine = 'queue_storage', details = '{"schema": "awa_qs"}'""",
            None,
            ("queue_storage", "awa_qs"),
            id="canonical-state-details-schema",
        ),
        pytest.param(
            f"""{MIXED}, details = '{{"schema": "awa_qs"}}'""",
            "awa",
            ("queue_storage", "awa_qs"),
            id="details-beat-marker",
        ),
        pytest.param(
            "state = 'mixed_transition', prepared_engine = '  ', details = '{}'",
            "awa_qs",
            ("canonical", None),
            id="blank-prepared-engine",
        ),
        pytest.param(
            "state = 'mixed_transition', current_engine = 'queue_storage', "
            "prepared_engine = '  ', details = '{}'",
            "awa_qs",
            ("canonical", None),
            id="blank-prepared-engine-hides-current-engine",
        ),
        pytest.param(
            f"""{MIXED}, details = '{{"schema": "  "}}'""",
            None,
            ("queue_storage", "  "),
            id="whitespace-schema-is-not-blank",
        ),
        pytest.param(
            f"{MIXED}, details = '{{}}'", "", ("queue_storage", ""), id="empty-marker-taken-as-is"
        ),
        pytest.param(
            "state = 'prepared', prepared_engine = 'queue_storage', details = '{}'",
            "awa_qs",
            ("canonical", None),
            id="prepared-does-not-flip",
        ),
    ],
)
def test_routing_edge_cases(
    conn: sa.Connection, assignments: str, marker: str | None, expected: tuple[str, str | None]
) -> None:
    _set_rows(conn, assignments, marker)
    assert _routing(conn) == expected


def test_routing_without_a_singleton_is_canonical(conn: sa.Connection) -> None:
    conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
    conn.execute(
        sa.text("INSERT INTO awa.runtime_storage_backends VALUES ('queue_storage', 'awa')")
    )
    assert _routing(conn) == ("canonical", None)
    locked = conn.execute(
        sa.text(
            "SELECT awa.active_queue_storage_schema() FROM awa.storage_transition_state "
            "WHERE singleton FOR SHARE"
        )
    ).all()
    assert locked == []


ONE_STATEMENT_READ = (
    "SELECT awa.active_queue_storage_schema() FROM awa.storage_transition_state "
    "WHERE singleton FOR SHARE"
)


def _wait_until_blocked(engine: sa.Engine, pid: int) -> None:
    with engine.connect() as observer:
        for _ in range(500):
            waiting = observer.execute(
                sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).scalar()
            if waiting == "Lock":
                return
            observer.rollback()
            time.sleep(0.01)
    pytest.fail(f"backend {pid} never waited for the singleton lock")


def test_a_read_that_waited_for_an_abort_sees_its_older_snapshot(any_engine: sa.Engine) -> None:
    """STABLE plpgsql reads with the statement's snapshot, taken before the lock wait, so the
    one-statement form still routes to the schema the abort deactivated; the two-statement form
    (lock, then read) sees the committed abort (docs/contract.md#routing-read)."""
    with any_engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
    with any_engine.connect() as aborter, any_engine.connect() as reader:
        pid = int(reader.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        reader.rollback()
        awa_sa_schema.set_phase(aborter, "aborted", "awa_qs")  # holds the singleton FOR UPDATE
        with ThreadPoolExecutor(max_workers=1) as pool:
            one_statement = pool.submit(
                lambda: reader.execute(sa.text(ONE_STATEMENT_READ)).scalar_one()
            )
            _wait_until_blocked(any_engine, pid)
            aborter.commit()
            assert one_statement.result(timeout=30) == "awa_qs"
        reader.rollback()
        with any_engine.begin() as conn:
            awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
        awa_sa_schema.set_phase(aborter, "aborted", "awa_qs")
        with ThreadPoolExecutor(max_workers=1) as pool:
            two_statements = pool.submit(
                lambda: (
                    reader.execute(
                        sa.text(
                            "SELECT 1 FROM awa.storage_transition_state WHERE singleton FOR SHARE"
                        )
                    ).all(),
                    reader.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar(),
                )
            )
            _wait_until_blocked(any_engine, pid)
            aborter.commit()
            assert two_statements.result(timeout=30) == ([(1,)], None)
        reader.rollback()


# -------------------------------------------------------------------------- unique claims


def _insert_job(
    conn: sa.Connection,
    *,
    table: str = "awa.jobs_hot",
    state: str = "available",
    key: bytes | None = KEY,
    mask: str | None = DEFAULT_MASK,
    job_id: int | None = None,
    queue: str = "default",
    kind: str = "k",
) -> int:
    explicit_id = job_id is not None
    columns = "kind, queue, state, unique_key, unique_states" + (", id" if explicit_id else "")
    values = ":kind, :queue, CAST(:state AS awa.job_state), :key, CAST(:mask AS bit(8))" + (
        ", :id" if explicit_id else ""
    )
    return int(
        conn.execute(
            sa.text(f"INSERT INTO {table} ({columns}) VALUES ({values}) RETURNING id"),
            {"kind": kind, "queue": queue, "state": state, "key": key, "mask": mask, "id": job_id},
        ).scalar_one()
    )


def _claims(conn: sa.Connection) -> list[tuple[bytes, int]]:
    rows = conn.execute(sa.text("SELECT unique_key, job_id FROM awa.job_unique_claims ORDER BY 2"))
    return [(bytes(r.unique_key), r.job_id) for r in rows]


def _move_to_scheduled(conn: sa.Connection, job_id: int, state: str, mask: str) -> None:
    """The canonical reschedule's shape: DELETE from jobs_hot and INSERT the row in one CTE."""
    conn.execute(
        sa.text(
            """
            WITH moved AS (DELETE FROM awa.jobs_hot WHERE id = :id RETURNING *)
            INSERT INTO awa.scheduled_jobs
                (id, kind, queue, args, state, priority, attempt, max_attempts, run_at,
                 created_at, unique_key, unique_states, run_lease)
            SELECT id, kind, queue, args, CAST(:state AS awa.job_state), priority, attempt,
                   max_attempts, now() + interval '1 minute', created_at, unique_key,
                   CAST(:mask AS bit(8)), run_lease
            FROM moved
            """
        ),
        {"id": job_id, "state": state, "mask": mask},
    )


def test_claim_follows_insert_update_and_delete(conn: sa.Connection) -> None:
    job = _insert_job(conn)
    assert _claims(conn) == [(KEY, job)]
    conn.execute(sa.text("UPDATE awa.jobs_hot SET priority = 3 WHERE id = :id"), {"id": job})
    assert _claims(conn) == [(KEY, job)]
    conn.execute(
        sa.text("UPDATE awa.jobs_hot SET unique_key = 'other' WHERE id = :id"), {"id": job}
    )
    assert _claims(conn) == [(b"other", job)]
    # failed is bit 5, which the default mask leaves clear
    conn.execute(sa.text("UPDATE awa.jobs_hot SET state = 'failed' WHERE id = :id"), {"id": job})
    assert _claims(conn) == []
    conn.execute(sa.text("UPDATE awa.jobs_hot SET state = 'running' WHERE id = :id"), {"id": job})
    assert _claims(conn) == [(b"other", job)]
    conn.execute(sa.text("DELETE FROM awa.jobs_hot WHERE id = :id"), {"id": job})
    assert _claims(conn) == []


@pytest.mark.parametrize(
    ("mask", "state", "claims"),
    [
        pytest.param("00001000", "available", False, id="state-bit-clear"),
        pytest.param(None, "available", False, id="no-mask"),
        pytest.param("01000000", "available", True, id="only-available"),
        pytest.param("00000001", "waiting_external", True, id="rightmost-bit"),
    ],
)
def test_bitmask_bit_zero_is_the_leftmost(
    conn: sa.Connection, mask: str | None, state: str, claims: bool
) -> None:
    job = _insert_job(conn, mask=mask, state=state)
    assert _claims(conn) == ([(KEY, job)] if claims else [])


def test_moving_a_row_in_one_statement_keeps_the_claim(conn: sa.Connection) -> None:
    job = _insert_job(conn, state="running")
    _move_to_scheduled(conn, job, "retryable", DEFAULT_MASK)
    assert _claims(conn) == [(KEY, job)]
    count = "SELECT count(*) FROM awa.scheduled_jobs WHERE id = :id"
    assert conn.execute(sa.text(count), {"id": job}).scalar_one() == 1


def test_moving_to_a_state_outside_the_mask_releases_the_claim(conn: sa.Connection) -> None:
    job = _insert_job(conn, state="running")
    _move_to_scheduled(conn, job, "retryable", "11110000")
    assert _claims(conn) == []


def test_a_key_held_by_another_job_raises_23505_on_the_index(conn: sa.Connection) -> None:
    holder = _insert_job(conn, state="running")
    unclaimed = _insert_job(conn, state="failed")  # failed is outside the mask: no claim yet
    with pytest.raises(sa.exc.IntegrityError) as error, conn.begin_nested():
        _move_to_scheduled(conn, unclaimed, "retryable", DEFAULT_MASK)
    assert _sqlstate(error) == "23505"
    assert _constraint(error) == "idx_awa_jobs_unique"
    assert _claims(conn) == [(KEY, holder)]


def test_a_plain_conflicting_insert_raises_23505(conn: sa.Connection) -> None:
    holder = _insert_job(conn)
    with pytest.raises(sa.exc.IntegrityError) as error, conn.begin_nested():
        _insert_job(conn, table="awa.scheduled_jobs", state="scheduled")
    assert _sqlstate(error) == "23505"
    assert _constraint(error) == "idx_awa_jobs_unique"
    assert _claims(conn) == [(KEY, holder)]


def test_a_claim_already_held_by_the_same_id_is_accepted(conn: sa.Connection) -> None:
    conn.execute(sa.text("INSERT INTO awa.job_unique_claims VALUES (:k, 4242)"), {"k": KEY})
    _insert_job(conn, job_id=4242)
    assert _claims(conn) == [(KEY, 4242)]


# ---------------------------------------------------------------------------- dirty marks


def _marks(conn: sa.Connection) -> tuple[Counter[str], Counter[str]]:
    queues = conn.execute(sa.text("SELECT queue FROM awa.admin_dirty_queue_marks")).scalars()
    kinds = conn.execute(sa.text("SELECT kind FROM awa.admin_dirty_kind_marks")).scalars()
    return Counter(queues), Counter(kinds)


def _clear_marks(conn: sa.Connection) -> None:
    conn.execute(sa.text("DELETE FROM awa.admin_dirty_queue_marks"))
    conn.execute(sa.text("DELETE FROM awa.admin_dirty_kind_marks"))


def test_dirty_marks_are_appended_per_statement(conn: sa.Connection) -> None:
    for queue, kind in [("q1", "k1"), ("q1", "k2"), ("q2", "k2")]:
        _insert_job(conn, key=None, mask=None, queue=queue, kind=kind)
    assert _marks(conn) == (Counter(q1=2, q2=1), Counter(k1=1, k2=2))
    _clear_marks(conn)

    conn.execute(
        sa.text(
            "INSERT INTO awa.jobs_hot (kind, queue) VALUES ('k1', 'q1'), ('k1', 'q1'), ('k2', 'q3')"
        )
    )
    assert _marks(conn) == (Counter(q1=1, q3=1), Counter(k1=1, k2=1))


def test_dirty_marks_on_update_and_delete(conn: sa.Connection) -> None:
    conn.execute(
        sa.text("INSERT INTO awa.jobs_hot (kind, queue) VALUES ('k1', 'q1'), ('k2', 'q2')")
    )
    _clear_marks(conn)
    conn.execute(sa.text("UPDATE awa.jobs_hot SET priority = 4"))
    assert _marks(conn) == (Counter(), Counter())
    conn.execute(sa.text("UPDATE awa.jobs_hot SET state = 'running' WHERE queue = 'q1'"))
    assert _marks(conn) == (Counter(q1=1), Counter())
    _clear_marks(conn)
    conn.execute(sa.text("UPDATE awa.jobs_hot SET queue = 'q9' WHERE queue = 'q2'"))
    assert _marks(conn) == (Counter(q2=1, q9=1), Counter())
    _clear_marks(conn)
    conn.execute(sa.text("UPDATE awa.jobs_hot SET kind = 'k7' WHERE kind = 'k1'"))
    assert _marks(conn) == (Counter(), Counter(k1=1, k7=1))
    _clear_marks(conn)
    conn.execute(sa.text("DELETE FROM awa.jobs_hot"))
    assert _marks(conn) == (Counter(q1=1, q9=1), Counter(k7=1, k2=1))
    stamps = conn.execute(
        sa.text("SELECT bool_and(touched_at = now()) FROM awa.admin_dirty_kind_marks")
    )
    assert stamps.scalar_one() is True


def test_statements_that_touch_no_rows_append_no_marks(conn: sa.Connection) -> None:
    job = _insert_job(conn, key=None, mask=None, state="running")
    _clear_marks(conn)
    stale = {"id": job, "lease": 999}
    conn.execute(
        sa.text("UPDATE awa.jobs_hot SET state = 'failed' WHERE id = :id AND run_lease = :lease"),
        stale,
    )
    conn.execute(sa.text("DELETE FROM awa.jobs_hot WHERE id = :id AND run_lease = :lease"), stale)
    conn.execute(sa.text("DELETE FROM awa.scheduled_jobs WHERE id = :id"), stale)
    assert _marks(conn) == (Counter(), Counter())


# ------------------------------------------------------------------ lanes and sequences

LANE_MD5 = "d06ca4988e93143fe591985dc39f671c"  # md5('default:2:0')


def _seq_facts(conn: sa.Connection, schema: str) -> dict[str, tuple[Any, ...]]:
    rows = conn.execute(
        sa.text(
            "SELECT sequencename, data_type, start_value, min_value, increment_by, cache_size "
            "FROM pg_sequences WHERE schemaname = :s AND sequencename LIKE 'queue\\_%\\_seq\\_%'"
        ),
        {"s": schema},
    )
    return {r[0]: tuple(r[1:]) for r in rows}


def _next(conn: sa.Connection, schema: str, seq: str) -> int:
    sql = f'SELECT "{schema}".sequence_next_value(:seq)'
    return int(conn.execute(sa.text(sql), {"seq": seq}).scalar_one())


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
def test_head_inserts_create_the_lane_sequences(conn: sa.Connection, schema: str) -> None:
    enqueue, claim = f"queue_enqueue_seq_{LANE_MD5}", f"queue_claim_seq_{LANE_MD5}"
    assert _seq_facts(conn, schema) == {}
    conn.execute(
        sa.text(
            f'INSERT INTO "{schema}".queue_enqueue_heads (queue, priority, enqueue_shard) '
            "VALUES ('default', 2, 0)"
        )
    )
    conn.execute(
        sa.text(
            f'INSERT INTO "{schema}".queue_claim_heads (queue, priority, enqueue_shard, '
            "claim_seq) VALUES ('default', 2, 0, 5)"
        )
    )
    params = ("bigint", 1, 1, 1, 1)
    assert _seq_facts(conn, schema) == {enqueue: params, claim: params}
    heads = conn.execute(
        sa.text(
            f'SELECT e.seq_name, c.seq_name FROM "{schema}".queue_enqueue_heads AS e, '
            f'"{schema}".queue_claim_heads AS c'
        )
    ).one()
    assert tuple(heads) == (enqueue, claim)
    assert _next(conn, schema, enqueue) == 1
    assert _next(conn, schema, claim) == 5
    name = conn.execute(
        sa.text(
            f"SELECT \"{schema}\".queue_lane_sequence_name('queue_claim_seq', 'default', "
            "CAST(2 AS smallint), CAST(0 AS smallint))"
        )
    ).scalar_one()
    assert name == claim


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
def test_sequences_only_move_forward(conn: sa.Connection, schema: str) -> None:
    enqueue, claim = f"queue_enqueue_seq_{LANE_MD5}", f"queue_claim_seq_{LANE_MD5}"
    heads = f'"{schema}".queue_enqueue_heads'
    claims = f'"{schema}".queue_claim_heads'

    def run(sql: str, **params: Any) -> None:
        conn.execute(sa.text(sql), params)

    run(f"INSERT INTO {heads} VALUES ('default', 2, 0, 10)")
    assert _next(conn, schema, enqueue) == 10
    assert _next(conn, schema, enqueue) == 10  # reading does not consume
    run(f"INSERT INTO {heads} VALUES ('default', 2, 0, 3) ON CONFLICT DO NOTHING")
    assert _next(conn, schema, enqueue) == 10
    run(f'SELECT "{schema}".set_sequence_next(:s, 4)', s=enqueue)
    assert _next(conn, schema, enqueue) == 10
    run(f'SELECT "{schema}".set_sequence_next(:s, 25)', s=enqueue)
    assert _next(conn, schema, enqueue) == 25
    run(f"SELECT nextval('\"{schema}\".{enqueue}')")
    assert _next(conn, schema, enqueue) == 26
    run(f"UPDATE {heads} SET next_seq = next_seq + 4")  # reserves the 4 positions
    assert _next(conn, schema, enqueue) == 30
    run(f"UPDATE {heads} SET next_seq = 1")
    assert _next(conn, schema, enqueue) == 30

    run(f"INSERT INTO {claims} (queue, priority, enqueue_shard) VALUES ('default', 2, 0)")
    run(f"UPDATE {claims} SET claim_seq = 7")  # a claim update does not move the sequence
    assert _next(conn, schema, claim) == 1
    locks = conn.execute(
        sa.text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
    )
    assert locks.scalar_one() == 0  # the session-level lock was released each time


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
def test_lane_ensuring_as_the_reschedule_does_it(conn: sa.Connection, schema: str) -> None:
    """The five statements of docs/contract.md#lanes, twice (the second run is a no-op)."""
    enqueue, claim = f"queue_enqueue_seq_{LANE_MD5}", f"queue_claim_seq_{LANE_MD5}"
    q = f'"{schema}"'
    statements = [
        "SELECT pg_advisory_xact_lock(hashtextextended(:s || ':default:2:0', 0))",
        f"INSERT INTO {q}.queue_lanes (queue, priority) VALUES ('default', 2) "
        "ON CONFLICT (queue, priority) DO NOTHING",
        f"INSERT INTO {q}.queue_enqueue_heads (queue, priority, enqueue_shard) "
        "VALUES ('default', 2, 0) ON CONFLICT (queue, priority, enqueue_shard) DO NOTHING",
        f"INSERT INTO {q}.queue_claim_heads (queue, priority, enqueue_shard) "
        "VALUES ('default', 2, 0) ON CONFLICT (queue, priority, enqueue_shard) DO NOTHING",
        f"SELECT {q}.ensure_lane_sequences('default', CAST(2 AS smallint), CAST(0 AS smallint))",
    ]
    for _ in range(2):
        for sql in statements:
            conn.execute(sa.text(sql), {"s": schema})
    lane = conn.execute(sa.text(f"SELECT * FROM {q}.queue_lanes")).one()
    assert tuple(lane) == ("default", 2, 1, 1, 0)
    assert set(_seq_facts(conn, schema)) == {enqueue, claim}
    assert _next(conn, schema, enqueue) == 1
    assert _next(conn, schema, claim) == 1


BULK_LANE = "CAST(1 AS smallint), CAST(3 AS smallint)"


@pytest.mark.parametrize("schema", ["awa", "awa_qs"])
def test_ensure_lane_sequences_creates_and_repairs(conn: sa.Connection, schema: str) -> None:
    q = f'"{schema}"'
    conn.execute(sa.text(f"SELECT {q}.ensure_lane_sequences('bulk', {BULK_LANE})"))
    lane = conn.execute(sa.text("SELECT md5('bulk:1:3')")).scalar_one()
    assert set(_seq_facts(conn, schema)) == {
        f"queue_enqueue_seq_{lane}",
        f"queue_claim_seq_{lane}",
    }
    conn.execute(sa.text(f"INSERT INTO {q}.queue_enqueue_heads VALUES ('bulk', 1, 3, 1)"))
    conn.execute(sa.text(f"UPDATE {q}.queue_enqueue_heads SET seq_name = 'wrong'"))
    conn.execute(sa.text(f"SELECT {q}.ensure_lane_sequences('bulk', {BULK_LANE})"))
    repaired = conn.execute(sa.text(f"SELECT seq_name FROM {q}.queue_enqueue_heads"))
    assert repaired.scalar_one() == f"queue_enqueue_seq_{lane}"


# ------------------------------------------------------------------------- notification


def test_available_inserts_notify_the_queue_channel(any_engine: sa.Engine) -> None:
    with any_engine.connect() as listener:
        listener.execute(sa.text('LISTEN "awa:mail"'))
        listener.commit()
        with any_engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO awa.jobs_hot (kind, queue) VALUES ('k', 'mail')"))
            conn.execute(
                sa.text(
                    "INSERT INTO awa.jobs_hot (kind, queue, run_at) "
                    "VALUES ('k', 'mail', now() + interval '1 hour')"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO awa.jobs_hot (kind, queue, state) VALUES ('k', 'mail', 'running')"
                )
            )
        driver = listener.connection.driver_connection
        assert driver is not None
        received = [(n.channel, n.payload) for n in driver.notifies(timeout=0.5, stop_after=2)]
    assert received == [("awa:mail", "")]


# ------------------------------------------------------------------------- build()


def test_build_on_a_database_at_head_adds_only_missing_substrates(
    fixture_conn: sa.Connection,
) -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logging.getLogger("alembic").level)
    awa_sa_schema.build(fixture_conn, ("awa", "awa_qs", "tenant_y"))
    assert awa_sa_schema.has_queue_storage(fixture_conn, "tenant_y")
    assert fixture_conn.in_transaction()  # the caller's transaction was not committed
    assert (list(root.handlers), root.level, logging.getLogger("alembic").level) == before
    with pytest.raises(ValueError, match="invalid queue-storage schema name"):
        awa_sa_schema.build(fixture_conn, ("awa", "select * from"))
    with pytest.raises(ValueError, match="would truncate"):
        awa_sa_schema.install_queue_storage(fixture_conn, "x" * 39)


# ----------------------------------------------------------------------- the Alembic CLI


def _alembic(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini"), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_alembic_cli_builds_and_removes_the_fixture(
    clone_database: Callable[[str], str],
) -> None:
    url = clone_database("template0")
    done = _alembic("-x", f"url={url}", "-x", "qs_schema=awa_qs, tenant_x", "upgrade", "head")
    assert done.returncode == 0, done.stderr
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SELECT version_num FROM alembic_version"))
            assert version.scalar_one() == "v040_0002_queue_storage"
            expected = expected_objects(load_catalog())
            live = live_objects(conn, ["awa", "awa_qs"])
            assert object_diff(expected, live) == []
            for schema in ("awa", "awa_qs", "tenant_x"):
                assert awa_sa_schema.has_queue_storage(conn, schema)

        done = _alembic("downgrade", "base", env={"AWA_SA_DATABASE_URL": url})
        assert done.returncode == 0, done.stderr
        with engine.connect() as conn:
            schemas = conn.execute(
                sa.text(
                    "SELECT nspname FROM pg_namespace "
                    "WHERE nspname IN ('awa', 'awa_qs', 'tenant_x')"
                )
            )
            assert list(schemas) == []
    finally:
        engine.dispose()


def test_alembic_cli_refuses_a_bad_schema_name(clone_database: Callable[[str], str]) -> None:
    url = clone_database("template0")
    done = _alembic("-x", f"url={url}", "-x", "qs_schema=Robert'); DROP", "upgrade", "head")
    assert done.returncode != 0
    assert "invalid queue-storage schema name" in done.stderr
