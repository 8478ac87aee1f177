"""What a callback's stored expressions decide, in awa-pg 0.6.9's order and with its words.

awa-pg's ``resolve_callback`` (``evaluate_or_default``): with no expression stored, the
``default_action``. Otherwise, with ``payload`` the callback payload (JSON null when none):

1. ``filter``: false ignores the callback; true, or an expression that fails or is not a bool,
   lets it through (fail-open);
2. ``on_fail``: true fails the job, the error entry naming the expression; anything else goes on;
3. ``on_complete``: true completes the job, answering the ``transform``'s value (the payload
   when there is no transform, or it fails);
4. else the ``default_action``, with the payload as given (not transformed).

The values come from awa-pg's own CEL crate (:mod:`awa_sa.callbacks.cel_engine`), which is
imported only when an expression is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from awa_sa.callbacks.cel_engine import FAILED, Evaluator
from awa_sa.core.errors import ValidationError

Outcome = Literal["completed", "failed", "ignored"]
DefaultAction = Literal["complete", "fail", "ignore"]
DEFAULT_ACTIONS: tuple[DefaultAction, ...] = ("complete", "fail", "ignore")

FILTERED = "filter expression returned false"
IGNORED = "no expressions configured, default is ignore"
MATCHED = "callback failed: on_fail expression matched"
DEFAULTED = "callback failed: default action"
ORDER = ("filter", "on_fail", "on_complete", "transform")
"""The expressions, by the name awa-pg's ``register_callback`` gives them, in its order."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the wait becomes: ``completed`` (answering *payload*), ``failed`` (its error
    entry's *error*, and the *expression* that failed it), or ``ignored`` (*reason*)."""

    outcome: Outcome
    payload: Any = None
    error: str | None = None
    expression: str | None = None
    reason: str | None = None


def default_action_of(value: object) -> DefaultAction:
    """*value* as awa-pg parses ``default_action``, or its refusal."""
    for action in DEFAULT_ACTIONS:
        if value == action and type(value) is str:
            return action
    raise ValidationError(
        f"unknown default_action: {value!r} (expected 'complete', 'fail', or 'ignore')"
    )


def _default(action: DefaultAction, payload: Any) -> Decision:
    if action == "complete":
        return Decision("completed", payload=payload)
    if action == "fail":
        return Decision("failed", error=DEFAULTED)
    return Decision("ignored", reason=IGNORED)


def decide(stored: Mapping[str, str | None], payload: Any, action: DefaultAction) -> Decision:
    """The decision of the *stored* expressions (by the names of :data:`ORDER`) on *payload*
    (its JSON value; None when there is none), with *action* as the default."""
    present = {name: source for name in ORDER if (source := stored.get(name)) is not None}
    if not present:
        return _default(action, payload)
    cel = Evaluator(payload, present)

    def holds(name: str) -> bool | None:
        source = present.get(name)
        return None if source is None else cel.holds(name, source)

    if holds("filter") is False:
        return Decision("ignored", reason=FILTERED)
    if holds("on_fail") is True:
        return Decision("failed", error=MATCHED, expression=present["on_fail"])
    if holds("on_complete") is True:
        source = present.get("transform")
        value = FAILED if source is None else cel.transformed(source)
        return Decision("completed", payload=payload if value is FAILED else value)
    return _default(action, payload)
