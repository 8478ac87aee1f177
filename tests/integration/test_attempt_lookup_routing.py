"""``attempt_of`` reads the receipt leg only where routing was last seen on queue storage.

On the fixture cluster, one engine through a transition: a canonical job looked up twice (the
second lookup without the leg), then routing moved to queue storage and a receipt looked up
(the lookup without the leg sees routing moved and asks again with it, once), then both jobs
again (the leg every time now). Every answer is the job's own attempt; the statements are read
from what the engine sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from awa_sa import RunningAttempt, attempt_of, running_attempts
from awa_sa.testing import job_of, queue_storage_attempt, running_attempt, set_phase


def key(attempt: RunningAttempt) -> tuple[Any, ...]:
    """The attempt, without what changes by the call (``running_for``)."""
    return attempt.job_id, attempt.run_lease, attempt.storage, attempt.receipt_id


@contextmanager
def legs(engine: sa.Engine) -> Iterator[list[bool]]:
    """Per statement sent: does it read receipts (``lease_claims``)?"""
    sent: list[bool] = []

    def seen(*args: Any) -> None:
        sent.append("lease_claims" in args[2])

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)


def test_the_lookup_follows_routing_across_a_transition(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        job_id, _ = running_attempt(conn, kind="k")
    (canonical,) = running_attempts(engine, job_id=job_id)
    looked_up: list[Any] = []
    for _ in range(2):
        with legs(engine) as sent:
            looked_up.append(key(attempt_of(engine, job_of(canonical))))
        looked_up.append(sent)
    assert looked_up == [key(canonical), [True], key(canonical), [False]]

    with engine.begin() as conn:
        set_phase(conn, "active", "awa")
        receipt = queue_storage_attempt(conn, schema="awa")
    with legs(engine) as sent:
        assert key(attempt_of(engine, job_of(receipt))) == key(receipt)
    assert sent == [False, True]  # routing seen moved: asked again with the leg
    # Routing on queue storage: the leg every time (a canonical job, no receipt found, is then
    # looked for among the compact and materialised receipts too).
    for mine, expected in ((receipt, [True]), (canonical, [True, True])):
        with legs(engine) as sent:
            assert key(attempt_of(engine, job_of(mine))) == key(mine)
        assert sent == expected
