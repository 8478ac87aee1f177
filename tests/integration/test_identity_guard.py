"""The guard checks the attempt's kind, queue and attempt when the caller names them.

A call that knows which attempt it read (``awa_sa.settle`` with a ``RunningAttempt``) has
that identity checked inside the moving statement, under the row lock: a row under the same
``(id, run_lease)`` that is not that attempt is Stale, and is left exactly as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Cluster
from jobs import canonical_state, insert_job

from awa_sa import Rescheduled, Snooze, Stale
from awa_sa.settle.binds import in_transaction, within
from awa_sa.settle.inputs import prepare

WRONG: dict[str, Any] = {"kind": "other_kind", "queue": "other_queue", "attempt": 9}


@pytest.mark.parametrize("phase", ["canonical", "mixed_transition"])
@pytest.mark.parametrize("field", sorted(WRONG))
def test_a_different_identity_is_stale_and_changes_nothing(
    cluster: Cluster, phase: str, field: str
) -> None:
    cluster.set_phase(phase, "awa_qs")
    with cluster.engine.begin() as conn:
        job = insert_job(conn, kind="send_email", queue="mail", attempt=2)
    call = prepare(job, 1, Snooze(5), None, None)
    named: dict[str, Any] = {"kind": "send_email", "queue": "mail", "attempt": 2}
    named[field] = WRONG[field]
    wrong = type(call)(call.kind, call.item._replace(**named))
    with cluster.engine.begin() as conn:
        assert in_transaction(conn, [wrong]) == [Stale()]
    assert within(cluster.engine, [wrong]) == [Stale()]
    assert canonical_state(cluster.engine, job) == "running"


def test_the_same_identity_moves_the_attempt(cluster: Cluster) -> None:
    with cluster.engine.begin() as conn:
        job = insert_job(conn, kind="send_email", queue="mail", attempt=2)
    call = prepare(job, 1, Snooze(5), None, None)
    named = type(call)(call.kind, call.item._replace(kind="send_email", queue="mail", attempt=2))
    (outcome,) = within(cluster.engine, [named])
    assert isinstance(outcome, Rescheduled)
    assert outcome.attempt == 1
