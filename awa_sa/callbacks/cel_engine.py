"""awa-pg 0.6.9's CEL engine, reached from Python: the ``cel`` crate 0.13.0 that awa-pg links,
as the ``common-expression-language`` 0.6.0 binding wraps the same crate (the
``callbacks-cel`` extra).

awa-pg gives an expression one variable, ``payload``: the callback payload as serde hands JSON
to the crate, where a number with no fraction that is not negative is a ``uint``
(``payload.amount == 5`` is false for ``{"amount": 5}``, ``payload.amount == 5u`` true, and
``payload.amount + 1`` an error). The binding turns every Python ``int`` of the signed range
into an ``int``, so the payload is never handed to it as a Python value: it is written as a CEL
literal (``{"amount":5u}``, :func:`literal`), and each expression runs with ``payload`` bound to
that literal by a comprehension, ``[P].map(payload, [payload, ...])[0]``: E sees exactly
awa-pg's value under that name and no other variable, as there. The payload comes back first
and is checked against the one given, so a literal that is not exact refuses the expression
instead of answering differently.

The comprehension collects its values into a list, which unwraps a CEL optional: so a
condition is read as ``(E) == true`` and ``(E) == false`` (neither: not a bool, as awa-pg
treats it), never as its value; and a transform's value comes with ``(T) == (T)``, false where
it holds an optional (or a NaN). What cannot be shown exactly is refused
(:class:`ExpressionRefused`, nothing written): a transform's optional, NaN, timestamp or
duration (awa-pg writes nanoseconds, Python's types hold microseconds) or map with keys that
are not strings, anything the binding reports as a crash of the crate (awa-pg raises there
too), and an expression the comprehension would nest past the parser's depth limit.
"""

from __future__ import annotations

import base64
import importlib
import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

from awa_sa.core.errors import AwaSAError, ValidationError

DISTRIBUTION = "common-expression-language"
ENGINE_RELEASE = "0.6.0"
"""The binding release whose crate is awa-pg 0.6.9's (``cel`` 0.13.0): the only one taken."""


class CelUnavailable(AwaSAError, RuntimeError):
    """The wait's expressions need awa-pg's CEL engine, which is not installed here (or another
    release of the binding is); nothing was written. Install ``awa-sa[callbacks-cel]``."""

    def __init__(self, found: str | None) -> None:
        have = "is not installed" if found is None else f"{found} is installed"
        super().__init__(
            f"the callback's CEL expressions need {DISTRIBUTION}=={ENGINE_RELEASE} (awa-pg "
            f"0.6.9's cel 0.13.0), and {have}: install awa-sa[callbacks-cel] "
            "(nothing was written)"
        )
        self.found = found


class ExpressionRefused(ValidationError):
    """A callback expression awa-sa cannot evaluate exactly as awa-pg 0.6.9 does, refused with
    the reason; nothing was written (docs/callbacks.md#expressions)."""

    def __init__(self, name: str, expression: str, why: str) -> None:
        super().__init__(
            f"the callback's {name} expression {expression!r} is refused: {why} "
            "(nothing was written)"
        )
        self.name = name
        self.expression = expression
        self.why = why


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


FAILED: Any = _Marker("FAILED")
"""A transform that did not compile or evaluate: awa-pg answers the payload instead."""


@cache
def load() -> ModuleType:
    """The binding, imported once; :class:`CelUnavailable` unless it is the release taken."""
    try:
        found = version(DISTRIBUTION)
    except PackageNotFoundError:
        raise CelUnavailable(None) from None
    if found != ENGINE_RELEASE:
        raise CelUnavailable(f"{DISTRIBUTION} {found}")
    return importlib.import_module("cel")


def literal(value: object) -> str:
    """*value* (JSON as :func:`json.loads` reads it) as the CEL literal of awa-pg's value:
    a number without fraction and not negative a ``uint``, a negative one an ``int``, any other
    number a ``double`` (its shortest exact digits), strings escaped code point by code point."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return f"{value}u" if value >= 0 else str(value)
    if type(value) is float:
        return repr(value)  # finite: the payload's JSON has no other
    if type(value) is str:
        return _string(value)
    if type(value) is list:
        return "[" + ",".join(literal(item) for item in value) + "]"
    if type(value) is dict:
        return "{" + ",".join(f"{_string(k)}:{literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _string(text: str) -> str:
    out = ['"']
    for char in text:
        if " " <= char <= "~" and char not in '"\\':
            out.append(char)
        else:
            out.append(f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


def same(got: Any, want: Any) -> bool:
    """Whether the binding's Python value *got* is the JSON value *want*, type for type."""
    if type(got) is not type(want):
        return False
    if type(want) is float:
        return bool(got == want and math.copysign(1.0, got) == math.copysign(1.0, want))
    if type(want) is list:
        return len(got) == len(want) and all(map(same, got, want))
    if type(want) is dict:
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return bool(got == want)


TRANSFORM = "transform"


def _items(name: str, source: str) -> str:
    """What the program computes of one expression: for a condition whether it is ``true``
    and whether it is ``false`` (anything else is neither, as for awa-pg, whatever it is); for
    the transform its value, and whether that value equals itself (not where it holds an
    optional, which the comprehension's list would unwrap, or a NaN)."""
    once = f"({source}\n)"
    if name == TRANSFORM:
        return f", {once}, {once} == {once}"
    return f", {once} == true, {once} == false"


