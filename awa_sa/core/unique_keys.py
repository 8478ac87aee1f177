"""Job arguments as the JSON text awa-pg writes, and the unique key it hashes from them.

awa-pg 0.6.9 turns a job's Python arguments into a ``serde_json::Value`` and hashes its
serialisation with BLAKE3 (docs/enqueue.md#unique-key). A key is only useful if awa-sa's is
byte-identical to awa-pg's for the same job, so the text is produced here the way serde_json
writes it, not the way ``json.dumps`` does: object keys in byte order, no spaces, non-ASCII
as UTF-8, only ``"``, ``\\`` and control characters escaped, and floats in serde_json's
shortest form (``0.00001``, ``1e-7``, where Python writes ``1e-05``, ``1e-07``). The same
text is what the job's ``args`` column is built from, so the stored row and the key agree as
they do for awa-pg.

Most values take a shorter road: the stdlib's C encoder writes them where its text cannot
differ from this module's own (:func:`encoded`); everything else goes through the writer
below, which alone decides what is refused.

Python values convert as awa-pg converts them: ``bool``; anything with ``__index__`` as an
integer, which outside the signed 64-bit range becomes a float (as awa-pg does; the stored
value is then rounded); anything else with ``__float__`` as a float; ``str``; ``list`` and
``tuple`` as arrays; ``dict`` with ``str`` keys as objects; ``None``. Where awa-pg would write
something a reader would not expect back (a NaN or infinity as ``null``), or fail late, awa-sa
refuses the value before any statement (:class:`~awa_sa.core.errors.ValidationError`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from awa_sa.core.errors import ValidationError
from awa_sa.tables.canonical import JOB_STATES

MAX_DEPTH = 64
"""awa-pg's nesting limit: deeper values are refused ("JSON nesting too deep")."""

_I64 = (-(2**63), 2**63 - 1)
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _c_encoder() -> Callable[[object], str]:
    """The C encoder with sorted keys and no spaces, made once.

    ``JSONEncoder.encode`` makes a new one from its options on every call, half of what a
    small object costs; the one it makes is kept here instead, and checked at import against
    ``encode`` itself (else ``encode`` is what is used).
    """
    options = json.JSONEncoder(
        ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=True
    )
    make: Any = getattr(json.encoder, "c_make_encoder", None)
    try:
        chunks = make(None, options.default, json.encoder.encode_basestring, None, ":", ",",
                      True, False, False)  # fmt: skip
        probe = {"b": [1, 2.5, None, True], "a": "é\n"}
        if "".join(chunks(probe, 0)) == options.encode(probe):
            return lambda value: "".join(chunks(value, 0))
    except TypeError:  # no C encoder (None), or one made differently
        pass
    return options.encode


_C_ENCODE = _c_encoder()
_DIGITS_18 = 10**18
"""Integers below this in magnitude have at most 18 digits: inside the signed 64-bit range."""
_POSITIONAL = (1e-4, 1e16)
"""Where Python writes a float without an exponent; there its text is serde_json's."""


def to_json(value: object, where: str = "args") -> str:
    """*value* as serde_json would write awa-pg's conversion of it, or why it cannot be."""
    text = encoded(value)
    return written(value, where) if text is None else text


def written(value: object, where: str = "args") -> str:
    """*value* through this module's own writer: serde_json's text, or why there is none."""
    out: list[str] = []
    _write(value, out, 0, where)
    return "".join(out)


def encoded(value: object) -> str | None:
    """The C encoder's text of *value* when it is exactly :func:`written`'s, else None.

    With keys sorted (code point order is UTF-8 byte order) and no spaces, the encoder and the
    writer agree on strings, on integers of the 64-bit range and on floats Python writes
    without an exponent. :func:`_plain` admits only those, in plain dicts and lists (exact
    types: a subclass may convert its own way); the text is then declined if it holds an
    escaped NUL or a lone surrogate, which the writer refuses.
    """
    if not _plain([value], -1):
        return None
    text = _C_ENCODE(value)
    return text if stored_as_written(text) else None


def plain(value: object) -> bool:
    """Whether any C encoder text of *value* holds :func:`written`'s JSON value, short of the
    strings :func:`stored_as_written` checks in that text (a NUL, a lone surrogate)."""
    return _plain([value], -1)


