"""awa-sa's callback signing against awa-pg 0.6.9's own ``awa.callback_contract``.

awa-sa writes the scheme itself (docs/callbacks.md#signatures), so each function is run here
beside awa-pg's of the same name on a corpus chosen for where a rewrite would drift: secrets of
every length round 32, ids with non-ASCII, control and URL characters, signatures in either
case, tampered at each position, cut, padded or in other scripts' digits, and URLs whose bases
and prefixes carry slashes and whitespace (the prefix's trim swept over every code point). The
same answer, or the same exception (``ValidationError`` for awa-pg's ``ValueError``, whose
subclass it is). The pinned vector and the docstring examples run without awa-pg; the rest is
skipped where awa-pg is not installed.
"""

from __future__ import annotations

import doctest
import hashlib
import itertools
import types
import unicodedata
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import awa_sa
from awa_sa.callbacks import signing
from awa_sa.core.errors import ValidationError

# Awa's own pinned vector (awa-model's callback_contract tests): secret [7; 32], id "abc".
PINNED = "b1495225f01fa8cd09e410d288d09b68c1cc9fb2414686c0d3ac13fc905497d9"

SECRETS = [
    bytes(32),
    b"\xff" * 32,
    bytes([7] * 32),
    bytes(range(32)),
    hashlib.sha256(b"awa-sa").digest(),
    bytes.fromhex("00" * 31 + "01"),
]
BAD_SECRETS = [b"", b"k", bytes(16), bytes(31), bytes(33), bytes(64)]
IDS = [
    "550e8400-e29b-41d4-a716-446655440000",
    "550E8400-E29B-41D4-A716-446655440000",
    "abc",
    "",
    " ",
    "é",
    "e\u0301",  # the same é, decomposed: other bytes, another signature
    "日本語",
    "\U0001f600",
    "\U0010ffff",
    "\x00",
    "a\nb",
    "a/b",
    "../x",
    "%2F",
    "?x=1#y",
    "x" * 10_000,
]
ACTIONS = ["complete", "fail", "heartbeat", "resume", "retry", "", "Complete", "a b", "é"]
BASES = [
    "https://awa.example.com",
    "https://awa.example.com/",
    "https://awa.example.com///",
    "http://127.0.0.1:8080/mounted/",
    "",
    "/",
    " https://h/ ",
    "https://h/\t",
]
PREFIXES = [
    awa_sa.CALLBACK_DEFAULT_PATH_PREFIX,
    "",
    " ",
    "/",
    "//",
    "cb",
    "/cb",
    "cb/",
    "/cb/",
    "//cb//",
    " /cb/ ",
    "\t/cb\n",
    "/jobs/v1/callbacks/",
    "a b",
    "cb/ /",
    "\x1c/cb\x1f",
    "\u3000cb\u3000",
    "/cb/\u00a0",
    "\u200b/cb",
]


@pytest.fixture(scope="module")
def awa_pg() -> types.ModuleType:
    module: types.ModuleType = pytest.importorskip(
        "awa.callback_contract", reason="awa-pg is not installed"
    )
    return module


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, object]:
    """What a call answers, or the kind of exception it raises (and a ValueError's words)."""
    try:
        return ("answer", call(*args))
    except UnicodeEncodeError:
        return ("raise", UnicodeEncodeError)
    except TypeError:
        return ("raise", TypeError)
    except ValueError as refused:
        return ("raise", str(refused))


def test_the_pinned_vector_and_the_constants() -> None:
    """Awa's own vector, so the scheme is pinned where awa-pg is not installed too."""
    assert awa_sa.sign_callback(bytes([7] * 32), "abc") == PINNED
    assert awa_sa.verify_callback(bytes([7] * 32), "abc", PINNED)
    assert awa_sa.CALLBACK_SIGNATURE_HEADER == "X-Awa-Signature"
    assert awa_sa.CALLBACK_DEFAULT_PATH_PREFIX == "/api/callbacks"
    assert awa_sa.CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS == 3600.0


def test_the_docstring_examples_run() -> None:
    finder = doctest.DocTestFinder(exclude_empty=True)
    examples = [test for test in finder.find(signing) if test.examples]
    assert {test.name.rpartition(".")[2] for test in examples} == {
        "sign_callback",
        "build_callback_url",
    }
    for example in examples:
        runner = doctest.DocTestRunner()
        runner.run(example)
        assert (runner.failures, runner.tries) == (0, len(example.examples)), example.name


