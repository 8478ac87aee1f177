"""enqueue's input checks: a clear ValidationError before any connection is even made.

The engine here points at nothing that listens, so reaching the database at all would raise a
DatabaseError instead; every refusal below is therefore made before any statement.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

import awa_sa
from awa_sa import NewJob, ValidationError
from awa_sa.enqueue.api import prepare_batch
from awa_sa.enqueue.kind_names import derive_kind
from awa_sa.enqueue.new_jobs import batch_of, prepare


@pytest.fixture
def nowhere() -> Iterator[sa.Engine]:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:9/none")
    yield engine
    engine.dispose()


@dataclass
class Point:
    x: int


BAD: list[tuple[Any, dict[str, Any], str]] = [
    ([1], {}, "args must be"),
    ("text", {}, "args must be"),
    ({"a": 1}, {"kind": "k" * 201}, "kind must be 1 to 200"),
    ({"a": 1}, {"kind": ""}, "kind must be 1 to 200"),
    ({"a": 1}, {"kind": 3}, "kind must be a str"),
    ({"a": 1}, {"queue": "q" * 201}, "queue must be 1 to 200"),
    ({"a": 1}, {"queue": "a\x00b"}, "NUL"),
    ({"a": 1}, {"priority": 0}, "priority"),
    ({"a": 1}, {"priority": 5}, "priority"),
    ({"a": 1}, {"priority": True}, "priority"),
    ({"a": 1}, {"max_attempts": 0}, "max_attempts"),
    ({"a": 1}, {"max_attempts": 1001}, "max_attempts"),
    ({"a": 1}, {"tags": [str(n) for n in range(21)]}, "at most 20 tags"),
    ({"a": 1}, {"tags": "one"}, "tags must be a list"),
    ({"a": 1}, {"tags": ["a\x00"]}, "NUL"),
    ({"a": "x\x00"}, {}, "NUL"),
    ({"a": float("nan")}, {}, "no JSON form"),
    ({"a": datetime(2020, 1, 1)}, {}, "cannot be written as JSON"),
    ({"a": 1}, {"metadata": {"m": float("inf")}}, "metadata"),
    ({"a": 1}, {"metadata": [1]}, "metadata must be a dict"),
    ({"a": 1}, {"run_at": datetime(2030, 1, 1)}, "timezone-aware"),
    ({"a": 1}, {"run_at": "2030-01-01T00:00:00"}, "timezone-aware"),
    ({"a": 1}, {"run_at": "soon"}, "ISO 8601"),
    ({"a": 1}, {"unique_opts": {"by_arg": True}}, "unknown keys"),
    ({"a": 1}, {"ordering_key": 7}, "ordering_key"),
    (Point, {}, "args must be"),
]


@pytest.mark.parametrize(("args", "options", "message"), BAD)
def test_bad_input_is_refused_before_any_statement(
    nowhere: sa.Engine, args: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        awa_sa.enqueue(nowhere, args, **options)


def test_a_batch_names_the_refused_job(nowhere: sa.Engine) -> None:
    jobs = [NewJob({"a": 1}), NewJob({"a": 1}, priority=9)]
    with pytest.raises(ValidationError, match=r"jobs\[1\]: priority"):
        awa_sa.enqueue_many(nowhere, jobs)
    with pytest.raises(ValidationError, match="on_duplicate"):
        awa_sa.enqueue_many(nowhere, jobs[:1], on_duplicate="ignore")  # type: ignore[call-overload]
    with pytest.raises(ValidationError, match=r"jobs\[0\]: args must be"):
        awa_sa.enqueue_many(nowhere, [1])
    assert awa_sa.enqueue_many(nowhere, []) == []


@pytest.mark.parametrize(
    ("items", "options", "message"),
    [
        ([{"a": 1}, 2], {}, r"jobs\[1\]: args must be"),
        ([{"a": 1}, {"a": "x\x00"}], {}, r"jobs\[1\]: .*NUL"),
        ([{"a": 1}, {"a": 2}], {"priority": 9}, "priority"),
        ([{"a": 1}, {"a": 2}], {"unique_opts": {"by": 1}}, "unique_opts"),
        ([NewJob({"a": 1}), {"a": 2}], {"queue": "q"}, r"jobs\[0\]: a NewJob carries"),
        ([{"a": 1}, NewJob({"a": 2})], {"queue": "q"}, r"jobs\[1\]: a NewJob carries"),
    ],
)
def test_a_batch_of_args_is_checked_like_single_jobs(
    nowhere: sa.Engine, items: list[Any], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        awa_sa.enqueue_many(nowhere, items, **options)


def test_a_batch_takes_only_enqueues_keywords(nowhere: sa.Engine) -> None:
    with pytest.raises(TypeError, match=r"\['opts'\].*NewJob"):
        awa_sa.enqueue_many(nowhere, [{"a": 1}], opts=[None])  # type: ignore[call-overload]


@dataclass
class Other:
    y: int


@pytest.mark.parametrize(
    ("items", "options", "shape", "kinds"),
    [
        ([{"a": 1}, {"a": 2}], {"kind": "k"}, "shared", ["k", "k"]),
        ([Point(1), Point(2)], {"queue": "q", "tags": ["t"]}, "shared", ["point", "point"]),
        ([Point(1), {"a": 2}], {"kind": "p"}, "shared", ["p", "p"]),
        ([Point(1), Other(2)], {}, "objects", ["point", "other"]),
        ([{"a": 1}, {"f": 1e-7}], {}, "objects", ["dict", "dict"]),
        ([{"a": 1}, {"a": 2}], {"unique_opts": {}}, "objects", ["dict", "dict"]),
        ([{"a": 1}], {}, "one", ["dict"]),
        ([NewJob({"a": 1}), {"a": 2}], {}, "objects", ["dict", "dict"]),
    ],
)
def test_a_batch_of_args_shares_its_values_where_only_the_args_differ(
    items: list[Any], options: dict[str, Any], shape: str, kinds: list[str]
) -> None:
    batch = prepare_batch(items, "raise", options)
    assert (batch.shape, [job.kind for job in batch.jobs]) == (shape, kinds)
    if shape == "shared":
        assert json.loads(batch.text or "") == [
            item if isinstance(item, dict) else dataclasses.asdict(item) for item in items
        ]
        assert {job.queue for job in batch.jobs} == {options.get("queue", "default")}


@pytest.mark.parametrize(
    ("bad", "message"), [({"a": ["x\x00"]}, "NUL"), ({"k\ud800": 1}, "not valid Unicode")]
)
def test_a_batch_names_the_job_whose_args_its_one_text_refuses(
    nowhere: sa.Engine, bad: dict[str, Any], message: str
) -> None:
    # A batch checks its plain args for NUL and lone surrogates in its one JSON text, not
    # job by job: the refusal must still name the job, wherever it is.
    jobs = [NewJob({"a": n}) for n in range(5)]
    jobs[3] = NewJob(bad)
    with pytest.raises(ValidationError, match=rf"jobs\[3\]: .*{message}"):
        awa_sa.enqueue_many(nowhere, jobs)


def test_a_batch_sends_plain_args_as_values_and_the_rest_as_texts() -> None:
    plain = [prepare(NewJob({"a": n})) for n in range(2)]
    assert [job.args_text for job in batch_of(plain).jobs] == [None, None]
    # 1e-7 is written 1e-07 by the C encoder: that job's args go as awa-sa's own text.
    mixed = batch_of([*plain, prepare(NewJob({"f": 1e-7}))]).jobs
    assert [job.args_text for job in mixed] == [None, None, '{"f":1e-7}']
    # Six characters that look like an escaped NUL in the batch's text: all go as texts.
    looks = batch_of([*plain, prepare(NewJob({"s": "\\u0000"}))]).jobs
    assert [job.args_text for job in looks] == ['{"a":0}', '{"a":1}', '{"s":"\\\\u0000"}']
    assert [job.args for job in looks] == [None, None, None]


def test_a_bind_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValidationError, match="bind must be"):
        awa_sa.enqueue("postgresql://", {"a": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("SendEmail", "send_email"),
        ("SendConfirmationEmail", "send_confirmation_email"),
        ("SMTPEmail", "smtp_email"),
        ("OAuthRefresh", "o_auth_refresh"),
        ("PDFRenderJob", "pdf_render_job"),
        ("ProcessV2Import", "process_v2_import"),
        ("ReconcileQ3Revenue", "reconcile_q3_revenue"),
        ("HTMLToPDF", "html_to_pdf"),
        ("IOError", "io_error"),
        ("dict", "dict"),
        ("already_snake", "already_snake"),
    ],
)
def test_kind_is_derived_as_awa_pg_derives_it(name: str, kind: str) -> None:
    assert derive_kind(name) == kind