def all_plain(values: Sequence[object]) -> bool:
    """Whether :func:`plain` holds for every one of *values*, in one walk."""
    return _plain(values if isinstance(values, list) else list(values), -1)


def stored_as_written(text: str) -> bool:
    """Whether the C encoder's *text* of values :func:`plain` admits holds no escaped NUL
    and no lone surrogate (which the writer refuses); a whole batch is checked at once."""
    if "\\u0000" in text:
        return False
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _plain(container: list[Any] | dict[str, Any], depth: int) -> bool:
    """Whether every value inside *container* (at *depth*) is one :func:`encoded` admits.

    One loop per container with the scalar checks inline: a batch makes this walk for every
    job, and a call per value would cost what the C encoder saves.
    """
    if depth >= MAX_DEPTH:
        return False
    if type(container) is dict:
        for key in container:
            if type(key) is not str:
                return False
        items: Any = container.values()
    else:
        items = container
    for item in items:
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -_DIGITS_18 < item < _DIGITS_18:
                continue
            return False
        if kind is float:
            if _POSITIONAL[0] <= abs(item) < _POSITIONAL[1] or item == 0.0:
                continue
            return False
        if (kind is dict or kind is list) and _plain(item, depth + 1):
            continue
        return False
    return True


def _write(value: object, out: list[str], depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise ValidationError(f"{where}: JSON nesting deeper than {MAX_DEPTH} levels")
    if value is None:
        out.append("null")
    elif value is True or value is False:
        out.append("true" if value else "false")
    elif isinstance(value, str):
        out.append(_string(value, where))
    elif hasattr(type(value), "__index__"):
        number = type(value).__index__(value)  # type: ignore[attr-defined]
        if _I64[0] <= number <= _I64[1]:
            out.append(str(number))
        else:
            out.append(_float(_as_float(number, where), where))
    elif hasattr(type(value), "__float__"):
        out.append(_float(_as_float(value, where), where))
    elif isinstance(value, list | tuple):
        out.append("[")
        for n, item in enumerate(value):
            if n:
                out.append(",")
            _write(item, out, depth + 1, f"{where}[{n}]")
        out.append("]")
    elif isinstance(value, dict):
        keys = []
        for key in value:
            if not isinstance(key, str):
                raise ValidationError(f"{where}: object key {key!r} is not a str")
            keys.append((key.encode("utf-8", "surrogatepass"), key))
        out.append("{")
        for n, (_, key) in enumerate(sorted(keys)):
            if n:
                out.append(",")
            out.append(_string(key, where))
            out.append(":")
            _write(value[key], out, depth + 1, f"{where}[{key!r}]")
        out.append("}")
    else:
        raise ValidationError(f"{where}: a {type(value).__name__} cannot be written as JSON")


def _as_float(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValidationError(f"{where}: {value!r} cannot be written as JSON ({exc})") from exc
    if not math.isfinite(number):
        raise ValidationError(f"{where}: {value!r} has no JSON form (awa-pg would write null)")
    return number


def _string(text: str, where: str) -> str:
    if "\x00" in text:
        raise ValidationError(f"{where}: a NUL character cannot be stored in a jsonb value")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{where}: {text!r} is not valid Unicode ({exc.reason})") from exc
    parts = ['"']
    for char in text:
        if char in _ESCAPES:
            parts.append(_ESCAPES[char])
        elif char < " ":
            parts.append(f"\\u{ord(char):04x}")
        else:
            parts.append(char)
    parts.append('"')
    return "".join(parts)


def _float(number: float, where: str) -> str:
    """*number* as serde_json writes an ``f64``: the shortest digits that read back as it
    (Python's ``repr`` finds the same ones), laid out by serde_json's rules."""
    del where
    sign = "-" if math.copysign(1.0, number) < 0 else ""
    text = repr(abs(number))
    mantissa, _, exp = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    # the value is 0.<digits> * 10**point: the decimal point after `point` digits
    point = len(whole) + int(exp or 0) - (len(whole + frac) - len(digits))
    digits = digits.rstrip("0") or "0"
    if digits == "0":
        return f"{sign}0.0"
    length = len(digits)
    if length <= point <= 16:
        body = digits + "0" * (point - length) + ".0"
    elif 0 < point <= 16:
        body = f"{digits[:point]}.{digits[point:]}"
    elif -5 < point <= 0:
        body = "0." + "0" * -point + digits
    elif length == 1:
        body = f"{digits}e{_exponent(point - 1)}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{_exponent(point - 1)}"
    return sign + body


def _exponent(value: int) -> str:
    """serde_json 1.0.149's exponent: ``+`` before a positive one (its float writer, zmij,
    writes ``1e+16`` where the older ryu wrote ``1e16``)."""
    return f"+{value}" if value > 0 else str(value)


@dataclass(frozen=True, slots=True)
class Unique:
    """When a job is a duplicate: awa-pg's ``unique_opts``, typed.

    ``by_args`` hashes the arguments, ``by_queue`` the queue, ``by_period`` the number given
    (as awa-pg 0.6.9 does: the number itself, not the current period; see
    docs/enqueue.md#unique-key). ``states`` are the states in which another job with the same
    key blocks this one, as names or awa-pg's bit mask.
    """

    by_args: bool = True
    by_queue: bool = False
    by_period: int | None = None
    states: Collection[str] | int = field(
        default=("scheduled", "available", "running", "completed", "retryable")
    )

    def mask(self) -> int:
        """awa-pg's ``states`` mask: bit N for the state of index N in ``awa.job_state``, which
        is character N (from the left) of the ``BIT(8)`` text ``awa.job_state_in_bitmask`` reads."""
        if isinstance(self.states, int):
            return self.states
        return sum(1 << JOB_STATES.index(name) for name in self.states)


_OPTS = {"by_queue", "by_args", "by_period", "states"}


def unique_of(opts: object) -> Unique | None:
    """``unique_opts`` (awa-pg's dict, or a :class:`Unique`) checked, or why not."""
    if opts is None:
        return None
    if isinstance(opts, Unique):
        unique = opts
    elif isinstance(opts, Mapping):
        unknown = sorted(str(key) for key in opts if key not in _OPTS)
        if unknown:
            raise ValidationError(
                f"unique_opts: unknown keys {unknown} (known: by_args, by_period, by_queue, states)"
            )
        unique = Unique(**opts)
    else:
        raise ValidationError(
            f"unique_opts must be a dict or awa_sa.Unique, got {type(opts).__name__}"
        )
    for name in ("by_args", "by_queue"):
        if not isinstance(getattr(unique, name), bool):
            raise ValidationError(f"unique_opts: {name} must be a bool")
    period = unique.by_period
    if period is not None and (
        isinstance(period, bool) or not isinstance(period, int) or not _I64[0] <= period <= _I64[1]
    ):
        raise ValidationError("unique_opts: by_period must be an int in the signed 64-bit range")
    states = unique.states
    if isinstance(states, bool) or (isinstance(states, int) and not 0 <= states <= 255):
        raise ValidationError("unique_opts: states must be a bit mask from 0 to 255")
    if not isinstance(states, int):
        if isinstance(states, str) or not isinstance(states, Collection):
            raise ValidationError("unique_opts: states must be state names or a bit mask")
        bad = sorted(str(s) for s in states if s not in JOB_STATES)
        if bad:
            raise ValidationError(f"unique_opts: unknown states {bad}")
    return unique


def unique_key(kind: str, queue: str, args_json: str, unique: Unique) -> bytes:
    """awa-pg's key: BLAKE3 of the kind, then NUL and the queue (``by_queue``), NUL and the
    args' JSON text (``by_args``), NUL and ``by_period`` as 8 little-endian bytes, cut to 16."""
    hasher = blake3(kind.encode())
    if unique.by_queue:
        hasher.update(b"\x00" + queue.encode())
    if unique.by_args:
        hasher.update(b"\x00" + args_json.encode())
    if unique.by_period is not None:
        hasher.update(b"\x00" + unique.by_period.to_bytes(8, "little", signed=True))
    return hasher.digest(length=16)


def states_bits(unique: Unique) -> str:
    """The ``BIT(8)`` text of the states mask: bit N of the mask at position N."""
    mask = unique.mask()
    return "".join("1" if mask & (1 << n) else "0" for n in range(8))