def test_the_constants_are_awa_pgs(awa_pg: types.ModuleType) -> None:
    assert awa_sa.CALLBACK_SIGNATURE_HEADER == awa_pg.SIGNATURE_HEADER
    assert awa_sa.CALLBACK_DEFAULT_PATH_PREFIX == awa_pg.DEFAULT_PATH_PREFIX
    assert awa_sa.CALLBACK_DEFAULT_HEARTBEAT_TIMEOUT_SECS == awa_pg.DEFAULT_HEARTBEAT_TIMEOUT_SECS
    assert awa_pg.sign(bytes([7] * 32), "abc") == PINNED


@pytest.mark.parametrize("secret", SECRETS, ids=lambda s: s[:2].hex())
def test_signatures_are_awa_pgs(awa_pg: types.ModuleType, secret: bytes) -> None:
    for callback_id in IDS:
        signature = awa_sa.sign_callback(secret, callback_id)
        assert signature == awa_pg.sign(secret, callback_id), callback_id
        assert signature == signature.lower()
        assert len(signature) == 64


def signatures_to_check(secret: bytes, callback_id: str) -> list[str]:
    """The right signature in each case, and every way a header may be wrong."""
    right = signing.sign_callback(secret, callback_id)
    flipped = [
        right[:at] + format(int(right[at], 16) ^ bit, "x") + right[at + 1 :]
        for at in (0, 1, 31, 32, 62, 63)
        for bit in (1, 8)
    ]
    other_secret = bytes(byte ^ 1 for byte in secret)
    return [
        right,
        right.upper(),
        right[:32] + right[32:].upper(),
        *flipped,
        right[:-1],
        right + "0",
        right + right,
        "",
        " " + right[1:],
        right[:-1] + " ",
        right + "\n",
        "0x" + right[2:],
        right[:-2] + "é",  # 63 characters, 64 bytes
        right[:-1] + "\u0660",  # ARABIC-INDIC DIGIT ZERO
        right[:-1] + "\uff10",  # FULLWIDTH DIGIT ZERO
        right[:-1] + "g",
        "g" * 64,
        "-" + right[1:],
        signing.sign_callback(secret, callback_id + "x"),
        signing.sign_callback(other_secret, callback_id),
        "00" * 32,
    ]


@pytest.mark.parametrize("secret", SECRETS, ids=lambda s: s[:2].hex())
def test_verification_is_awa_pgs(awa_pg: types.ModuleType, secret: bytes) -> None:
    seen = set()
    for callback_id in IDS:
        for signature in signatures_to_check(secret, callback_id):
            ours = awa_sa.verify_callback(secret, callback_id, signature)
            assert ours is awa_pg.verify(secret, callback_id, signature), (callback_id, signature)
            seen.add(ours)
    assert seen == {True, False}


def test_the_refusals_are_awa_pgs(awa_pg: types.ModuleType) -> None:
    """The same exception, in the same order: every argument's type, then the secret's length."""
    sig = "00" * 32
    calls: list[tuple[str, tuple[object, ...]]] = [
        *(("sign", (secret, "abc")) for secret in BAD_SECRETS),
        *(("verify", (secret, "abc", sig)) for secret in BAD_SECRETS),
        *(("verify", (secret, "abc", "not hex")) for secret in BAD_SECRETS),
        ("sign", (bytearray(32), "abc")),
        ("sign", (memoryview(bytes(32)), "abc")),
        ("sign", ("x" * 32, "abc")),
        ("sign", (None, "abc")),
        ("sign", (bytes(32), None)),
        ("sign", (bytes(32), 5)),
        ("sign", (bytes(32), b"abc")),
        ("sign", (bytes(32), "a\ud800")),
        ("sign", (bytes(1), "a\ud800")),
        ("sign", (bytes(1), None)),
        ("verify", (bytes(32), "abc", None)),
        ("verify", (bytes(32), "abc", sig.encode())),
        ("verify", (bytes(32), "abc", "\udfff" + sig[1:])),
        ("verify", (bytes(32), "a\ud800", sig)),
        ("verify", (bytes(1), "abc", None)),
        ("verify", (bytes(1), "abc", "\ud800")),
        ("verify", (bytearray(1), None, None)),
    ]
    ours: dict[str, Callable[..., object]] = {
        "sign": awa_sa.sign_callback,
        "verify": awa_sa.verify_callback,
    }
    for name, args in calls:
        expected = outcome(getattr(awa_pg, name), *args)
        assert expected[0] == "raise", (name, args)
        assert outcome(ours[name], *args) == expected, (name, args)
    with pytest.raises(ValidationError, match=r"exactly 32 bytes \(got 31\)"):
        awa_sa.verify_callback(bytes(31), "abc", sig)


