"""``resolve_callback``'s CEL, golden-tested against awa-pg 0.6.9's own ``resolve_callback``.

One canonical ``awa migrate`` cluster and one job. For each case its wait is parked again
(SQL: ``waiting_external``, a callback id, the case's expressions), resolved by awa-sa in a
caller's transaction that also writes a business row, read back inside it and rolled back
(every row as parked again), then resolved by awa-pg's ``Client``: the answers (outcome,
reason, payload type for type, the job) and the job's row after (clocks masked) are the same.

Each expression of the corpus runs in two roles: as ``filter``, ``on_complete`` and
``transform`` at once with ``default_action="fail"`` (ignored where it is false, completed
answering ``true`` where it is true, failed by default where it fails or is not a bool), and as
the ``transform`` of an ``on_complete`` that holds (its value as JSON, or the payload where it
fails). ``on_fail``, the defaults and the payloads the corpus needs are cases of their own.
What awa-sa refuses (a transform's timestamp or duration) raises and writes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any, NamedTuple

import awa
import pytest
import sqlalchemy as sa
from administering import masked, pg_call, twin
from callback_waits import same_answer
from racing import held, in_thread, wait_until_blocked
from runtimes import pg_url

import awa_sa
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

M = {"s": "abc", "n": 5, "neg": -5, "f": 2.5, "l": [1, 2, 3], "m": {"k": "v", "z": 0}, "t": True}
CORPUS: list[tuple[str, Any]] = [
    # numbers: a JSON whole number that is not negative is a uint, a negative one an int
    ("payload.n == 5", M),
    ("payload.n == 5u", M),
    ("payload.n > 3", M),
    ("payload.n + 1", M),
    ("payload.n + 1u", M),
    ("payload.neg + 1", M),
    ("payload.neg == -5", M),
    ("payload.f * 2.0", M),
    ("payload.f == 2.5", M),
    ("payload.n == 5.0", M),
    ("payload.f > payload.n", M),
    ("int(payload.n) + 1", M),
    ("double(payload.n) / 2.0", M),
    ("uint(payload.f)", M),
    ("payload.big * 2", {"big": 9223372036854775807}),
    ("payload.big", {"big": 9223372036854775808}),
    ("payload.tiny", {"tiny": 1e-7}),
    ("payload.z", {"z": -0.0}),
    ("payload.z == 0u", {"z": 0}),
    ("1 / 0", M),
    ("1.0 / 0.0", M),
    ("[1.0 / 0.0, 2]", M),
    # strings and their functions
    ("payload.s == 'abc'", M),
    ("payload.s.startsWith('ab') && payload.s.endsWith('c')", M),
    ("payload.s.contains('b')", M),
    ("payload.s.matches('^a.c$')", M),
    ("payload.s.matches('(')", M),
    ("size(payload.s)", {"s": "héllo"}),
    ("payload.s.size() == 3", M),
    ("payload.s + '!'", M),
    ("payload.s.upperAscii()", M),
    ("string(payload.n)", M),
    ("string(payload.f)", M),
    ("bytes(payload.s)", {"s": "hé"}),
    ("payload.u", {"u": 'quo"te\\ \n\t\x01 \u2028 😀 é'}),
    (
        "payload.u == 'quo\"te\\\\ \\n\\t\\x01 \\u2028 \\U0001F600 é'",
        {"u": 'quo"te\\ \n\t\x01 \u2028 😀 é'},
    ),
    # maps, lists, has(), missing fields
    ("payload.m", M),
    ("payload.m.k == 'v'", M),
    ("'k' in payload.m", M),
    ("2 in payload.l", M),
    ("2u in payload.l", M),
    ("payload.l == [1u, 2u, 3u]", M),
    ("payload.l[0]", M),
    ("payload.l[9]", M),
    ("payload.l.size()", M),
    ("max(payload.l)", M),
    ("payload.l.exists(x, x > 2u)", M),
    ("payload.l.all(x, x > 0)", M),
    ("payload.l.exists_one(x, x == 1u)", M),
    ("payload.l.map(x, x * 2u)", M),
    ("payload.l.filter(x, x > 1u)", M),
    ("has(payload.m)", M),
    ("has(payload.missing)", M),
    ("has(payload.m.k)", M),
    ("has(payload.missing.k)", M),
    ("payload.missing == 1", M),
    ("payload.missing == 1 || true", M),
    ("payload['m']['z']", M),
    ("payload", M),
    ("{'b': 1, 'a': [payload.s]}", M),
    ("payload.t ? payload.s : 'no'", M),
    ("{'b': {'y': 1, 'x': [payload.f]}, 'a': null}", M),
    ("payload.t", M),
    ("payload.x", None),
    ("has(payload.x)", None),
    ("payload == null", None),
    ("payload[0]", [7, "x"]),
    ("payload", "a string"),
    # other types a transform can return
    ("b'\\x00\\xff'", M),
    ("[b'', b'ab']", M),
    ("[optional.none()].size() == 1", M),
    # errors and what is not a bool
    ("payload.s.nope()", M),
    ("other == 1", M),
    ("1", M),
    ("'true'", M),
    ("(", M),
    ("", M),
    ("[" * 96 + "true" + "]" * 96, M),  # past the parser's depth limit, alone too
]
DEEP = "[" * 94 + "true" + "]" * 94 + "[0]" * 94
"""Within the parser's depth limit alone, past it once bound to the payload."""
REFUSED = [
    # what the binding cannot hand back exactly: awa-sa refuses the transform
    ("timestamp('2024-01-01T00:00:00.123456789Z')", M),
    ("duration('1.5s')", M),
    ("[duration('1ns')]", M),
    ("optional.of(1)", M),
    ("optional.of(true)", M),
    ("[optional.none()]", M),
    ("0.0 / 0.0", M),
    ("{'a': payload.n, 1: 'one', true: payload.t}", M),
]
DECIDE = {"filter": "payload.kind == 'charge'"}
SETTLE = {
    "on_fail": "payload.status == 'declined'",
    "on_complete": "payload.status == 'paid'",
    "transform": "{'paid': payload.amount, 'order': payload.order}",
}
CASES: dict[str, tuple[dict[str, str], Any, str]] = {
    "paid": (SETTLE, {"status": "paid", "amount": 1250, "order": "A-1"}, "ignore"),
    "declined": (SETTLE, {"status": "declined", "amount": 1250}, "ignore"),
    "pending-ignored": (SETTLE, {"status": "pending"}, "ignore"),
    "pending-completed": (SETTLE, {"status": "pending"}, "complete"),
    "pending-failed": (SETTLE, {"status": "pending"}, "fail"),
    "on-fail-first": ({"on_fail": "true", "on_complete": "true"}, {}, "complete"),
    "on-fail-error": ({"on_fail": "payload.missing"}, {}, "complete"),
    "filtered": ({**DECIDE, **SETTLE}, {"kind": "refund", "status": "paid"}, "complete"),
    "filter-passes": ({**DECIDE, **SETTLE}, {"kind": "charge", "status": "declined"}, "complete"),
    "none-complete": ({}, {"a": [1, 2.5, "x"], "b": None}, "complete"),
    "none-no-payload": ({}, None, "complete"),
    "none-fail": ({}, {"a": 1}, "fail"),
    "none-ignore": ({}, {"a": 1}, "ignore"),
    "no-payload": ({"on_complete": "payload == null", "transform": "payload"}, None, "fail"),
    "list-payload": (
        {"on_complete": "payload[0] == 7u", "transform": "payload[1]"},
        [7, "x"],
        "fail",
    ),
    "big-payload": ({"on_complete": "payload.n > 9e18"}, {"n": 2**70, "m": -(2**63)}, "fail"),
}
"""Named cases: ``on_fail`` (its expression in the error entry), the order of the
expressions, each default action with and without expressions, and payloads of every shape."""


