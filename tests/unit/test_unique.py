"""The JSON text of job args and the unique key, as awa-pg 0.6.9 writes them.

The texts below are those whose keys matched the keys awa-pg itself wrote on a real cluster
(tests/integration/test_enqueue_unique.py checks them against awa-pg live); here they pin the
rules without a database.
"""

from __future__ import annotations

import enum
import os

import pytest
from blake3 import blake3
from hypothesis import example, given, settings
from hypothesis import strategies as st

from awa_sa.core.errors import ValidationError
from awa_sa.core.unique_keys import (
    Unique,
    encoded,
    states_bits,
    to_json,
    unique_key,
    unique_of,
    written,
)

TEXTS = [
    (1.0, "1.0"),
    (1e16, "1e+16"),
    (1.5e16, "1.5e+16"),
    (1e15, "1000000000000000.0"),
    (1e-5, "0.00001"),
    (1e-6, "1e-6"),
    (1e-7, "1e-7"),
    (123.456, "123.456"),
    (-0.0, "-0.0"),
    (2**63, "9.223372036854776e+18"),
    (-(2**63), "-9223372036854775808"),
    (2**63 - 1, "9223372036854775807"),
    (5e-324, "5e-324"),
    (1.7976931348623157e308, "1.7976931348623157e+308"),
    (100.0, "100.0"),
    (3.14159e-10, "3.14159e-10"),
    ('é\u2028\x01\x1f\x7f/<>&"\\', '"é\u2028\\u0001\\u001f\x7f/<>&\\"\\\\"'),
    ("\b\f\n\r\t", '"\\b\\f\\n\\r\\t"'),
    (
        {"b": 1, "a": [1, {"z": None, "é": True, "Z": False}]},
        '{"a":[1,{"Z":false,"z":null,"é":true}],"b":1}',
    ),
    ((1, "x"), '[1,"x"]'),
    (True, "true"),
]


@pytest.mark.parametrize(("value", "text"), TEXTS)
def test_text_is_serde_jsons(value: object, text: str) -> None:
    assert to_json(value) == text


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), "a\x00b", "\ud800", {1: "x"}, object(), 2**1100, b"bytes"],
)
def test_what_json_cannot_carry_is_refused(value: object) -> None:
    with pytest.raises(ValidationError):
        to_json({"v": value})


def test_nesting_deeper_than_awa_pg_allows_is_refused() -> None:
    deep: object = 1
    for _ in range(64):
        deep = [deep]
    assert to_json(deep).count("[") == 64
    with pytest.raises(ValidationError, match="nesting"):
        to_json([deep])


def test_key_layout() -> None:
    """kind, NUL + queue, NUL + args text, NUL + period as 8 little-endian bytes; 16 bytes."""
    unique = Unique(by_queue=True, by_period=7)
    data = b"k\x00q\x00" + b'{"a":1}' + b"\x00" + (7).to_bytes(8, "little")
    assert unique_key("k", "q", '{"a":1}', unique) == blake3(data).digest()[:16]
    assert unique_key("k", "q", "{}", Unique(by_args=False)) == blake3(b"k").digest()[:16]


def test_states_default_and_names() -> None:
    assert states_bits(Unique()) == "11111000"
    assert states_bits(Unique(states=0b1000_0001)) == "10000001"
    assert states_bits(Unique(states={"running", "failed"})) == "00100100"


@pytest.mark.parametrize(
    "opts",
    [
        {"by_arg": True},
        {"by_queue": 1},
        {"by_period": 1.5},
        {"by_period": 2**63},
        {"states": 256},
        {"states": ["done"]},
        {"states": "running"},
        ["by_args"],
    ],
)
def test_bad_unique_opts_are_refused(opts: object) -> None:
    with pytest.raises(ValidationError, match="unique_opts"):
        unique_of(opts)


class Level(enum.IntEnum):
    LOW = 1


KEYS = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["1", "-2", "true", "null", "1e-05", "\x00", "\ud800", 'a,"1']),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
)
ANY_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(10**17, 2**64),
    st.floats(),
    st.text(),
    st.sampled_from(["\x00", "\ud800", "\\u0000", "1e+16", Level.LOW, 2**63, 1e-5, -0.0]),
)
ANY_VALUE = st.recursive(
    ANY_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(KEYS, inner, max_size=4),
    ),
    max_leaves=16,
)


def _deep(levels: int) -> object:
    value: object = {"a": 1}
    for _ in range(levels - 1):
        value = [value]
    return value


@settings(
    max_examples=int(os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES", "400")),
    derandomize=not os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES"),
)
@given(ANY_VALUE)
@example({1: "x"})
@example({"b": [1, {"z": None, "é": True}], "a": 2**63})
@example(_deep(64))
@example(_deep(65))
@example({"k": float("nan")})
def test_the_c_encoders_text_is_taken_only_where_it_is_the_writers(value: object) -> None:
    """The short road gives the writer's text byte for byte, or steps aside; the writer alone
    refuses (so what it refuses, to_json refuses too)."""
    fast = encoded(value)
    try:
        text = written(value)
    except ValidationError:
        assert fast is None
        with pytest.raises(ValidationError):
            to_json(value)
        return
    assert fast is None or fast == text
    assert to_json(value) == text


@pytest.mark.parametrize(
    "value",
    [
        {"n": 1, "round": "r0", "to": "user1@example.com"},
        {"é": ["ü", 1.5, -0.0, None, True], "a": {"b": 123.456, "c": 9223372036854775807 // 10}},
        _deep(64),
    ],
)
def test_plain_json_takes_the_short_road(value: object) -> None:
    assert encoded(value) == written(value)
