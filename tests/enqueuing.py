"""What the enqueue tests share: twin real clusters, a snapshot of every table, NOTIFY capture."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import sqlalchemy as sa
from conftest import Cluster
from runtimes import pg_url

from awa_sa.testing.server import EmbeddedPostgres

FUTURE = datetime(2999, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
PAST = datetime(2001, 2, 3, 4, 5, 6, 123456, tzinfo=timezone(timedelta(hours=-5)))


JOBS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"to": "a@example.com"}, {"kind": "send_email"}),
    ({"n": 1}, {"kind": "later", "run_at": FUTURE}),
    ({"n": 2}, {"kind": "overdue", "run_at": PAST}),
    ({"n": 3}, {"kind": "urgent", "priority": 1, "queue": "fast", "max_attempts": 3}),
    ({"n": 4}, {"kind": "tagged", "tags": ["b", "a", "é"]}),
    ({"n": 5}, {"kind": "described", "metadata": {"trace": {"id": "x"}, "n": 1.5}}),
    ({"n": 6}, {"kind": "ordered", "ordering_key": "customer-7"}),
    ({"n": 7}, {"kind": "ordered", "ordering_key": b"\x00\xff"}),
    ({"n": 8, "f": 1e-7, "s": "é\n"}, {"kind": "once", "unique_opts": {}}),
    ({"n": 9}, {"kind": "once", "unique_opts": {"by_queue": True, "by_period": 3600}}),
    ({"n": 10}, {"kind": "once", "run_at": FUTURE, "unique_opts": {"states": 0b1000_0011}}),
    ({"n": 11}, {"kind": "once", "unique_opts": {"by_args": False, "states": 0}}),
]
"""Plain, scheduled (future and past), prioritised, tagged, metadata, ordering-keyed, unique."""

_TIMESTAMP = re.compile(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d)?"')


MARKS = ("awa.admin_dirty_queue_marks", "awa.admin_dirty_kind_marks")
"""The dirty marks a statement trigger appends: once per statement and queue (or kind)."""


def marks_as_sets(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """*found* with each dirty-mark table's rows counted once: a set-based batch appends one
    mark per statement where the producer function appends one per job (the same queues and
    kinds, with the same ``touched_at``, which is all maintenance reads)."""
    return {table: sorted(set(rows)) if table in MARKS else rows for table, rows in found.items()}


def snapshot(engine: sa.Engine) -> dict[str, list[str]]:
    """Every row of every table of Awa's schemas, as JSON text, timestamps masked."""
    with engine.connect() as conn:
        names = list(
            conn.execute(
                sa.text(
                    "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relkind = 'r' AND n.nspname IN ('awa', 'awa_qs') ORDER BY 1"
                )
            ).scalars()
        )
        if not names:
            return {}
        # Every table in one statement: a v040 cluster has some 400 (the queue-storage
        # partitions), and a statement each cost a snapshot 160 ms of CPU (issue 39).
        every = " UNION ALL ".join(
            f"SELECT {index} AS n, to_jsonb(t)::text AS row FROM {table} t"
            for index, table in enumerate(names)
        )
        found: dict[str, list[str]] = {}
        for index, row in conn.execute(sa.text(every)):
            found.setdefault(names[index], []).append(_TIMESTAMP.sub('"ts"', row))
        return {table: sorted(found[table]) for table in names if table in found}


@dataclass
class Twins:
    """Two clones of the ``awa migrate`` template in the same phase: awa-pg's and awa-sa's."""

    awa_pg: Cluster
    awa_sa: Cluster

    def both(self) -> tuple[Cluster, Cluster]:
        return self.awa_pg, self.awa_sa


def twins(
    pg: EmbeddedPostgres, clone: Callable[[str], str], template: str, phase: str
) -> Iterator[Twins]:
    engines = []
    clusters = []
    for _ in range(2):
        url = clone(template)
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        engines.append(engine)
        cluster = Cluster("real", pg, url, engine)
        cluster.set_phase(phase, "awa_qs")
        clusters.append(cluster)
    try:
        yield Twins(*clusters)
    finally:
        for engine in engines:
            engine.dispose()


class Listener:
    """A session LISTENing on channels; what it heard is read by a round trip, not a wait."""

    def __init__(self, url: str, channels: list[str]) -> None:
        self.conn = psycopg.connect(pg_url(url), autocommit=True)
        self.heard: list[tuple[str, str]] = []
        self.conn.add_notify_handler(lambda n: self.heard.append((n.channel, n.payload)))
        for channel in channels:
            self.conn.execute(f'LISTEN "{channel}"')

    def drain(self) -> list[tuple[str, str]]:
        """Everything delivered so far: a committed NOTIFY reaches us before our next answer."""
        self.conn.execute("SELECT 1")
        heard, self.heard = self.heard, []
        return heard

    def close(self) -> None:
        self.conn.close()


@contextmanager
def listening(url: str, channels: list[str]) -> Iterator[Listener]:
    listener = Listener(url, channels)
    try:
        yield listener
    finally:
        listener.close()


CHANNELS = ["awa:default", "awa:fast"]
