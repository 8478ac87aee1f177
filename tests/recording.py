"""The one statement recorder: what a tracer hooked on an engine sees, as a list of labels.

Every statement sent (``before_cursor_execute``) becomes a label, and each connection event
asked for (BEGIN, COMMIT, ROLLBACK; CHECKOUT and CHECKIN from the pool) its name in capitals, in
the order they happen. A test then compares the list with the order it expects, so a statement
added to, dropped from or moved in a path shows up as a one-line difference.

Two labellings cover the suite: :func:`first_word` for budgets ("SELECT, WITH"), and
:func:`step` for the queue-storage path, which names each statement by what it does there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

TRANSACTION_EVENTS = ("begin", "commit", "rollback")
POOL_EVENTS = frozenset({"checkout", "checkin"})

_PREFIXES = [
    ("RELEASE SAVEPOINT", "release"),
    ("ROLLBACK TO SAVEPOINT", "rollback to"),
    ("SAVEPOINT", "savepoint"),
]
_STEPS = [  # the first that occurs in the statement wins
    ("FOR SHARE", "lock"),
    ("active_queue_storage_schema", "routing+move"),
    ("nextval(", "take+allocate"),
    ("INSERT INTO awa.scheduled_jobs", "move"),
    ("INSERT INTO awa.job_unique_claims", "claim"),
    (".deferred_jobs", "deferred"),
    (".queue_ring_state", "ring"),
    ("pg_advisory_xact_lock", "lane lock"),
    (".queue_lanes", "lane"),
    (".queue_enqueue_heads", "enqueue head"),
    (".queue_claim_heads", "claim head"),
    (".ensure_lane_sequences(", "lane sequences"),
    ("clock_timestamp()", "clock"),
    (".done_entries", "cancelled+delta"),
]


def first_word(sql: str) -> str:
    """``SELECT``, ``WITH``, ``SAVEPOINT``...: enough for a statement budget."""
    return sql.split(maxsplit=1)[0].upper() if sql.strip() else sql


def step(sql: str) -> str:
    """What the statement does in the flow; a statement it does not know is its own text."""
    for prefix, label in _PREFIXES:
        if sql.startswith(prefix):
            return label
    return next((label for needle, label in _STEPS if needle in sql), sql)


@contextmanager
def recording(
    engine: sa.Engine,
    label: Callable[[str], str] = first_word,
    events: Sequence[str] = TRANSACTION_EVENTS,
    *,
    driver_sql_only: bool = False,
) -> Iterator[list[str]]:
    """Record what *engine* sends while the block runs; the hooks are removed after.

    *driver_sql_only* skips Core statements, which awa-sa never executes (it sends compiled
    text), so a test's own set-up through Core does not pollute the list.
    """
    seen: list[str] = []

    def statement(*args: Any) -> None:
        _conn, _cursor, sql, _params, context, _many = args
        if not (driver_sql_only and context.compiled is not None):
            seen.append(label(sql))

    hooks: list[tuple[Any, str, Callable[..., None]]] = [
        (engine, "before_cursor_execute", statement)
    ]
    for name in events:
        target = engine.pool if name in POOL_EVENTS else engine
        hooks.append((target, name, lambda *_, name=name: seen.append(name.upper())))
    for target, name, hook in hooks:
        event.listen(target, name, hook)
    try:
        yield seen
    finally:
        for target, name, hook in hooks:
            event.remove(target, name, hook)
