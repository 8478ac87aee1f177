"""The moving statements' results, each read once into a small named type.

A moving statement answers with a first row of flags -- one row even when it moved nothing
(``statements._head_then``) -- followed by a row per job it moved or took. The readers here split
the two, so the flow (:mod:`awa_sa.reschedule`) branches on names: what moved, why nothing did,
which item a taken job answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import CursorResult

from awa_sa import statements


class MovedJob(NamedTuple):
    """A job the canonical move rescheduled: same id; ``run_at`` and ``attempt`` as stored."""

    job_id: int
    run_lease: int
    run_at: datetime
    attempt: int


@dataclass(frozen=True, slots=True)
class Moved:
    """What a canonical move did: the jobs it moved, or why it touched nothing.

    ``routing_schema`` (the routing move) or ``queue_storage`` (the one statement): routing
    points to queue storage. ``guarded`` false: the one statement did not trust the installed
    routing functions. ``shared_key``: two of the batch's rows share a unique key.
    """

    jobs: list[MovedJob]
    shared_key: bool
    routing_schema: str | None = None
    queue_storage: bool = False
    guarded: bool = True

    @classmethod
    def read(cls, result: CursorResult[Any]) -> Moved:
        rows = result.all()
        flags = rows[0]._mapping
        jobs = [MovedJob(r.id, r.run_lease, r.run_at, r.attempt) for r in rows if r.id is not None]
        return cls(
            jobs,
            shared_key=bool(flags["shared_key"]),
            routing_schema=flags.get("routing_schema"),
            queue_storage=bool(flags.get("queue_storage", False)),
            guarded=bool(flags.get("guarded", True)),
        )


@dataclass(frozen=True, slots=True, eq=False)
class TakenJob:
    """A canonical row taken for queue storage, and its successor; compared by identity."""

    index: int
    """The position of the item it answers in the call's list."""
    job_id: int
    """The successor's fresh id."""
    run_at: datetime
    attempt: int
    state: str
    queue: str
    priority: int
    unique_key: bytes | None
    unique_states: str | None
    successor: Mapping[str, Any]
    """The ``b_<column>`` binds of its ``deferred_jobs`` row."""


@dataclass(frozen=True, slots=True)
class Taken:
    """What the take did: the jobs it took, the items refused for their metadata, or nothing
    at all because two of the batch's rows share a unique key."""

    jobs: list[TakenJob]
    shared_key: bool
    not_objects: list[tuple[int, str]]
    """``(index, jsonb_typeof)`` of taken items whose metadata is not a JSON object."""

    @classmethod
    def read(cls, result: CursorResult[Any]) -> Taken:
        rows = result.all()
        jobs, not_objects = [], []
        for r in rows:
            if r.ord is None:
                continue  # the flags row, joined to nothing
            if r.job_id is None:
                not_objects.append((r.ord - 1, str(r.metadata_type)))
                continue
            successor = {f"b_{name}": getattr(r, name) for name in statements.SUCCESSOR_FIELDS}
            jobs.append(
                TakenJob(
                    r.ord - 1,
                    r.job_id,
                    r.run_at,
                    r.attempt,
                    r.state,
                    r.queue,
                    r.priority,
                    r.unique_key,
                    r.unique_states,
                    successor,
                )
            )
        return cls(jobs, bool(rows[0].shared_key), not_objects)


@dataclass(frozen=True, slots=True)
class Written:
    """Claims acquired (if any) and the rows written."""


@dataclass(frozen=True, slots=True)
class Held:
    """Nothing written: other jobs hold these jobs' unique keys."""

    jobs: list[TakenJob]


@dataclass(frozen=True, slots=True)
class Unexplained:
    """Nothing written: a unique violation that no lost claim explains."""


ClaimedWrite = Written | Held | Unexplained
"""How a claim-then-write under a savepoint ended."""
