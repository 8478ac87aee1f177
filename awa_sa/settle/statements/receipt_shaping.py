"""The payload of the job's next row after a queue-storage settle, as the runtime shapes it.

The runtime's error entry for a cancel or a failure (``"terminal": true`` when it ends the
job), or the caller's for a re-schedule; then metadata, tags, errors and progress, each kept
only when it says something (docs/contract.md#receipts).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    case,
    cast,
    func,
    null,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB

from awa_sa.core.sql import (
    EMPTY_ARRAY,
    EMPTY_OBJECT,
    concat,
)
from awa_sa.settle.statements.endings import rfc3339
from awa_sa.settle.statements.receipt_targets import (
    json_key,
    tagged,
    text_literal,
)


def _entry(taken: CTE) -> ColumnElement[Any]:
    """The error entry the settle appends, or NULL: the runtime's for a cancel or a failure
    (``"terminal": true`` when it ends the job), the caller's for a re-schedule."""
    t = taken.c
    text = case((tagged(taken, "cancel"), text_literal("cancelled: ") + t.message), else_=t.message)
    built = func.jsonb_build_object(
        text_literal("error"),
        text,
        text_literal("attempt"),
        t.attempt,
        text_literal("at"),
        rfc3339(func.now()),
        type_=JSONB,
    )
    terminal = func.jsonb_build_object(text_literal("terminal"), true(), type_=JSONB)
    flag = case((t.next_state == text_literal("failed"), terminal), else_=EMPTY_OBJECT)
    return case(
        (tagged(taken, "cancel", "fail", "fail_terminal"), concat(built, flag)),
        else_=cast(t.error, JSONB),
    )


def shaped_rows(taken: CTE, flushed: CTE) -> CTE:
    """*taken* with the payload of the job's next row: the runtime's metadata, tags, errors
    and progress, each only when not empty (a completion drops the progress)."""
    entered = (
        select(*taken.c, _entry(taken).label("entry"), flushed.c.progress.label("flushed"))
        .select_from(taken.outerjoin(flushed, true()))
        .subquery("entered")
    )
    e = entered.c
    errors = case(
        (e.entry.is_(None), json_key(e.ready_payload, "errors", EMPTY_ARRAY)),
        else_=concat(
            json_key(e.ready_payload, "errors", EMPTY_ARRAY),
            func.jsonb_build_array(e.entry, type_=JSONB),
        ),
    )
    given = func.nullif(cast(e.new_progress, JSONB), cast(text_literal("null"), JSONB), type_=JSONB)
    progress = case(
        (tagged(entered, "complete"), cast(null(), JSONB)),
        else_=func.coalesce(given, e.flushed, type_=JSONB),
    )
    metadata = json_key(e.ready_payload, "metadata", EMPTY_OBJECT)
    tags = json_key(e.ready_payload, "tags", EMPTY_ARRAY)

    def part(key: str, value: ColumnElement[Any], empty: ColumnElement[Any]) -> Any:
        obj = func.jsonb_build_object(text_literal(key), value, type_=JSONB)
        return case((func.coalesce(value, empty, type_=JSONB) != empty, obj), else_=EMPTY_OBJECT)

    parts = select(
        *(c for c in entered.c if c.name != "entry"),
        metadata.label("p_metadata"),
        tags.label("p_tags"),
        errors.label("p_errors"),
        progress.label("p_progress"),
    ).subquery("parts")
    p = parts.c
    payload = concat(
        part("metadata", p.p_metadata, EMPTY_OBJECT),
        part("tags", p.p_tags, EMPTY_ARRAY),
        part("errors", p.p_errors, EMPTY_ARRAY),
        part("progress", p.p_progress, cast(text_literal("null"), JSONB)),
    )
    keep = [c for c in parts.c if not c.name.startswith("p_")]
    return select(*keep, payload.label("payload")).cte("shaped")
