"""New jobs as values: what ``awa_sa.enqueue`` takes, checks and answers.

:class:`NewJob` carries the same arguments, with the same defaults, as awa-pg 0.6.9's
``Client.insert``, so moving a call over is a rename. :func:`prepare` checks every one of them
against the limits Awa's producer function enforces (and what PostgreSQL cannot store), before
any statement, and encodes them for :mod:`awa_sa.enqueue.statements`. The kind of a job whose
``kind`` is not given is derived from its arguments' class name exactly as awa-pg derives it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from typing import Any, TypedDict

from awa_sa.core.errors import ValidationError
from awa_sa.core.unique_keys import (
    Unique,
    all_plain,
    plain,
    states_bits,
    stored_as_written,
    to_json,
    unique_key,
    unique_of,
)
from awa_sa.enqueue.kind_names import derive_kind
from awa_sa.enqueue.statements import (
    Batch,
    JobValues,
    args_array,
    batch_text,
    element,
    tags_literal,
)

MAX_NAME = 200
"""``awa.insert_job_compat``'s limit on a kind's and a queue's length, in characters."""
MAX_TAGS = 20
PRIORITIES = range(1, 5)
MAX_ATTEMPTS = range(1, 1001)


@dataclass(frozen=True, slots=True)
class NewJob:
    """One job for :func:`awa_sa.enqueue_many`: ``NewJob(args, **awa-pg's insert keywords)``.

    ``args`` is a dataclass, a pydantic model or a dict. ``kind`` defaults to the class name
    in snake case (a dict's is ``"dict"``, as in awa-pg). ``run_at`` (a timezone-aware datetime
    or an ISO 8601 text with an offset) makes the job ``scheduled``, even when it is in the
    past, as awa-pg does. ``unique_opts`` is awa-pg's dict or an :class:`~awa_sa.Unique`.
    """

    args: Any
    _: KW_ONLY
    kind: str | None = None
    queue: str = "default"
    priority: int = 2
    max_attempts: int = 25
    tags: Sequence[str] | None = None
    metadata: Mapping[str, Any] | None = None
    run_at: datetime | str | None = None
    unique_opts: Mapping[str, Any] | Unique | None = None
    ordering_key: bytes | str | None = None


class Options(TypedDict, total=False):
    """:class:`NewJob`'s keywords, which ``enqueue_many`` takes for the args of its batch (with
    :class:`NewJob`'s defaults, awa-pg's)."""

    kind: str | None
    queue: str
    priority: int
    max_attempts: int
    tags: Sequence[str] | None
    metadata: Mapping[str, Any] | None
    run_at: datetime | str | None
    unique_opts: Mapping[str, Any] | Unique | None
    ordering_key: bytes | str | None


