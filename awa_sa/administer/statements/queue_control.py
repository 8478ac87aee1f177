"""Pausing and resuming a queue: the rows of ``awa.queue_meta`` awa-pg 0.6.9 writes.

A queue's pause is one row of ``awa.queue_meta``, shared by both planes: the canonical claim and
every queue-storage claim function skip a queue whose row says ``paused``. awa-pg's
``pause_queue`` upserts that row (``paused_at`` and ``paused_by`` rewritten on every pause), its
``resume_queue`` clears the flag alone and leaves ``paused_at`` and ``paused_by`` as they were.
These are the same two statements, bound by name.
"""

from __future__ import annotations

from sqlalchemy import Insert, Text, Update, bindparam, false, func, true, update
from sqlalchemy.dialects.postgresql import insert

from awa_sa.core.registry import statement
from awa_sa.tables.runtime import queue_meta


@statement
def pause_queue_meta() -> Insert:
    """Pause queue ``b_queue``, by ``b_paused_by`` (NULL when not given), as awa-pg does: the
    row made, or its flag, clock and author rewritten."""
    queue = bindparam("b_queue", type_=Text)
    by = bindparam("b_paused_by", type_=Text)
    pause = insert(queue_meta).values(
        {
            queue_meta.c.queue: queue,
            queue_meta.c.paused: true(),
            queue_meta.c.paused_at: func.now(),
            queue_meta.c.paused_by: by,
        }
    )
    return pause.on_conflict_do_update(
        index_elements=[queue_meta.c.queue],
        set_={"paused": true(), "paused_at": func.now(), "paused_by": by},
    )


@statement
def resume_queue_meta() -> Update:
    """Resume queue ``b_queue`` as awa-pg does: the flag cleared, nothing else; a queue never
    paused has no row, and none is made."""
    return (
        update(queue_meta)
        .where(queue_meta.c.queue == bindparam("b_queue", type_=Text))
        .values({queue_meta.c.paused: false()})
    )
