"""Property-based: for any JSON shape, awa-sa's unique key and args are awa-pg's, byte for byte.

Hypothesis draws args (nested objects and arrays, unicode keys and strings with control
characters and astral code points, integers at and beyond the 64-bit bounds, floats of every
magnitude, subnormals, negative zero), kinds, queues and unique options. awa-pg 0.6.9's
``Client.insert`` writes each job on a real cluster; the key it stored must equal
:func:`awa_sa.core.unique_keys.unique_key` over :func:`awa_sa.core.unique_keys.to_json`, and that
text cast to ``jsonb`` must equal the args it stored. Examples never conflict: each carries its own
number.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from runtimes import pg_url

from awa_sa.core.unique_keys import Unique, to_json, unique_key

SETTINGS = settings(
    max_examples=int(os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=not os.environ.get("AWA_SA_HYPOTHESIS_EXAMPLES"),
)
TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12)
FLOATS = st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda f: abs(f) < 1.7e308  # awa-pg cannot read its own row back beyond that
)
INTS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(2**63, 2**70),
    st.integers(-(2**70), -(2**63) - 1),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
UNIQUES = st.builds(
    Unique,
    by_args=st.booleans(),
    by_queue=st.booleans(),
    by_period=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    states=st.integers(0, 255),
)
NAMES = st.text(
    st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), min_size=1, max_size=20
)


@pytest.fixture
def awa_pg(real_db_url: str) -> Iterator[tuple[awa.Client, sa.Engine]]:
    client = awa.Client(pg_url(real_db_url))
    engine = sa.create_engine(real_db_url, poolclass=sa.NullPool)
    yield client, engine
    client.close()
    engine.dispose()


_serial = itertools.count()


@SETTINGS
@given(value=VALUES, kind=NAMES, queue=NAMES, unique=UNIQUES)
@example(value={"b": [1e16, 1e-7, -0.0, 5e-324]}, kind="k", queue="q", unique=Unique())
@example(value={"é": "\u2028\x1f\x7f😀", "E": 2**64}, kind="Ω", queue="q", unique=Unique())
def test_keys_and_args_are_awa_pgs(
    awa_pg: tuple[awa.Client, sa.Engine], value: Any, kind: str, queue: str, unique: Unique
) -> None:
    client, engine = awa_pg
    args = {"serial": next(_serial), "value": value}
    opts = {
        "by_args": unique.by_args,
        "by_queue": unique.by_queue,
        "states": unique.mask(),
        **({} if unique.by_period is None else {"by_period": unique.by_period}),
    }
    if not unique.by_args:  # the key would not tell examples apart
        opts["by_period"] = next(_serial)
        unique = Unique(unique.by_args, unique.by_queue, opts["by_period"], unique.states)
    job = client.insert(args, kind=kind, queue=queue, unique_opts=opts)
    text = to_json(args)
    with engine.connect() as conn:
        stored_key, same_args = conn.execute(
            sa.text("SELECT unique_key, args = CAST(:text AS jsonb) FROM awa.jobs WHERE id = :id"),
            {"text": text, "id": job.id},
        ).one()
    assert bytes(stored_key) == unique_key(kind, queue, text, unique), text
    assert same_args, text
