"""The service soak's webhook receivers (service_soak.py): callbacks resolved with awa-sa.

The handlers of the ``callback`` plan park on callbacks and record each in ``svc_callbacks``
(service_runtime.py). A provider calls each back once, after a delay of up to
``RECEIVER_DELAY_S``, at one of ``Receivers.count`` receivers, and one callback in
``DUPLICATE_SHARE`` twice, at two receivers at the same moment (a provider retrying a webhook),
so two receivers race for one wait. Each receiver writes its row (``svc_receipts``) and ends the
wait with awa-sa's ``complete_external``, ``fail_external`` or ``retry_external`` in one
transaction; answered ``None`` (the other receiver, the callback-timeout rescue or a cancel
ended it first) it rolls its row back. The short callback timeouts
(service_runtime.CALLBACK_TIMEOUTS_MS) expire within the delay, so the runtime's rescue wins
some waits outright and races the receivers for others.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from typing import Any

import sqlalchemy as sa

import awa_sa

RECEIVER_DELAY_S = 0.7
DUPLICATE_SHARE = 0.15
ACTIONS = {"complete": 60, "fail": 20, "retry": 20}
"""What a callback asks for -> its share; each receiver of a duplicate draws its own."""

STATE_OF = {"complete": "completed", "fail": "failed", "retry": "available"}
"""The state a receiver's committed row claims its call left the job in."""

_NEW = """SELECT id, callback_id, job_id, extract(epoch FROM at) AS at FROM svc_callbacks
WHERE id > :floor ORDER BY id"""
_ROW = """INSERT INTO svc_receipts (callback_id, receiver, action, job_id)
VALUES (:callback_id, :receiver, :action, :job_id) RETURNING id"""
_ENDED = "UPDATE svc_receipts SET run_lease = :lease, state = :state, storage = :storage "
_ENDED += "WHERE id = :id"
WINDOW = 64
"""Ids below the highest one seen that are read again: a handler's row may commit after a
later id's (ids are drawn at insert), and must not be missed."""


def deliveries(callback_id: str, count: int) -> tuple[float, list[int]]:
    """When the provider calls *callback_id* back (seconds after it was recorded), and at which
    receivers: the same for every receiver, so a duplicate's two calls come at one moment."""
    rng = random.Random(callback_id)
    delay = rng.uniform(0, RECEIVER_DELAY_S)
    first = rng.randrange(count)
    if count > 1 and rng.random() < DUPLICATE_SHARE:
        return delay, [first, (first + 1 + rng.randrange(count - 1)) % count]
    return delay, [first]


class Receivers:
    """``count`` receivers, each a thread reading ``svc_callbacks`` and answering the calls
    delivered to it, until ``stop`` is set (once nothing is live any more)."""

    def __init__(self, engine: sa.Engine, count: int, tally: Any, lock: threading.Lock) -> None:
        self.engine, self.count, self.tally, self.lock = engine, count, tally, lock
        self.stop = threading.Event()

    def receive(self, index: int) -> None:
        name = f"receiver{index}"
        due: list[tuple[float, str, int]] = []
        seen: set[int] = set()
        last = 0
        while not self.stop.is_set():
            with self.engine.connect() as conn:
                found = conn.execute(sa.text(_NEW), {"floor": last - WINDOW}).mappings().all()
            for r in found:
                if r["id"] not in seen:
                    seen.add(r["id"])
                    last = max(last, r["id"])
                    delay, targets = deliveries(r["callback_id"], self.count)
                    if index in targets:
                        at = float(r["at"]) + delay
                        heapq.heappush(due, (at, r["callback_id"], r["job_id"]))
            seen = {i for i in seen if i > last - WINDOW}
            while due and due[0][0] <= time.time():
                _, callback_id, job_id = heapq.heappop(due)
                self.resolve(name, callback_id, job_id)
            time.sleep(0.05)  # a provider's pace; the races are the callbacks' own

    def resolve(self, name: str, callback_id: str, job_id: int) -> None:
        rng = random.Random(f"{callback_id}/{name}")
        action = rng.choices(list(ACTIONS), list(ACTIONS.values()))[0]
        with self.engine.connect() as conn, conn.begin() as tx:
            row = {"callback_id": callback_id, "receiver": name, "action": action}
            receipt = conn.execute(sa.text(_ROW), {**row, "job_id": job_id}).scalar_one()
            if action == "complete":
                job = awa_sa.complete_external(conn, callback_id, {"by": name})
            elif action == "fail":
                job = awa_sa.fail_external(conn, callback_id, f"soak: declined at {name}")
            else:
                job = awa_sa.retry_external(conn, callback_id)
            with self.lock:
                self.tally.answers[f"{action}_external {type(job).__name__}"] += 1
                if job is None:
                    self.tally.lost_callbacks.append(callback_id)
            if job is None:  # ended already: this receiver's row must not commit
                tx.rollback()
                return
            ended = {"id": receipt, "lease": job.run_lease, "state": job.state}
            conn.execute(sa.text(_ENDED), {**ended, "storage": job.storage})
