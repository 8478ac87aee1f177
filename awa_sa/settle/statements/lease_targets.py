"""The running lease a callback materialised an attempt into, as a settle's target.

When a handler registers a callback, the runtime materialises the attempt's ``lease_claims``
receipt into a running ``leases`` row, and its ending of the handler's result (awa-pg 0.6.9:
every result, its completion too) deletes that lease where it would have closed the receipt.
:func:`lease_target` is that delete, in the row shape of a receipt's target, so the settle
writes the rest as for any receipt (:func:`~awa_sa.settle.statements.receipt_settles.settle_receipt`
in its ``lease`` shape).
"""

from __future__ import annotations

from sqlalchemy import CTE, BigInteger, cast, delete, exists, null, select, true

from awa_sa.core.sql import state
from awa_sa.settle.statements.receipt_targets import claim_slot_bind
from awa_sa.tables import queue_storage as qs

_LANE = ("ready_slot", "ready_generation", "queue", "enqueue_shard", "lane_seq", "job_id")


def lease_target(asked: CTE) -> CTE:
    """The running lease of the asked attempt deleted, as the runtime's ending of a handler's
    result deletes it once the receipt statement found the lease (``DELETE ... AND state =
    'running'``): only while it is still the asked attempt (its ``lease_claims`` receipt as
    named, its queue, attempt and kind), so a guard miss deletes nothing. In the shape of a
    ``lease_claims`` receipt's target, the claim time being the lease's ``attempted_at``."""
    lease, ready, claims = qs.leases, qs.ready_entries.c, qs.lease_claims.c
    named = exists().where(
        claims.claim_slot == claim_slot_bind(),
        claims.claim_slot == asked.c.claim_slot,
        claims.job_id == lease.c.job_id,
        claims.run_lease == lease.c.run_lease,
        claims.receipt_id == asked.c.receipt_id,
    )
    kind = (
        exists()
        .where(*(ready[name] == lease.c[name] for name in _LANE))
        .where(ready.kind == asked.c.want_kind)
    )
    gone = (
        delete(lease)
        .where(
            lease.c.job_id == asked.c.job_id,
            lease.c.run_lease == asked.c.run_lease,
            lease.c.state == state("running"),
            lease.c.queue == asked.c.want_queue,
            lease.c.attempt == asked.c.want_attempt,
            asked.c.batch_id.is_(None),
            named,
            kind,
        )
        .returning(*lease.c)
        .cte("gone")
    )
    g = gone.c
    return (
        select(
            claim_slot_bind().label("claim_slot"),
            cast(null(), BigInteger).label("batch_id"),
            asked.c.receipt_id,
            *(g[name] for name in ("ready_slot", "ready_generation", "job_id", "queue")),
            *(g[name] for name in ("priority", "attempt", "run_lease", "max_attempts")),
            g.lane_seq,
            g.enqueue_shard,
            g.attempted_at,
        )
        .select_from(gone.join(asked, true()))
        .cte("target")
    )
