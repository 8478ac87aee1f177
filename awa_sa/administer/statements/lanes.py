"""A retried job's lane on queue storage, any enqueue shard, as awa-pg 0.6.9 picks and ensures it.

A queue whose ``awa.queue_meta.enqueue_shards`` is above 1 spreads its lanes ``(queue, priority,
enqueue_shard)`` over that many shards. awa-pg's administering call builds a queue store of its
own, whose shard rotor starts at 0: each job it enqueues again (one per lane for a DLQ retry's
single insert) onto a sharded queue takes the rotor's next pick, ``pick mod shards``; a queue
with one shard takes shard 0 and no pick. awa-sa counts the picks the same way
(:func:`awa_sa.administer.callback_leases.shards_picked`), so a call that retries one job lands
on shard 0, as awa-pg's does.

Before its first number is reserved the lane is ensured as awa-pg ensures it for that shard:
the advisory lock on ``S:queue:priority:shard``, the ``queue_lanes`` row, both head rows of the
shard (whose trigger makes the lane's sequences), then ``S.ensure_lane_sequences``. The lock and
the lane row are the settle's (:mod:`awa_sa.settle.statements.duplicate`); these are the shard's.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from awa_sa.core.registry import statement
from awa_sa.tables import queue_storage as qs
from awa_sa.tables.runtime import queue_meta


def _lane() -> dict[str, ColumnElement[Any]]:
    return {
        "queue": bindparam("b_queue", type_=Text),
        "priority": cast(bindparam("b_priority", type_=SmallInteger), SmallInteger),
        "enqueue_shard": cast(bindparam("b_enqueue_shard", type_=SmallInteger), SmallInteger),
    }


@statement
def ensure_shard_head(*, table: Literal["enqueue", "claim"]) -> Insert:
    """The head row of lane ``(b_queue, b_priority, b_enqueue_shard)``; its BEFORE INSERT
    trigger makes the lane's sequence, even when ON CONFLICT then skips the row."""
    target = qs.queue_enqueue_heads if table == "enqueue" else qs.queue_claim_heads
    return (
        pg_insert(target)
        .values(_lane())
        .on_conflict_do_nothing(index_elements=["queue", "priority", "enqueue_shard"])
        .inline()
    )


@statement
def ensure_shard_sequences() -> Select[Any]:
    """``S.ensure_lane_sequences(b_queue, b_priority, b_enqueue_shard)``."""
    lane = _lane()
    return select(qs.ensure_lane_sequences(lane["queue"], lane["priority"], lane["enqueue_shard"]))


@statement
def sharded_queues() -> Select[Any]:
    """The queues of ``b_queues`` with more than one enqueue shard, and how many each has:
    awa-pg's ``COALESCE(MAX(enqueue_shards), 1)`` for each, read once per call."""
    m = queue_meta.c
    queues = bindparam("b_queues", type_=ARRAY(Text))
    return select(m.queue, m.enqueue_shards).where(
        m.queue == func.any(queues), m.enqueue_shards > literal_column("1")
    )