class Evaluator:
    """The expressions of one wait, on one payload, as awa-pg's crate evaluates them.

    All of them first in one program, which answers every one when none fails (a pure
    evaluation: those awa-pg would not reach cost only time); otherwise each one alone, when
    asked for in awa-pg's order.
    """

    def __init__(self, payload: object, expressions: Mapping[str, str]) -> None:
        self._cel = load()
        self._payload = payload
        self._literal = literal(payload)
        self._known: dict[str, tuple[Any, Any]] = {}
        named = list(expressions.items())
        if not named:
            return
        try:
            values = self._run("".join(_items(*pair) for pair in named), *named[0])
        except _Unknown:
            return
        pairs = zip(values[::2], values[1::2], strict=True)
        self._known = {name: pair for (name, _), pair in zip(named, pairs, strict=True)}

    def holds(self, name: str, source: str) -> bool | None:
        """The condition's bool; None where it fails or is not a bool (fail-open, as there)."""
        is_true, is_false = self._pair(name, source)
        if is_true is FAILED:
            return None
        return True if is_true is True else False if is_false is True else None

    def transformed(self, source: str) -> Any:
        """The transform's value as awa-pg writes it to JSON, or :data:`FAILED`."""
        value, reflexive = self._pair(TRANSFORM, source)
        if value is FAILED:
            return FAILED
        if reflexive is not True:
            why = "its value holds a CEL optional or a NaN, which awa-sa cannot read back exactly"
            raise ExpressionRefused(TRANSFORM, source, why)
        return as_json(value, TRANSFORM, source)

    def _pair(self, name: str, source: str) -> tuple[Any, Any]:
        """The two values :func:`_items` computes; ``(FAILED, FAILED)`` where it fails."""
        if name in self._known:
            return self._known[name]
        try:
            self._cel.compile(source)
        except Exception as exc:
            _crashed(exc, f"Failed to parse expression '{source}'", name, source)
            return FAILED, FAILED
        try:
            first, second = self._run(_items(name, source), name, source, alone=True)
        except _Unknown:
            pass
        else:
            return first, second
        if name != TRANSFORM:
            return FAILED, FAILED
        try:  # did it fail, or only its value not reach Python?
            self._run(f", size([({source}\n)])", name, source, alone=True)
        except _Unknown:
            return FAILED, FAILED
        why = "its value holds a timestamp or duration past Python's range"
        raise ExpressionRefused(name, source, why)

    def _run(self, items: str, name: str, source: str, *, alone: bool = False) -> list[Any]:
        """The values of *items* in one program, with the payload bound; :class:`_Unknown`
        when it fails; refused, for an expression *alone*, where awa-pg's answer is unknown."""
        program = f"[{self._literal}].map(payload, [payload{items}])[0]"
        try:
            compiled = self._cel.compile(program)
        except Exception:
            if alone:
                why = "bound to the payload by a comprehension, it nests past CEL's depth limit"
                raise ExpressionRefused(name, source, why) from None
            raise _Unknown from None
        try:
            values = compiled.execute()
        except Exception as exc:
            if alone:
                _crashed(exc, f"Failed to execute expression '{program}'", name, source)
            raise _Unknown from None
        if not same(values[0], self._payload):
            raise ExpressionRefused(name, source, "the payload did not reach CEL exactly")
        return list(values[1:])


class _Unknown(Exception):
    """A program that did not compile or evaluate."""


def _crashed(exc: Exception, head: str, name: str, source: str) -> None:
    """Refuse where the binding caught a crash of the crate (a Rust panic), which awa-pg does
    not catch: it raises, its own transaction rolled back."""
    said = (f"{head}: Invalid syntax or malformed string", f"{head}: Internal parser error")
    if isinstance(exc, ValueError) and str(exc) in said:
        raise ExpressionRefused(name, source, "the CEL crate crashed on it (awa-pg raises)")


def as_json(value: object, name: str, source: str) -> Any:
    """A transform's value as awa-pg's crate writes it to JSON (``Value::json``): bytes as
    standard base64, an infinity as null; refused where the binding's Python value is not
    exact: a timestamp or duration (nanoseconds there, microseconds here), or a map with a key
    that is not a string (the binding's dict merges ``1``, ``1u`` and ``true``)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is bytes:
        return base64.b64encode(value).decode("ascii")
    if type(value) is list:
        return [as_json(item, name, source) for item in value]
    if type(value) is dict:
        if any(type(key) is not str for key in value):
            why = "its value holds a map with keys that are not strings"
            raise ExpressionRefused(name, source, why)
        keys = sorted(value, key=lambda key: key.encode("utf-8"))  # serde_json's order
        return {key: as_json(value[key], name, source) for key in keys}
    if isinstance(value, datetime | timedelta):
        why = "its value holds a timestamp or duration, which Python holds only to microseconds"
        raise ExpressionRefused(name, source, why)
    raise ExpressionRefused(name, source, f"its value is a {type(value).__name__}")
