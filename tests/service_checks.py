"""The invariants of the service soak (service_soak.py), read from the rows once all is quiet.

Jobs are followed by the token in their args (``t``), not their id: a canonical re-schedule in
the mixed window moves a job to queue storage under a new id, and a unique job enqueued again
after its first one failed shares its args. A token's committed enqueues (``svc_requests``)
must equal its terminal ends; an end is a row of ``awa.jobs_hot`` in a terminal state, of the
queue-storage schema's ``terminal_jobs``, or an item of a compact completion batch.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import awa
import sqlalchemy as sa
from runtimes import pg_url, rows
from service_receiver import STATE_OF

from awa_sa import running_attempts

TERMINAL = ("completed", "failed", "cancelled")


def lanes_moved_past_awas_wedge(engine: sa.Engine, schema: str) -> int:
    """Lanes whose claim cursor stands on a dead number (a rolled-back enqueue's) right before
    a tombstone, moved onto the tombstone, as docs/administer.md tells an operator to: awa-pg
    0.6.9's claim passes such a tombstone only when it starts exactly at the cursor, whoever
    cancelled the job (tests/integration/test_administer_cancel_gap.py). Each lane in its own
    READ COMMITTED transaction: the enqueues still reserving on it waited for first (the enqueue
    head's row lock, the reservation lock), so a number no ready row holds is dead."""
    moved = 0
    [made] = rows(engine, f"SELECT to_regclass('{schema}.queue_claim_heads') IS NOT NULL AS made")
    if not made["made"]:
        return moved  # not prepared yet
    lanes = rows(engine, f"SELECT queue, priority, enqueue_shard FROM {schema}.queue_claim_heads")
    for lane in lanes:
        where = "queue = :queue AND priority = :priority AND enqueue_shard = :enqueue_shard"
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_advisory_xact_lock(hashtextextended("
                    "format('%I.%I', CAST(:s AS text), seq_name), 0))"
                    f" FROM {schema}.queue_enqueue_heads WHERE {where} FOR UPDATE"
                ),
                {**lane, "s": schema},
            ).all()
            head = conn.execute(
                sa.text(
                    f"""SELECT h.seq_name, {schema}.sequence_next_value(h.seq_name) AS cursor,
                           (SELECT min(r.lane_seq) FROM {schema}.ready_entries AS r
                            WHERE r.queue = h.queue AND r.priority = h.priority
                              AND r.enqueue_shard = h.enqueue_shard
                              AND r.lane_seq >= {schema}.sequence_next_value(h.seq_name)
                           ) AS first
                    FROM {schema}.queue_claim_heads AS h WHERE {where} FOR UPDATE"""
                ),
                lane,
            ).one()
            if head.first is None or head.first <= head.cursor:
                continue
            tombstoned = conn.execute(
                sa.text(
                    f"SELECT EXISTS (SELECT 1 FROM {schema}.ready_tombstones WHERE {where}"
                    " AND lane_seq = :first)"
                ),
                {**lane, "first": head.first},
            ).scalar_one()
            if tombstoned:
                conn.execute(
                    sa.text(
                        f"SELECT {schema}.set_sequence_next(CAST(:seq AS text),"
                        " CAST(:first AS bigint))"
                    ),
                    {"seq": head.seq_name, "first": head.first},
                ).all()
                moved += 1
    return moved


def live_count(engine: sa.Engine, schema: str) -> int:
    """Jobs not yet terminal on either plane: waiting, due, claimable or running."""
    [row] = rows(
        engine,
        f"""SELECT (SELECT count(*) FROM awa.jobs_hot
                    WHERE state NOT IN ('completed', 'failed', 'cancelled'))
             + (SELECT count(*) FROM awa.scheduled_jobs)
             + (SELECT count(*) FROM {schema}.deferred_jobs)
             + (SELECT count(*) FROM {schema}.leases)
             + (SELECT count(*) FROM {schema}.ready_entries AS r
                JOIN {schema}.queue_claim_heads AS h USING (queue, priority, enqueue_shard)
                WHERE r.lane_seq >= {schema}.sequence_next_value(h.seq_name)) AS n""",
    )
    return int(row["n"]) + len(running_attempts(engine))


def _ends(schema: str) -> str:
    return f"""
    WITH tokens AS (SELECT DISTINCT ON (job_id) job_id, args ->> 't' AS token
                    FROM {schema}.ready_entries ORDER BY job_id)
    SELECT id AS job_id, run_lease, state::text AS state, args ->> 't' AS token, queue,
           'canonical' AS plane
    FROM awa.jobs_hot WHERE state IN ('completed', 'failed', 'cancelled')
    UNION ALL
    SELECT d.job_id, d.run_lease, d.state::text, coalesce(d.args ->> 't', t.token), d.queue,
           'done'
    FROM {schema}.done_entries AS d LEFT JOIN tokens AS t USING (job_id)
    UNION ALL
    SELECT i.job_id, i.run_lease, 'completed', t.token, b.queue, 'compact'
    FROM {schema}.receipt_completion_batches AS b,
         unnest(b.job_ids, b.run_leases) AS i(job_id, run_lease)
         LEFT JOIN tokens AS t USING (job_id)
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.receipt_completion_tombstones AS x
                      WHERE x.job_id = i.job_id AND x.run_lease = i.run_lease)
    """


def _receipts(schema: str) -> str:
    return f"""
    SELECT job_id, max(run_lease) AS lease FROM (
        SELECT job_id, run_lease FROM {schema}.lease_claims
        UNION ALL
        SELECT i.job_id, i.run_lease FROM {schema}.lease_claim_batches AS b,
            unnest(b.job_ids, b.run_leases) AS i(job_id, run_lease)) AS r
    GROUP BY job_id
    """


def _counted(schema: str) -> str:
    return f"""
    SELECT q.queue,
           COALESCE((SELECT sum(live_terminal_count) FROM {schema}.queue_terminal_live_counts
                     AS c WHERE c.queue = q.queue), 0)
         + COALESCE((SELECT sum(terminal_delta) FROM {schema}.queue_terminal_count_deltas
                     AS d WHERE d.queue = q.queue), 0)
         + COALESCE((SELECT sum(completed_count) FROM {schema}.receipt_completion_batches
                     AS b WHERE b.queue = q.queue), 0)
         - (SELECT count(*) FROM {schema}.receipt_completion_tombstones AS t
            WHERE t.queue = q.queue) AS counted,
           (SELECT count(*) FROM {schema}.terminal_jobs AS j WHERE j.queue = q.queue) AS rows
    FROM (VALUES ('svc'), ('slow')) AS q(queue)
    """


@dataclass
class Figures:
    invariants: list[tuple[str, bool, str]] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(held for _, held, _ in self.invariants)

    def hold(self, name: str, problems: list[str], detail: str = "") -> None:
        shown = "; ".join(problems[:5]) + (f" (+{len(problems) - 5})" if len(problems) > 5 else "")
        self.invariants.append((name, not problems, shown or detail))


def _stats(engine: sa.Engine) -> dict[str, dict[str, int]]:
    async def read() -> dict[str, dict[str, int]]:
        client = awa.AsyncClient(pg_url(engine.url.render_as_string(False)))
        try:
            keys = ("available", "running", "retryable", "scheduled", "waiting_external")
            got = {}
            for s in await client.queue_stats():
                got[s.queue] = {k: int(getattr(s, k)) for k in keys}
                got[s.queue]["completed_last_hour"] = int(s.completed_last_hour)
                got[s.queue]["failed"] = int(s.failed)
            return got
        finally:
            await client.close()

    return asyncio.run(read())


def check(engine: sa.Engine, schema: str, tally: Any, runs: list[dict[str, Any]]) -> Figures:
    f = Figures()
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    requests = rows(engine, "SELECT token, job_id, how FROM svc_requests")
    effects = rows(engine, "SELECT * FROM svc_effects ORDER BY id")
    admin = rows(engine, "SELECT * FROM svc_admin ORDER BY id")
    callbacks = rows(engine, "SELECT * FROM svc_callbacks ORDER BY id")
    received = rows(engine, "SELECT * FROM svc_receipts ORDER BY id")
    ends = rows(engine, _ends(schema))
    receipts = {r["job_id"]: r["lease"] for r in rows(engine, _receipts(schema))}
    phase = rows(engine, "SELECT state, details FROM awa.storage_transition_state")[0]

    # 1. every committed enqueue has exactly one terminal end; none rolled back exists
    committed = Counter(r["token"] for r in requests)
    ended = Counter(e["token"] for e in ends)
    f.hold(
        "every committed enqueue has exactly one terminal end",
        [
            f"token {t}: {committed[t]} enqueued, {ended[t]} ends"
            for t in committed | ended
            if committed[t] != ended[t]
        ],
    )
    rolled = tally.rolled_tokens - set(committed)
    ids = ",".join(str(i) for i in tally.rolled_ids) or "0"
    ghosts = rows(
        engine,
        f"SELECT id FROM awa.jobs_hot WHERE id IN ({ids}) UNION ALL "
        f"SELECT id FROM awa.scheduled_jobs WHERE id IN ({ids}) UNION ALL "
        f"SELECT job_id FROM {schema}.ready_entries WHERE job_id IN ({ids}) UNION ALL "
        f"SELECT job_id FROM {schema}.deferred_jobs WHERE job_id IN ({ids})",
    )
    f.hold(
        "no rolled-back enqueue exists",
        [f"token {e['token']} ended" for e in ends if e["token"] in rolled]
        + [f"rolled-back id {g['id']} has a row" for g in ghosts],
        f"{len(rolled)} tokens, {len(tally.rolled_ids)} ids rolled back",
    )

    # 2. business rows <-> job ends; a committed retry supersedes the rows of the ends before it
    final = {e["job_id"]: e for e in ends}
    retried_at: dict[int, Any] = {}
    for a in admin:
        if a["verb"] != "cancel" and a["answer"] == "JobRow":
            retried_at[a["job_id"]] = max(a["at"], retried_at.get(a["job_id"], a["at"]))
    current: list[tuple[int, int, str]] = []
    cancelled = ({**a, "state": "cancelled"} for a in admin if a["verb"] == "cancel")
    for r in [*effects, *cancelled, *received]:
        superseded = r["job_id"] in retried_at and r["at"] < retried_at[r["job_id"]]
        if r["state"] in TERMINAL and r.get("answer", "JobRow") == "JobRow" and not superseded:
            current.append((r["job_id"], r["run_lease"], r["state"]))
    business = Counter(current)
    history: dict[int, list[str]] = defaultdict(list)
    for a in admin:
        history[a["job_id"]].append(f"{a['verb']}:{a['answer']}:{a['run_lease']}")
    problems = [
        f"end {k} has {n} business rows {history[k[0]]}" for k, n in business.items() if n > 1
    ]
    for e in ends:
        if business.get((e["job_id"], e["run_lease"], e["state"]), 0) != 1:
            problems.append(f"end {e['job_id']}/{e['run_lease']} {e['state']} ({e['plane']})")
    for job_id, lease, state in business:
        end = final.get(job_id)
        if end is None or (end["run_lease"], end["state"]) != (lease, state):
            problems.append(f"business row {job_id}/{lease} {state}: the job ended {end}")
    f.hold(
        "every business row matches exactly one job end, and back",
        problems,
        f"{len(retried_at)} jobs retried: the rows of their earlier ends superseded",
    )

    # 3. no job ran after its terminal end; 4. a committed cancel's job never ran again
    ran: dict[int, int] = defaultdict(int)
    for r in runs:
        if r.get("lease") is not None:
            ran[r["job"]] = max(ran[r["job"]], r["lease"])
    f.hold(
        "no job ran after its terminal end",
        [
            f"job {j} ran lease {max(ran.get(j, 0), receipts.get(j, 0))} after its end at "
            f"{e['run_lease']}"
            for j, e in final.items()
            if max(ran.get(j, 0), receipts.get(j, 0)) > e["run_lease"]
        ],
    )
    cancels = [a for a in admin if a["verb"] == "cancel" and a["answer"] == "JobRow"]

    def retried_after(a: dict[str, Any]) -> bool:
        return bool(a["job_id"] in retried_at and retried_at[a["job_id"]] > a["at"])

    f.hold(
        "every committed cancel's job never ran again",
        [
            f"cancelled {a['job_id']}/{a['run_lease']} ran again"
            for a in cancels
            if not retried_after(a)
            and max(ran.get(a["job_id"], 0), receipts.get(a["job_id"], 0)) > a["run_lease"]
        ],
        f"{len(cancels)} cancels, {sum(map(retried_after, cancels))} retried after",
    )

    # 5. every callback's receiver rows match its job's end
    last_run = {j: max(ran.get(j, 0), receipts.get(j, 0)) for j in {*ran, *receipts}}
    read = {"callbacks": callbacks, "received": received, "admin": admin, "ends": ends}
    problems, callback_figures = _callbacks(engine, schema, read, last_run)
    f.hold(
        "every callback's receiver rows match its job's end",
        problems,
        f"{len(callbacks)} waits, {len(received)} receiver rows committed",
    )
    callback_counts = callback_figures | {
        "receivers answered None": len(tally.lost_callbacks),
        "None where a receiver committed": sum(
            c in {r["callback_id"] for r in received} for c in tally.lost_callbacks
        ),
    }

    # 6. queue counts equal the rows
    stats = _stats(engine)
    counted = rows(engine, _counted(schema))
    problems = [
        f"{c['queue']}: counted {c['counted']}, rows {c['rows']}"
        for c in counted
        if c["counted"] != c["rows"]
    ]
    qs_ends = Counter((e["queue"], e["state"]) for e in ends if e["plane"] != "canonical")
    for queue, s in stats.items():
        live = {k: v for k, v in s.items() if k not in ("completed_last_hour", "failed") and v}
        problems += [f"{queue} stats live: {live}"] if live else []
        for key, state in (("completed_last_hour", "completed"), ("failed", "failed")):
            if s[key] != qs_ends[(queue, state)]:
                problems.append(f"{queue} {key} {s[key]}, rows {qs_ends[(queue, state)]}")
    f.hold("queue counts and stats equal the rows", problems)

    # 7. no deadlock, no error but the expected answers
    [dead] = rows(
        engine, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    )
    expected = {
        "Completed",
        "Cancelled",
        "Failed",
        "Rescheduled",
        "Migrated",
        "CancelledDuplicate",
        "Stale",
        "AttemptNotFound",
        "Parked",
    }
    odd = [
        f"run {r['job']}/{r.get('lease')}: {r.get('answer')} {r.get('message', '')}"
        for r in runs
        if r.get("answer") not in expected
    ]
    f.hold(
        "no deadlock, no answer but the expected ones",
        [*tally.unexpected, *odd]
        + ([f"{dead['deadlocks']} deadlocks"] if dead["deadlocks"] else []),
        f"phase {phase['state']}; expected: Stale, AttemptNotFound, Parked, DuplicateJob, None, "
        "QueueStorageJobs, UniqueConflict (a retry onto a held key)",
    )
    if phase["state"] != "active":
        f.invariants.append(("the cluster ended finalized", False, str(phase)))

    # figures
    slow = [r for r in runs if r["plan"] == "slow" and r["attempt"] == 1 and "slept" in r]
    late = [r for r in slow if r["slept"] * 1000 > 500]
    cancelled_leases = {(a["job_id"], a["run_lease"]) for a in cancels}
    lost = [r for r in runs if r.get("answer") in ("Stale", "AttemptNotFound")]
    f.counts = {
        "ends": dict(Counter(f"{e['plane']} {e['state']}" for e in ends)),
        "answers": dict(sorted(tally.answers.items())),
        "handler runs": dict(Counter(r.get("answer") for r in runs)),
        "settles": sum(1 for r in runs if r.get("answer") not in ("AttemptNotFound", None)),
        "committed enqueues": sum(committed.values()),
        "races": {
            "slow runs past the deadline": len(late),
            "settle won past the deadline": sum(
                r.get("answer") not in ("Stale", "AttemptNotFound") for r in late
            ),
            "rescue or cancel won (Stale)": sum(r["answer"] == "Stale" for r in lost),
            "rescue or cancel won before the lookup": sum(
                r["answer"] == "AttemptNotFound" for r in lost
            ),
            "cancel won over a running handler": sum(
                (r["job"], r.get("lease")) in cancelled_leases for r in lost
            ),
        },
        "transitions": tally.transitions,
        "callbacks": callback_counts,
        "stats": stats,
    }
    return f


def format_table(f: Figures, label: str) -> str:
    width = max(len(name) for name, _, _ in f.invariants)
    lines = [f"service soak ({label}): invariants", "-" * (width + 40)]
    for name, held, detail in f.invariants:
        lines.append(f"{name:<{width}}  {'holds' if held else 'FAILS'}  {detail}")
    lines.append("-" * (width + 40))
    n = f.counts.get("committed enqueues", 0)
    settled = f.seconds.get("settled", 0.0)
    lines.append(
        f"{n} jobs, {f.counts.get('settles')} awa-sa settles; produced in "
        f"{f.seconds.get('produced', 0):.1f} s, all settled in {settled:.1f} s "
        f"({n / settled if settled else 0:.0f} jobs/s)"
    )
    for key in ("ends", "handler runs", "races", "callbacks", "answers", "transitions", "stats"):
        lines.append(f"{key}: {f.counts.get(key)}")
    return "\n".join(lines)


def _callbacks(
    engine: sa.Engine, schema: str, read: dict[str, list[dict[str, Any]]], last_run: dict[int, int]
) -> tuple[list[str], dict[str, Any]]:
    """Each wait a handler recorded, against its receivers' committed rows and its job's end: at
    most one row; a ``complete`` or ``fail`` row's job ended there (completed, failed) at that
    wait's lease, unless an admin retry came after; a ``retry`` row's job ran again; a wait with
    no row was ended by the timeout rescue (the job ran again, and its errors hold one
    "callback timed out" for each such wait) or by the admin. No job ended twice."""
    callbacks, received, admin, ends = (read[k] for k in ("callbacks", "received", "admin", "ends"))
    final = {e["job_id"]: e for e in ends}
    rows_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in received:
        rows_of[r["callback_id"]].append(r)
    admin_at: dict[tuple[int, int], list[Any]] = defaultdict(list)
    retried_at: dict[int, Any] = {}
    for a in admin:
        if a["answer"] == "JobRow":
            admin_at[(a["job_id"], a["run_lease"])].append(a["at"])
            if a["verb"] != "cancel":
                retried_at[a["job_id"]] = max(a["at"], retried_at.get(a["job_id"], a["at"]))
    problems = [f"job {j} ended {n} times" for j, n in Counter(e["job_id"] for e in ends).items()]
    problems = [p for p in problems if not p.endswith(" 1 times")]
    outcome: Counter[str] = Counter()
    unanswered: Counter[int] = Counter()
    by_admin: Counter[int] = Counter()
    for c in callbacks:
        job, lease, got = c["job_id"], c["run_lease"], rows_of[c["callback_id"]]
        later = last_run.get(job, 0) > lease
        admin_after = any(at > c["at"] for at in admin_at[(job, lease)])
        name = f"callback {c['callback_id']} (job {job}/{lease})"
        if len(got) > 1:
            problems.append(f"{name}: {len(got)} receiver rows {[r['action'] for r in got]}")
        if not got:
            outcome["rescued" if not admin_after else "ended by the admin"] += 1
            unanswered[job] += 1
            by_admin[job] += admin_after
            if not later and not admin_after:
                problems.append(f"{name}: no receiver row, and the job never ran again")
            continue
        r = got[0]
        outcome[r["action"]] += 1
        if (r["run_lease"], r["state"]) != (lease, STATE_OF[r["action"]]):
            problems.append(f"{name}: {r['action']} row says {r['state']} at {r['run_lease']}")
        if r["action"] == "retry":
            if not later and not admin_after:
                problems.append(f"{name}: retried, and the job never ran again")
            continue
        if job in retried_at and retried_at[job] > r["at"]:
            outcome[f"{r['action']}, then retried by the admin"] += 1
            continue
        end = final.get(job)
        if end is None or (end["run_lease"], end["state"]) != (lease, STATE_OF[r["action"]]):
            problems.append(f"{name}: {r['action']} row, but the job ended {end}")
        if later:
            problems.append(f"{name}: {r['action']} row, but the job ran again")
    timed_out: Counter[int] = Counter()
    ids = ",".join(str(j) for j in unanswered) or "0"
    errors_of = f"""SELECT id AS job_id, to_jsonb(errors) AS errors FROM awa.jobs_hot
    WHERE id IN ({ids})
    UNION ALL SELECT d.job_id, coalesce(d.payload, r.payload) -> 'errors'
    FROM {schema}.done_entries AS d LEFT JOIN {schema}.ready_entries AS r
      ON (r.job_id, r.lane_seq, r.enqueue_shard) = (d.job_id, d.lane_seq, d.enqueue_shard)
    WHERE d.job_id IN ({ids})"""
    # A done row without a payload of its own has its ready entry's; a compact completion keeps
    # no errors: not counted.
    for r in rows(engine, errors_of):
        errors = r["errors"] or []
        timed_out[r["job_id"]] = sum(e.get("error") == "callback timed out" for e in errors)
    for job, n in timed_out.items():
        if not unanswered[job] - by_admin[job] <= n <= unanswered[job]:
            problems.append(f"job {job}: {unanswered[job]} waits unanswered, {n} timed out")
    outcome["timeouts in the errors of the jobs that keep them"] = sum(timed_out.values())
    return problems, {"waits": len(callbacks), "resolved": len(received), **dict(outcome)}
