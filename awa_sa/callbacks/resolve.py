"""Resolving a callback by its stored expressions in the caller's transaction, as awa-pg
0.6.9's ``Client.resolve_callback`` does on its own pool (docs/callbacks.md#resolve).

After the routing lock, the wait is locked and its expressions read (one statement on the
canonical plane, which also reads routing; the lease's, in the routing schema, once routing
points at queue storage), the expressions decide (:mod:`awa_sa.callbacks.expressions`), and the
wait is completed or failed as :func:`~awa_sa.complete_external` and
:func:`~awa_sa.fail_external` write it, or left as it is. An expression awa-sa cannot evaluate
exactly is refused after the lock and before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection

from awa_sa.administer.statements.canonical import JobRow, job_rows
from awa_sa.callbacks.expressions import Decision, Outcome, decide, default_action_of
from awa_sa.callbacks.queue_storage import ended_on_queue_storage
from awa_sa.callbacks.statements.canonical import end_callback_canonical
from awa_sa.callbacks.statements.resolve import (
    EXPRESSIONS,
    fail_by_expression_canonical,
    resolve_lease,
    resolve_wait_canonical,
)
from awa_sa.core.compiled import run
from awa_sa.settle.running import CANONICAL
from awa_sa.settle.statements.canonical import ROUTING_LOCK
from awa_sa.tables.queue_storage import translate_map


@dataclass(frozen=True, slots=True)
class Resolved:
    """What :func:`~awa_sa.resolve_callback` did, as awa-pg's ``ResolveResult`` says it.

    ``outcome`` is ``"completed"``, ``"failed"`` or ``"ignored"``; ``job`` the job's row after
    (None when ignored); ``payload`` the (transformed) payload of a completion (None
    otherwise); ``reason`` why it was ignored (None otherwise).
    """

    outcome: Outcome
    job: JobRow | None
    payload: Any
    reason: str | None

    def is_completed(self) -> bool:
        return self.outcome == "completed"

    def is_failed(self) -> bool:
        return self.outcome == "failed"

    def is_ignored(self) -> bool:
        return self.outcome == "ignored"


def resolved_step(binds: Mapping[str, Any], payload: str | None, default_action: object) -> Any:
    """The step of ``resolve_callback``: *binds* the wait's (``b_callback_id``,
    ``b_run_lease``), *payload* its JSON text (None for none), both checked already."""
    action = default_action_of(default_action)
    value = None if payload is None else json.loads(payload)

    def step(conn: Connection) -> Resolved | None:
        routed = run(conn, ROUTING_LOCK, None)
        head = conn.execute(resolve_wait_canonical(routed=routed), binds).one()
        schema = head.routing_schema
        wait: Any = head
        if schema is not None:
            options = {"schema_translate_map": translate_map(schema)}
            wait = conn.execute(resolve_lease(), binds, execution_options=options).first()
        if wait is None or wait.id is None:
            return None
        stored = {name.removeprefix("callback_"): wait._mapping[name] for name in EXPRESSIONS}
        decision = decide(stored, value, action)
        if decision.outcome == "ignored":
            return Resolved("ignored", None, None, decision.reason)
        job = _ended(conn, routed, schema, decision, binds)
        payload_out = decision.payload if decision.outcome == "completed" else None
        return Resolved(decision.outcome, job, payload_out, None)

    return step


def _ended(
    conn: Connection,
    routed: bool,
    schema: str | None,
    decision: Decision,
    binds: Mapping[str, Any],
) -> JobRow:
    """The locked wait ended as *decision* says, as ``complete_external`` or ``fail_external``
    ends it."""
    verb: Literal["complete", "fail"] = "complete" if decision.outcome == "completed" else "fail"
    named = decision.expression is not None
    if verb == "fail":
        binds = {**binds, "b_error": decision.error}
    if named:
        binds = {**binds, "b_expression": decision.expression}
    if schema is not None:
        ended = ended_on_queue_storage(conn, schema, verb, binds, by_expression=named)
        assert ended is not None  # the lease is locked: it is there
        return ended
    if named:
        query = fail_by_expression_canonical(routed=routed)
    else:
        query = end_callback_canonical(routed=routed, verb=verb)
    (job,) = job_rows(conn.execute(query, binds).all(), CANONICAL)
    return job
