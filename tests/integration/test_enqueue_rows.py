"""The typed row ``enqueue`` answers is the row Awa stored, read back field by field.

The statement sends back only what the client cannot know (the id, ``run_at`` and
``created_at`` the producer function stamped, ``args`` and ``metadata`` as stored); the rest of
an ``EnqueuedJob`` is what awa-sa sent. On each plane, for one job at a time and for a batch,
every field is compared here with what the tables hold, value and type, with tags that a
``text[]`` literal must quote (quotes, backslashes, braces, commas, spaces, the word NULL, the
empty string, non-ASCII) and JSON whose stored form differs from the text sent (exponents,
integers beyond 64 bits, negative zero). On queue storage a batch's payload leaves out empty
metadata (awa-pg's ``enqueue_many_copy`` stores none), which Awa's runtime reads as ``{}``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster
from enqueuing import JOBS

import awa_sa

ROWS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    *JOBS,
    (
        {"s": 'q"b\\', "t": "{x}"},
        {"kind": "quoted", "tags": ['a"b', "c\\d", "{e}", "f,g", " h ", "NULL", "", "ü", "null"]},
    ),
    (
        {"f": 1e16, "g": 1.5e-7, "big": 2**64, "neg": -0.0, "e": 1e-5},
        {"kind": "numbers", "metadata": {"x": 1e-5, "k": [1, {"é": None}], "y": 2.5e20}},
    ),
]
_COLUMNS = (
    "{id}, kind, queue, {state}, priority, attempt, max_attempts, run_at, created_at,"
    " args::text AS args, {metadata}::text AS metadata, {tags} AS tags, unique_key"
)
_QS = _COLUMNS.format(
    id="job_id AS id",
    state="{state}",
    metadata="COALESCE(payload -> 'metadata', '{{}}')",
    tags="ARRAY(SELECT jsonb_array_elements_text(payload -> 'tags'))",
)
STORED = {
    "canonical": "SELECT "
    + _COLUMNS.format(id="id", state="state::text AS state", metadata="metadata", tags="tags")
    + " FROM awa.jobs WHERE id = ANY(:ids)",
    "active": "SELECT "
    + _QS.format(state="'available' AS state")
    + " FROM awa_qs.ready_entries WHERE job_id = ANY(:ids) UNION ALL SELECT "
    + _QS.format(state="state::text AS state")
    + " FROM awa_qs.deferred_jobs WHERE job_id = ANY(:ids)",
}


def _fields(row: Any) -> dict[str, Any]:
    """A stored row or an answer as the same dict, JSON read, arrays and bytes made plain."""
    if isinstance(row, awa_sa.EnqueuedJob):
        values = {field.name: getattr(row, field.name) for field in dataclasses.fields(row)}
    else:
        values = dict(row._mapping)
    for name in ("args", "metadata"):
        if isinstance(values[name], str):
            values[name] = json.loads(values[name])
    values["tags"] = list(values["tags"])
    if values["unique_key"] is not None:
        values["unique_key"] = bytes(values["unique_key"])
    return values


def _typed(value: Any) -> Any:
    """*value* with the type of every part beside it, so that ``1 == 1.0`` does not pass."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


ESCAPED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"s": "\\u0000 is six characters", "n": 1}, {"kind": "escaped"}),
    ({"n": 2.5}, {"kind": "escaped"}),
]
"""A text that only looks like an escaped NUL in JSON: a batch's one-text check declines it,
and the batch's args then go as texts (the same stored values)."""


@pytest.mark.parametrize("rows", [ROWS, ESCAPED], ids=["rows", "escaped"])
def test_the_answer_is_the_stored_row(
    real_plane: Cluster, rows: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    engine = real_plane.engine
    with engine.connect() as conn:
        singles = [awa_sa.enqueue(conn, args, **options) for args, options in rows]
        conn.commit()
    batch = awa_sa.enqueue_many(
        engine,
        [awa_sa.NewJob({**args, "batch": True}, **options) for args, options in rows],
        on_duplicate="skip",
    )
    # And each job's args again as a list under its keywords: the batch shape that binds the
    # keywords once (where only the args differ), or objects (where its args or key differ).
    shared = [
        row
        for args, options in rows
        for row in awa_sa.enqueue_many(
            engine, [{**args, "shared": n} for n in range(2)], on_duplicate="skip", **options
        )
        if isinstance(row, awa_sa.EnqueuedJob)
    ]
    answered = [
        *singles,
        *(row for row in batch if isinstance(row, awa_sa.EnqueuedJob)),
        *shared,
    ]
    assert len(answered) > len(rows)  # the batch's non-unique jobs at least
    with engine.connect() as conn:
        routed = conn.execute(sa.text("SELECT awa.active_queue_storage_schema()")).scalar()
        plane = "canonical" if routed is None else "active"
        stored = conn.execute(sa.text(STORED[plane]), {"ids": [r.id for r in answered]}).all()
    by_id = {row.id: _fields(row) for row in stored}
    assert len(by_id) == len(answered)
    for job in answered:
        assert _typed(_fields(job)) == _typed(by_id[job.id])