def test_subclasses_of_bytes_and_str_are_read_as_their_values(awa_pg: types.ModuleType) -> None:
    class Secret(bytes):
        pass

    class Text(str):
        def __str__(self) -> str:
            return "not the value"

    secret, callback_id = Secret(range(32)), Text("abc")
    signature = awa_sa.sign_callback(secret, callback_id)
    assert signature == awa_pg.sign(secret, callback_id)
    assert awa_sa.verify_callback(secret, callback_id, Text(signature))
    url = awa_sa.build_callback_url(Text("https://h/"), Text("cb"), callback_id, Text("fail"))
    assert url == awa_pg.build_callback_url(
        Text("https://h/"), Text("cb"), callback_id, Text("fail")
    )
    assert type(url) is str


def test_urls_are_awa_pgs(awa_pg: types.ModuleType) -> None:
    for base, prefix, callback_id, action in itertools.product(
        BASES, PREFIXES, [*IDS[:8], "a/b", "?x=1#y"], ACTIONS
    ):
        args = (base, prefix, callback_id, action)
        assert awa_sa.build_callback_url(*args) == awa_pg.build_callback_url(*args), args
    assert (
        awa_sa.build_callback_url("https://h/", "/api/callbacks/", "id", "complete")
        == "https://h/api/callbacks/id/complete"
    )


def test_the_prefix_loses_what_awa_pg_trims_and_nothing_else(awa_pg: types.ModuleType) -> None:
    """Every code point as a lone prefix: those awa-pg trims away (Unicode's White_Space and
    the slash), and the ones a rewrite would be tempted to trim too (``str.isspace``, the
    separators, the format and control characters), give awa-pg's URL."""
    points = (chr(p) for p in range(0x110000) if not 0xD800 <= p <= 0xDFFF)
    trimmed, candidates = set(), set()
    for ch in points:
        if awa_pg.build_callback_url("", ch, "i", "a") == "/i/a":
            trimmed.add(ch)
        if ch.isspace() or unicodedata.category(ch) in ("Zs", "Zl", "Zp", "Cc", "Cf"):
            candidates.add(ch)
    assert len(trimmed) == 26  # 25 White_Space characters and "/"
    for ch in sorted(trimmed | candidates):
        for prefix in (ch, f"{ch}cb{ch}", f"{ch}/cb/{ch}", f"/cb{ch}/"):
            ours = awa_sa.build_callback_url("b", prefix, "i", "a")
            assert ours == awa_pg.build_callback_url("b", prefix, "i", "a"), hex(ord(ch))


def test_url_refusals_are_awa_pgs(awa_pg: types.ModuleType) -> None:
    for args in [
        (None, "p", "i", "a"),
        ("b", None, "i", "a"),
        ("b", "p", 5, "a"),
        ("b", "p", "i", b"a"),
        ("b\ud800", "p", "i", "a"),
        ("b", "p", "i", "\udc00"),
        ("b\ud800", None, "i", "a"),
    ]:
        expected = outcome(awa_pg.build_callback_url, *args)
        assert expected[0] == "raise", args
        assert outcome(awa_sa.build_callback_url, *args) == expected, args


@settings(max_examples=150, deadline=None)
@given(
    secret=st.binary(min_size=32, max_size=32),
    callback_id=st.text(),
    signature=st.text(alphabet="0123456789abcdefABCDEFg x", max_size=70) | st.text(),
)
def test_any_text_is_answered_as_awa_pg_answers_it(
    secret: bytes, callback_id: str, signature: str
) -> None:
    contract = pytest.importorskip("awa.callback_contract", reason="awa-pg is not installed")
    right = awa_sa.sign_callback(secret, callback_id)
    assert right == contract.sign(secret, callback_id)
    for given_signature in (signature, right, right.upper(), signature + right[len(signature) :]):
        assert awa_sa.verify_callback(secret, callback_id, given_signature) is contract.verify(
            secret, callback_id, given_signature
        )


@settings(max_examples=300, deadline=None)
@given(base=st.text(), prefix=st.text(), callback_id=st.text(), action=st.text())
def test_any_url_is_awa_pgs(base: str, prefix: str, callback_id: str, action: str) -> None:
    contract = pytest.importorskip("awa.callback_contract", reason="awa-pg is not installed")
    args = (base, prefix, callback_id, action)
    assert awa_sa.build_callback_url(*args) == contract.build_callback_url(*args)
