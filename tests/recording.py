"""The one statement recorder: what a tracer hooked on an engine sees, as a list of labels.

Every statement sent (``before_cursor_execute``) becomes a label, and each connection event
asked for (BEGIN, COMMIT, ROLLBACK; CHECKOUT and CHECKIN from the pool) its name in capitals, in
the order they happen. A test then compares the list with the order it expects, so a statement
added to, dropped from or moved in a path shows up as a one-line difference.

Two labellings cover the suite: :func:`first_word` for budgets ("SELECT, WITH"), and
:func:`step` for the queue-storage path, which names each statement by what it does there.

A test that must act at a statement (the fault tests kill the backend before or after one) passes
*act*: it then sees each statement it would record as a :class:`Sent`, before and after it runs,
from the same hooks, so what it counts is what the list shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

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
    ("CAST(hot.state AS TEXT) AS ended", "end"),
    ("to_regprocedure(", "one statement"),
    ("awa.receipt.complete:", "receipt locks"),
    ("receipt_completion_batches", "settle receipt"),
    ("lease_claims", "open claims"),
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


@dataclass(frozen=True, slots=True)
class Sent:
    """One recorded statement, as *act* sees it just *when* it runs: on *conn*, with *sql*.

    *index* is its place among the statements recorded in the block, from 0: the same for its
    "before" and its "after", so a hook that acts at the n-th statement need not count.
    """

    conn: sa.Connection
    sql: str
    index: int
    when: Literal["before", "after"]


@contextmanager
def recording(
    engine: sa.Engine,
    label: Callable[[str], str] = first_word,
    events: Sequence[str] = TRANSACTION_EVENTS,
    *,
    driver_sql_only: bool = False,
    act: Callable[[Sent], None] | None = None,
) -> Iterator[list[str]]:
    """Record what *engine* sends while the block runs; the hooks are removed after.

    *driver_sql_only* skips Core statements, which awa-sa never executes (it sends compiled
    text), so a test's own set-up through Core does not pollute the list. *act* is called with
    each statement recorded, before it is sent (after its label is added) and after it ran; a
    statement that fails gets no "after".
    """
    seen: list[str] = []
    started = 0  # statements recorded so far (seen also holds the events)

    def recorded(context: Any) -> bool:
        return not (driver_sql_only and context.compiled is not None)

    def before(conn: sa.Connection, _cursor: Any, sql: str, *rest: Any) -> None:
        nonlocal started
        _params, context, _many = rest
        if recorded(context):
            seen.append(label(sql))
            started += 1
            if act is not None:
                act(Sent(conn, sql, started - 1, "before"))

    def after(conn: sa.Connection, _cursor: Any, sql: str, *rest: Any) -> None:
        _params, context, _many = rest
        if act is not None and recorded(context):
            act(Sent(conn, sql, started - 1, "after"))

    hooks: list[tuple[Any, str, Callable[..., None]]] = [
        (engine, "before_cursor_execute", before),
        (engine, "after_cursor_execute", after),
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