@dataclass(frozen=True, slots=True)
class EnqueuedJob:
    """The new job's row as Awa's producer function answered it.

    ``state`` is ``available`` or ``scheduled``; ``attempt`` is 0. ``args`` and ``metadata``
    are read back from the stored JSON; ``unique_key`` is the 16-byte key, or None. ``tags``
    is a tuple, as the row is frozen: a list per row would also be one more object per job
    for the garbage collector to walk, and in a batch of thousands its full collections cost
    more than the rest of building the rows (docs/performance.md#enqueue).
    """

    id: int
    kind: str
    queue: str
    state: str
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    args: Any
    metadata: dict[str, Any]
    tags: tuple[str, ...]
    unique_key: bytes | None


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch position that ``on_duplicate="skip"`` left out: another job holds its key.

    ``existing_id`` is that job's id when it could be read (None if it settled in between).
    """

    kind: str
    unique_key: bytes
    existing_id: int | None


Prepared = JobValues
"""A checked job: its statement values, its key in hex (None when not unique) and its tags;
its args checked in full once :func:`batch_of` has seen them."""


def prepare(job: object) -> Prepared:
    """*job* checked and encoded, or a :class:`ValidationError` saying what is wrong.

    Every check is cheap on the common values (an ASCII name, an ``int``, no tags, no
    metadata), since a batch makes each of them once per job.
    """
    if not isinstance(job, NewJob):
        raise ValidationError(f"a job must be an awa_sa.NewJob, got {type(job).__name__}")
    payload, class_name = _args(job.args)
    kind = derive_kind(class_name) if job.kind is None else job.kind
    queue = job.queue
    _name("kind", kind)
    _name("queue", queue)
    _int_in("priority", job.priority, PRIORITIES)
    _int_in("max_attempts", job.max_attempts, MAX_ATTEMPTS)
    tags = _tags(job.tags)
    metadata = job.metadata
    if metadata is None:
        metadata_json = "{}"
    elif isinstance(metadata, dict):
        metadata_json = to_json(metadata, "metadata")
    else:
        raise ValidationError(f"metadata must be a dict, got {type(metadata).__name__}")
    unique = unique_of(job.unique_opts)
    if unique is None and plain(payload):
        key = args_text = None
    else:
        args_text = to_json(payload)
        key = None if unique is None else unique_key(kind, queue, args_text, unique)
        payload = None
    run_at = _run_at(job.run_at)
    values = JobValues(
        kind,
        queue,
        payload,
        "available" if run_at is None else "scheduled",
        job.priority,
        job.max_attempts,
        run_at,
        metadata_json,
        tags_literal(tags),
        None if key is None else key.hex(),
        None if unique is None else states_bits(unique),
        _ordering_key(job.ordering_key),
        args_text,
        tags,
        {"kind": kind, "args": payload},
    )
    if (
        args_text is None
        and queue == "default"
        and job.priority == 2
        and job.max_attempts == 25
        and run_at is None
        and metadata is None
        and not tags
        and job.ordering_key is None
    ):
        return values  # the common job: its batch element is its kind and args alone
    return values._replace(element=element(values))


def batch_of(jobs: list[Prepared]) -> Batch:
    """Checked jobs ready to bind, or the first one's reason to refuse.

    A job whose args go as a value (``args_text`` None) has only been walked by
    :func:`~awa_sa.core.unique_keys.plain`; what the walk leaves to the encoder's text (a NUL, a
    lone surrogate) is checked here, in the batch's one text rather than in a text per job. Where
    that text fails, each such job's args are written alone, which names the one to refuse.
    """
    if len(jobs) == 1:
        (job,) = jobs
        return Batch([job if job.args_text is not None else _as_text(job)], None)
    elements = [job.element for job in jobs]
    text = batch_text(elements)
    if stored_as_written(text):
        return Batch(jobs, text, "objects")
    out = []
    for index, job in enumerate(jobs):
        try:
            out.append(job if job.args_text is not None else _as_text(job))
        except ValidationError as exc:
            raise ValidationError(f"jobs[{index}]: {exc}") from exc
    return Batch(out, batch_text([element(job) for job in out]), "objects")


def shared_batch(items: Sequence[object], options: NewJob) -> Batch | None:
    """*items*, each the args of a job with *options*' keywords, as one ``shared`` batch, or
    None where they need a batch of objects: a unique key (one per job), args the C encoder
    does not write as awa-sa does, kinds that differ, a ``NewJob`` among them.

    *options* are checked once, each item's args as :func:`prepare` checks them.
    """
    template = prepare(dataclasses.replace(options, args={}))
    if options.unique_opts is not None:
        return None
    kind = options.kind
    if all(type(item) is dict for item in items):  # the common list: no per-item calls
        if not all_plain(items):
            return None
        return _shared(template, derive_kind("dict") if kind is None else kind, items)
    payloads = []
    for index, item in enumerate(items):
        if isinstance(item, NewJob):
            return None
        try:
            payload, class_name = _args(item)
        except ValidationError as exc:
            raise ValidationError(f"jobs[{index}]: {exc}") from exc
        if options.kind is None:
            derived = derive_kind(class_name)
            if kind is None:
                kind = derived
            elif derived != kind:
                return None
        if not plain(payload):
            return None
        payloads.append(payload)
    assert kind is not None  # at least one item
    return _shared(template, kind, payloads)


def _shared(template: Prepared, kind: str, payloads: Sequence[object]) -> Batch | None:
    text = args_array(payloads)
    if not stored_as_written(text):
        return None
    _name("kind", kind)
    values = template._replace(kind=kind, args=None, element={})
    return Batch([values] * len(payloads), text, "shared")


def _as_text(job: Prepared) -> Prepared:
    """*job* with its args written by :func:`~awa_sa.core.unique_keys.to_json` (which checks
    them)."""
    job = job._replace(args=None, args_text=to_json(job.args))
    return job._replace(element=element(job))


def _args(args: object) -> tuple[object, str]:
    """The JSON-able payload of *args* and its class name, as awa-pg reads them."""
    name = type(args).__name__
    if type(args) is dict:
        return args, name
    dump = getattr(args, "model_dump", None)
    if callable(dump):  # a pydantic model: its JSON mode, as awa-pg asks for
        return dump(mode="json"), name
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return dataclasses.asdict(args), name
    if isinstance(args, dict):
        return args, name
    raise ValidationError(
        f"args must be a dataclass, a pydantic model or a dict, got {type(args).__name__}"
    )


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be a str, got {type(value).__name__}")
    if "\x00" in value:
        raise ValidationError(f"{name} must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{name}: {value!r} is not valid Unicode") from exc
    return value


def _name(name: str, value: object) -> None:
    if (
        type(value) is str
        and 0 < len(value) <= MAX_NAME
        and value.isascii()
        and "\x00" not in value
    ):
        return
    text = _text(name, value)
    if not 0 < len(text) <= MAX_NAME:
        raise ValidationError(f"{name} must be 1 to {MAX_NAME} characters, got {len(text)}")


def _int_in(name: str, value: object, allowed: range) -> None:
    if type(value) is int and value in allowed:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise ValidationError(
            f"{name} must be an int from {allowed.start} to {allowed.stop - 1}, got {value!r}"
        )


def _tags(tags: object) -> tuple[str, ...]:
    if tags is None or (type(tags) is list and not tags):
        return ()
    if isinstance(tags, str | bytes) or not isinstance(tags, Sequence):
        raise ValidationError(f"tags must be a list of str, got {type(tags).__name__}")
    if len(tags) > MAX_TAGS:
        raise ValidationError(f"at most {MAX_TAGS} tags, got {len(tags)}")
    return tuple([_text(f"tags[{n}]", tag) for n, tag in enumerate(tags)])


def _run_at(run_at: object) -> str | None:
    if run_at is None:
        return None
    if isinstance(run_at, str):
        try:
            parsed = datetime.fromisoformat(run_at)
        except ValueError as exc:
            raise ValidationError(f"run_at: {run_at!r} is not an ISO 8601 timestamp") from exc
        run_at = parsed
    if not isinstance(run_at, datetime):
        raise ValidationError(f"run_at must be a datetime, got {type(run_at).__name__}")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise ValidationError("run_at must be timezone-aware (awa-pg would read it as UTC)")
    return run_at.isoformat()


def _ordering_key(key: object) -> str | None:
    if key is None:
        return None
    if isinstance(key, str):
        return _text("ordering_key", key).encode().hex()
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).hex()
    raise ValidationError(f"ordering_key must be bytes or str, got {type(key).__name__}")