class Cluster(NamedTuple):
    url: str
    engine: sa.Engine
    client: Any
    job: int


@pytest.fixture(scope="module")
def cluster(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[Cluster]:
    with ExitStack() as stack:
        url, engine = twin(stack, pg, awa_databases, real_template)
        client = awa.Client(pg_url(url))
        stack.callback(client.close)
        job = client.insert({"order": 1}, kind="charge", queue="cb_q")
        yield Cluster(url, engine, client, job.id)


PARK = """
UPDATE awa.jobs_hot SET state = CAST(:state AS awa.job_state), attempt = 1, run_lease = 1,
    attempted_at = now(), finalized_at = NULL, heartbeat_at = NULL, deadline_at = NULL,
    errors = '{}', progress = NULL, callback_id = CAST(:cb AS uuid),
    callback_timeout_at = now() + interval '1 hour', callback_filter = :filter,
    callback_on_complete = :on_complete, callback_on_fail = :on_fail,
    callback_transform = :transform
WHERE id = :id
"""


def park(cluster: Cluster, state: str = "waiting_external", **expressions: str | None) -> str:
    """The job waiting again (or still running: a callback before its handler parks), on a
    new callback with *expressions*; its callback id."""
    callback = str(uuid.uuid4())
    names = ("filter", "on_complete", "on_fail", "transform")
    binds = {name: expressions.get(name) for name in names}
    with cluster.engine.begin() as conn:
        conn.execute(sa.text(PARK), {"cb": callback, "id": cluster.job, "state": state, **binds})
    return callback


def row(conn: sa.Connection | sa.Engine, job: int) -> str:
    sql = sa.text("SELECT t::text FROM awa.jobs_hot t WHERE id = :id")
    if isinstance(conn, sa.Engine):
        with conn.connect() as c:
            return masked(c.execute(sql, {"id": job}).scalar_one())
    return masked(conn.execute(sql, {"id": job}).scalar_one())


def both(
    cluster: Cluster,
    payload: Any,
    default: str,
    state: str = "waiting_external",
    **expressions: str,
) -> Any:
    """awa-sa's resolve in a caller's transaction, read back and rolled back; then awa-pg's:
    the same answer and row. awa-pg's answer."""
    callback = park(cluster, state, **expressions)
    parked = row(cluster.engine, cluster.job)
    with cluster.engine.connect() as conn:
        conn.execute(sa.text("INSERT INTO public.business VALUES ('resolved')"))
        got = awa_sa.resolve_callback(conn, callback, payload, default)  # type: ignore[arg-type]
        sa_row = row(conn, cluster.job)
        conn.rollback()
    assert row(cluster.engine, cluster.job) == parked
    theirs = cluster.client.resolve_callback(callback, payload, default)
    assert sa_row == row(cluster.engine, cluster.job)
    assert got is not None
    same_answer(got, theirs)
    return theirs


EVERY = CORPUS + REFUSED


@pytest.mark.parametrize(("expression", "payload"), EVERY, ids=[e for e, _ in EVERY])
def test_an_expression_decides_as_in_awa_pg(
    cluster: Cluster, expression: str, payload: Any
) -> None:
    """As a condition (``filter``, then ``on_complete``, with itself as the transform)."""
    exprs = {"filter": expression, "on_complete": expression, "transform": expression}
    assert both(cluster, payload, "fail", **exprs).outcome in ("completed", "failed", "ignored")


@pytest.mark.parametrize(("expression", "payload"), CORPUS, ids=[e for e, _ in CORPUS])
def test_an_expression_transforms_as_in_awa_pg(
    cluster: Cluster, expression: str, payload: Any
) -> None:
    transformed = both(cluster, payload, "fail", on_complete="true", transform=expression)
    assert transformed.outcome == "completed"


@pytest.mark.parametrize(("expression", "payload"), REFUSED, ids=[e for e, _ in REFUSED])
def test_a_transform_awa_sa_cannot_read_exactly_is_refused_and_writes_nothing(
    cluster: Cluster, expression: str, payload: Any
) -> None:
    callback = park(cluster, on_complete="true", transform=expression)
    parked = row(cluster.engine, cluster.job)
    with cluster.engine.connect() as conn:
        with pytest.raises(awa_sa.ExpressionRefused) as refused:
            awa_sa.resolve_callback(conn, callback, payload)
        assert (refused.value.name, refused.value.expression) == ("transform", expression)
        assert row(conn, cluster.job) == parked  # nothing written, inside the transaction too
        conn.rollback()
    assert cluster.client.resolve_callback(callback, payload).outcome == "completed"


def test_an_expression_nested_near_the_depth_limit_is_refused_and_writes_nothing(
    cluster: Cluster,
) -> None:
    for role in ({"filter": DEEP}, {"on_complete": "true", "transform": DEEP}):
        callback = park(cluster, **role)
        parked = row(cluster.engine, cluster.job)
        with pytest.raises(awa_sa.ExpressionRefused, match="depth limit"):
            awa_sa.resolve_callback(cluster.engine, callback, M, "complete")
        assert row(cluster.engine, cluster.job) == parked
        assert cluster.client.resolve_callback(callback, M, "complete").outcome == "completed"


@pytest.mark.parametrize(("exprs", "payload", "default"), CASES.values(), ids=CASES.keys())
def test_a_case_resolves_as_in_awa_pg(
    cluster: Cluster, exprs: dict[str, str], payload: Any, default: str
) -> None:
    got = both(cluster, payload, default, **exprs)
    if got.outcome == "failed":
        (entry,) = got.job.errors
        matched = entry["error"] == "callback failed: on_fail expression matched"
        assert entry.get("expression") == (exprs["on_fail"] if matched else None)


def test_a_callback_that_arrives_before_its_handler_parks_resolves_as_in_awa_pg(
    cluster: Cluster,
) -> None:
    """A wait still ``running`` (the handler has not returned ``WaitForCallback`` yet)."""
    for payload, outcome in (
        ({"status": "paid", "amount": 5, "order": "B"}, "completed"),
        ({"status": "declined"}, "failed"),
    ):
        assert both(cluster, payload, "ignore", "running", **SETTLE).outcome == outcome


def test_no_such_callback_answers_none_where_awa_pg_raises(cluster: Cluster) -> None:
    callback = park(cluster, **SETTLE)
    paid = {"status": "paid", "amount": 5, "order": "C"}
    with cluster.engine.begin() as conn:
        assert awa_sa.resolve_callback(conn, str(uuid.uuid4()), paid) is None
        assert awa_sa.resolve_callback(conn, callback, paid, run_lease=2) is None
        done = awa_sa.resolve_callback(conn, callback, paid, run_lease=1)
        assert done is not None
        assert done.is_completed()
    with cluster.engine.begin() as conn:
        assert awa_sa.resolve_callback(conn, callback, paid) is None
    with pytest.raises(awa.CallbackNotFound):
        cluster.client.resolve_callback(callback, paid)
    with pytest.raises(ValueError, match="unknown default_action"):
        cluster.client.resolve_callback(callback, paid, "later")
    with pytest.raises(awa_sa.ValidationError, match="unknown default_action"):
        awa_sa.resolve_callback(cluster.engine, callback, paid, "later")  # type: ignore[arg-type]


def by_pg(cluster: Cluster, callback: str, payload: Any) -> Any:
    """awa-pg's resolve on a client of its own (from another thread); None where it raises
    "callback not found"."""

    async def call(client: awa.AsyncClient) -> Any:
        try:
            return await client.resolve_callback(callback, payload)
        except awa.CallbackNotFound:
            return None

    return pg_call(cluster.url, call)


def test_a_resolve_holds_the_wait_as_awa_pg_does_both_orders(cluster: Cluster) -> None:
    """awa-sa's resolve holds the wait until its caller commits: awa-pg's resolve waits, then
    finds it completed ("callback not found"), or, behind a resolve that ignored it, resolves
    it. The other order: awa-pg's resolve queued first behind a side lock, awa-sa's behind it,
    answered None; its business row rolled back."""
    paid = {"kind": "charge", "status": "paid", "amount": 5, "order": "R"}
    for first, then in (("completed", "none"), ("ignored", "completed")):
        callback = park(cluster, **DECIDE, **SETTLE)
        given = paid if first == "completed" else {**paid, "kind": "refund"}
        with held(cluster.engine) as tx:
            tx.execute("INSERT INTO public.business VALUES ('first')")
            got = awa_sa.resolve_callback(tx.conn, callback, given)
            assert got is not None
            assert got.outcome == first
            theirs = in_thread(partial(by_pg, cluster, callback, paid))
            wait_until_blocked(cluster.engine, tx.pid, pending=[theirs])
            tx.commit()
        answer = theirs.result(60)
        assert ("none" if answer is None else answer.outcome) == then

    callback = park(cluster, **SETTLE)

    def late() -> Any:
        with cluster.engine.connect() as conn:
            conn.execute(sa.text("INSERT INTO public.business VALUES ('late')"))
            got = awa_sa.resolve_callback(conn, callback, paid)
            if got is not None:
                conn.commit()
            return got

    with held(cluster.engine) as tx:
        tx.execute("SELECT 1 FROM awa.jobs_hot WHERE id = :i FOR UPDATE", {"i": cluster.job})
        theirs = in_thread(partial(by_pg, cluster, callback, paid))
        (waiter,) = wait_until_blocked(cluster.engine, tx.pid, pending=[theirs])
        mine = in_thread(late)
        wait_until_blocked(cluster.engine, waiter.pid, pending=[theirs, mine])
        tx.rollback()
    assert theirs.result(60).outcome == "completed"
    assert mine.result(60) is None
    with cluster.engine.connect() as conn:
        late_rows = sa.text("SELECT count(*) FROM public.business WHERE note = 'late'")
        assert conn.execute(late_rows).scalar_one() == 0
