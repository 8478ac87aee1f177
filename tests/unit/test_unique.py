"""The JSON text of job args and the unique key, as awa-pg 0.6.9 writes them.

The texts below are those whose keys matched the keys awa-pg itself wrote on a real cluster
(tests/integration/test_enqueue_unique.py checks them against awa-pg live); here they pin the
rules without a database.
"""

from __future__ import annotations

import pytest
from blake3 import blake3

from awa_sa.errors import ValidationError
from awa_sa.unique import Unique, states_bits, to_json, unique_key, unique_of

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
