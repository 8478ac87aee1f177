"""The signed callback a receiver checks: awa-pg 0.6.9's ``awa.callback_contract``.

Awa's HTTP worker posts a job to a function endpoint with the URL to call back on and, when
it holds a secret, the callback id's signature in the ``X-Awa-Signature`` header; the
function sends the header back with its callback, and the receiver checks it before it ends
the wait. A receiver that ends waits through awa-sa should not need awa-pg's extension
module only to check that header, so the scheme is written here from Awa's documented one
(docs/callbacks.md#signatures): the BLAKE3 keyed hash of the callback id's UTF-8 bytes under
the 32-byte secret, as 64 lowercase hex digits.

Each function answers, refuses and raises as awa-pg's of the same name does (its
``sign_callback``, ``verify_callback``, ``build_callback_url``), and
``tests/unit/test_callback_signing.py`` checks them against awa-pg's own on a corpus. They
touch no database, so they have no async twin.
"""

from __future__ import annotations

import hmac

from blake3 import blake3

from awa_sa.core.errors import ValidationError

CALLBACK_SIGNATURE_HEADER = "X-Awa-Signature"
"""The request header that carries a callback's signature."""

CALLBACK_DEFAULT_PATH_PREFIX = "/api/callbacks"
"""Where ``awa serve`` and Awa's own receivers mount the callback routes."""

CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS = 3600.0
"""The timeout a heartbeat request without ``timeout_seconds`` asks for."""

SECRET_BYTES = 32
"""A BLAKE3 key's length: awa-pg refuses any other secret rather than derive a key from it."""

_HEX = frozenset(b"0123456789abcdefABCDEF")
"""What Awa's hex reader takes: either case, no prefix, no whitespace."""

_RUST_WHITESPACE = "".join(
    chr(point)
    for point in (
        *range(0x09, 0x0E),
        0x20,
        0x85,
        0xA0,
        0x1680,
        *range(0x2000, 0x200B),
        0x2028,
        0x2029,
        0x202F,
        0x205F,
        0x3000,
    )
)
"""Unicode's ``White_Space`` characters, which Awa trims off a prefix. ``str.strip()`` would
trim U+001C to U+001F too, which Awa keeps."""


def sign_callback(secret: bytes, callback_id: str) -> str:
    """The signature of *callback_id* under *secret* (32 bytes), as the worker sends it.

    A receiver rarely signs; its tests do, to send what Awa's worker sends::

        >>> from awa_sa import sign_callback, verify_callback
        >>> secret = bytes(range(32))
        >>> signature = sign_callback(secret, "abc")
        >>> signature
        '6da54495d8152f2bcba87bd7282df70901cdb66b4448ed5f4c7bd2852b8b5532'
        >>> verify_callback(secret, "abc", signature), verify_callback(secret, "abd", signature)
        (True, False)
    """
    key = _key(secret)
    message = _utf8(callback_id, "callback_id")
    return blake3(message, key=_checked(key)).hexdigest()


def verify_callback(secret: bytes, callback_id: str, signature: str) -> bool:
    """Whether *signature* is *callback_id*'s under *secret*, compared in constant time.

    A signature that is not 64 hex digits (either case) is ``False``, never an error, so a
    forged header is answered like a wrong one. A *secret* that is not 32 ``bytes`` raises,
    as awa-pg's does: that is the receiver's configuration, not the caller's input.
    """
    key = _key(secret)
    message = _utf8(callback_id, "callback_id")
    given = _utf8(signature, "signature")
    expected = blake3(message, key=_checked(key)).digest()
    if len(given) != 2 * len(expected) or not _HEX.issuperset(given):
        return False
    return hmac.compare_digest(bytes.fromhex(given.decode("ascii")), expected)


def build_callback_url(base: str, prefix: str, callback_id: str, action: str) -> str:
    """``{base}{prefix}/{callback_id}/{action}``, as the worker builds the URL it hands out.

    *base* loses its trailing slashes; *prefix* its surrounding whitespace and trailing
    slashes, and gains a leading slash unless empty; *callback_id* and *action*
    (``"complete"``, ``"fail"``, ``"heartbeat"``) go in as given, unescaped::

        >>> from awa_sa import CALLBACK_DEFAULT_PATH_PREFIX, build_callback_url
        >>> build_callback_url("https://hooks.example/", CALLBACK_DEFAULT_PATH_PREFIX, "42", "fail")
        'https://hooks.example/api/callbacks/42/fail'
    """
    base, prefix = _text(base, "base"), _text(prefix, "prefix")
    callback_id, action = _text(callback_id, "callback_id"), _text(action, "action")
    trimmed = prefix.strip(_RUST_WHITESPACE).rstrip("/")
    if trimmed and not trimmed.startswith("/"):
        trimmed = f"/{trimmed}"
    return f"{base.rstrip('/')}{trimmed}/{callback_id}/{action}"


def _key(secret: bytes) -> bytes:
    if not isinstance(secret, bytes):
        raise TypeError(f"secret: {type(secret).__name__!r} object is not an instance of 'bytes'")
    return bytes(secret)


def _checked(key: bytes) -> bytes:
    """The secret's length, checked after every argument's type, in awa-pg's order."""
    if len(key) != SECRET_BYTES:
        raise ValidationError(
            f"callback secret must be exactly {SECRET_BYTES} bytes (got {len(key)})"
        )
    return key


def _text(value: str, name: str) -> str:
    """A text argument as a plain ``str``, its UTF-8 checked as awa-pg's conversion does."""
    _utf8(value, name)
    return str.__str__(value)


def _utf8(value: str, name: str) -> bytes:
    """A text argument's UTF-8 bytes: a lone surrogate raises ``UnicodeEncodeError``, as the
    conversion into awa-pg's Rust strings does."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: {type(value).__name__!r} object is not an instance of 'str'")
    return value.encode("utf-8")
