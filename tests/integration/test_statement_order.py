"""The statements each path sends, in order (docs/contract.md#queue-storage-order).

The canonical path is one statement (the Engine form's, in autocommit); the queue-storage path
keeps Awa's observable order (claim before insert, the deferred-rows and cancelled-row
savepoints, ring read, five lane statements, clock, cancelled row, last resort) with the take
and the allocation merged into one statement, the cancelled row and its delta merged into
another, and one savepoint around the whole branch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import insert_holder, insert_job
from recording import recording, step

import awa_sa_schema
from awa_sa import (
    Attempt,
    CancelledDuplicate,
    Complete,
    Completed,
    Migrated,
    Rescheduled,
    Settlement,
    Snooze,
    Stale,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
    settle,
    settle_attempts,
)
from awa_sa.testing import queue_storage_attempt


@pytest.fixture
def sent(engine: sa.Engine) -> Iterator[list[str]]:
    with recording(engine, step, events=()) as seen:
        yield seen


def _run(engine: sa.Engine, sent: list[str], job: int, lease: int = 1) -> Any:
    sent.clear()
    return reschedule_canonical_attempt(engine, job, lease, Snooze(1))


def test_canonical_paths(engine: sa.Engine, sent: list[str]) -> None:
    with engine.begin() as conn:
        job = insert_job(conn)
    assert isinstance(_run(engine, sent, job), Rescheduled)
    assert sent == ["one statement"]
    assert _run(engine, sent, job) == Stale()
    assert sent == ["one statement"]
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM awa.storage_transition_state"))
        job = insert_job(conn)
    assert isinstance(_run(engine, sent, job), Rescheduled)
    assert sent == ["one statement"]


def test_queue_storage_paths(engine: sa.Engine, sent: list[str]) -> None:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
        plain = insert_job(conn)
        claimed = insert_job(conn, unique_key=b"c", unique_states="11111000")
        wired = insert_job(conn, callbacks=["callback_on_fail"])
        row9 = insert_job(conn, unique_key=b"9", unique_states="11000000")
        row10 = insert_job(conn, unique_key=b"10", unique_states="11000010")
        insert_holder(conn, b"9", "11000000")
        insert_holder(conn, b"10", "11000010")
    # The one statement (in autocommit) reports queue storage; the transaction starts over.
    head = ["one statement", "lock", "routing+move", "savepoint", "open claims", "take+allocate"]

    assert isinstance(_run(engine, sent, plain), Migrated)
    assert sent == [*head, "savepoint", "deferred", "release", "release"]

    assert isinstance(_run(engine, sent, claimed), Migrated)
    assert sent == [*head, "savepoint", "claim", "deferred", "release", "release"]

    assert _run(engine, sent, claimed) == Stale()  # take and fall-through both miss
    assert sent == [*head, "move", "release"]

    assert isinstance(_run(engine, sent, wired), Rescheduled)
    assert sent == [*head, "move", "release"]

    lane = ["ring", "lane lock", "lane", "enqueue head", "claim head", "lane sequences", "clock"]
    assert isinstance(_run(engine, sent, row9), CancelledDuplicate)
    assert sent == [
        *head,
        *["savepoint", "claim", "rollback to"],
        *lane,
        *["savepoint", "cancelled+delta", "release"],
        "release",
    ]

    assert isinstance(_run(engine, sent, row10), CancelledDuplicate)
    assert sent == [
        *head,
        *["savepoint", "claim", "rollback to"],
        *lane,
        *["savepoint", "claim", "rollback to"],
        "cancelled+delta",  # last resort: no savepoint
        "release",
    ]


def _counts_in_contract() -> dict[str, tuple[int, int]]:
    """docs/contract.md's statement counts: path -> (Connection form, Engine form)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
    table = text.split('<a id="statement-counts"></a>', 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| ([a-z][^|]*?) \| (\d+) \| (\d+) \|$", table, flags=re.MULTILINE)
    return {path: (int(conn), int(engine)) for path, conn, engine in rows}


def test_statement_counts_are_the_contracts(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
        plain = [insert_job(conn) for _ in range(6)]
        keyed = [
            insert_job(conn, unique_key=b"n%d" % i, unique_states="11111000") for i in range(6)
        ]
        awa_sa_schema.set_phase(conn, "canonical", "awa_qs")
        canonical = [insert_job(conn) for _ in range(6)]

    def counted(bind: Any, jobs: list[int]) -> int:
        with recording(engine, step, events=()) as seen:
            outcomes = reschedule_canonical_attempts(bind, [Attempt(j, 1, Snooze(1)) for j in jobs])
        assert Stale() not in outcomes
        return len(seen)

    def both(jobs: list[int]) -> tuple[int, int]:
        with engine.begin() as conn:
            in_transaction = counted(conn, jobs[:3])
        return in_transaction, counted(engine, jobs[3:])

    measured = {"canonical": both(canonical)}
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "mixed_transition", "awa_qs")
    measured["queue storage, no successor claims a key"] = both(plain)
    measured["queue storage, successors claim keys"] = both(keyed)

    def settled(bind: Any) -> int:
        with engine.begin() as conn:
            attempt = queue_storage_attempt(conn, schema="awa_qs")
        with recording(engine, step, events=()) as seen:
            assert isinstance(settle(bind, attempt, Complete()), Completed)
        return len(seen)

    with engine.begin() as conn:
        in_transaction = settled(conn)
    measured["queue-storage attempt, settle"] = (in_transaction, settled(engine))
    assert measured == _counts_in_contract()


def test_a_batch_of_queue_storage_attempts_locks_once_then_settles_each(
    engine: sa.Engine, sent: list[str]
) -> None:
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, "active", "awa_qs")
        attempts = [queue_storage_attempt(conn, schema="awa_qs") for _ in range(3)]
    sent.clear()
    outcomes = settle_attempts(engine, [Settlement(a, Complete()) for a in attempts])
    assert outcomes == [Completed(a.job_id) for a in attempts]
    assert sent == ["savepoint", "receipt locks", *["settle receipt"] * 3, "release"]
