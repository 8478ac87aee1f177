"""The bench's printed report: one table per part, ratios always within this one run."""

from __future__ import annotations

import statistics
from typing import Any

from bench.layers import BUILDS_ON

TARGET = {"Engine": 0.85, "Connection": 0.95, "AsyncEngine": 0.95, "AsyncConnection": 0.95}
"""Each awa-sa form's median over its driver's floor, at most (loopback): BEGIN/lock/move/COMMIT
for the Engine forms, the lock and move inside an open transaction for the Connection forms."""
TARGET_GROUPS = {
    "Engine": ("psycopg",),
    "Connection": ("psycopg",),
    "AsyncConnection": ("psycopg async", "asyncpg"),
}
"""Where a form's floor target is set only for some drivers (issue 26: on the drivers that
prepare; psycopg2's and pg8000's Engine forms have theirs against the one-statement floor);
elsewhere the ratio is shown without a verdict."""
ONE_TARGET = {"psycopg": 1.30, "psycopg async": 1.30, "asyncpg": 1.30, "psycopg2": 1.25}
ONE_TARGET |= {"pg8000": 1.25}
"""The Engine (or AsyncEngine) form over its driver's one-statement floor, at most."""
FAR_TARGET = {"Engine": 0.50}
"""The Engine form over the BEGIN/lock/move/COMMIT floor with the server 0.5 ms away, at most."""
ROUND_TRIPS = {"Engine": 1.0, "AsyncEngine": 1.0, "Connection": 1.0, "AsyncConnection": 1.0}
"""Per canonical call; the Connection forms' inside the caller's open transaction."""
SERVER_TARGET = 0.60
"""awa-sa's server time per canonical call over the two-statement path's, at most."""


def report(r: dict[str, Any]) -> None:
    m = r["machine"]
    cpus = m.get("cpu_affinity", [])
    pinned = f" (bench and server on CPU {cpus[0]} alone)" if len(cpus) == 1 else ""
    print(
        f"{m['platform']}, {m['cpus']} CPUs{pinned}, Python {m['python']};"
        f" cluster: {m['cluster']};"
        f" load average {_load(m['load_average_before'])} before,"
        f" {_load(m['load_average_after'])} after"
    )
    if "single" in r:
        _single(r["single"])
    if "breakdown" in r:
        _breakdown(r["breakdown"])
    if "layers" in r:
        _layers(r["layers"])
    if "distance" in r:
        _distance(r["distance"])
    if "server" in r:
        _server(r["server"])
    if "callers" in r:
        _callers(r["callers"])
    if "routing" in r:
        print("5. routing, psycopg Engine form (median per call)")
        for name, median in r["routing"].items():
            print(f"  {name:26} {median:9.1f} µs")
    for key, title in (("batch", "canonical"), ("batch_queue_storage", "queue storage")):
        if key not in r:
            continue
        print(f"batch vs single calls, {title} routing (attempts per second)")
        for size, row in r[key].items():
            speedup = row["batch_per_s"] / row["single_per_s"]
            print(
                f"  N={size:<5} batch {row['batch_per_s']:10.0f}/s   single"
                f" {row['single_per_s']:8.0f}/s   {speedup:6.1f}x"
            )
    if "endings" in r:
        _endings(r["endings"])
    if "receipts" in r:
        _endings(
            r["receipts"],
            "7. a queue-storage completion, psycopg 3, against its own two statements sent raw",
        )
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in r["parts_seconds"].items())
    print(f"parts: {parts}")


def _load(avg: tuple[float, ...]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def floor_of(name: str) -> str:
    """The floor a variant is judged against: a Connection form runs inside an open transaction."""
    return "in-transaction floor" if name.endswith("Connection") else "floor"


def ratios(
    single: dict[str, Any], key: str = "wall_us", floor: str | None = None
) -> dict[str, float]:
    """Each variant's median over its own driver's *floor* (by default :func:`floor_of` it)."""
    figures, groups = single["variants"], single["groups"]
    return {
        name: row[key] / figures[f"{groups[name]} {floor or floor_of(name)}"][key]
        for name, row in figures.items()
    }


def spread(
    part: dict[str, Any], key: str = "wall_us", floor: str | None = None
) -> dict[str, tuple[float, float, float]]:
    """Each variant's ratio to its floor in every round: ``(median, min, max)`` across rounds."""
    per_round = [
        ratios({"variants": figures, "groups": part["groups"]}, key, floor)
        for figures in part.get("rounds") or [part["variants"]]
    ]
    out = {}
    for name in per_round[0]:
        values = sorted(r[name] for r in per_round)
        out[name] = (statistics.median(values), values[0], values[-1])
    return out


def _cell(r: tuple[float, float, float]) -> str:
    return f"{r[0]:4.2f}x [{r[1]:4.2f}-{r[2]:4.2f}]"


def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"{target:.2f}x {'met' if ratio <= target else 'MISSED'}"


def _form(name: str) -> str | None:
    return name.rsplit(" ", 1)[-1] if "awa-sa" in name else None


def floor_target(group: str, form: str | None) -> float | None:
    if form is None or group not in TARGET_GROUPS.get(form, (group,)):
        return None
    return TARGET.get(form)


def one_target(group: str, form: str | None) -> float | None:
    return ONE_TARGET.get(group) if form in ("Engine", "AsyncEngine") else None


def _single(single: dict[str, Any]) -> None:
    n = len(single.get("rounds") or [0])
    print(
        f"1. one canonical reschedule per call, server on loopback: {n} independent rounds,"
        " ratios as median [min-max] across rounds"
    )
    print(
        f"  {'':42} {'wall':>9} {'/floor':>18} {'target':>12} {'/one':>18} {'target':>12}"
        f" {'/pool':>18}  {'client CPU':>10} {'/one':>6} {'/pool':>6}"
    )
    print(
        "  /one: over the one-statement floor, on a connection the client keeps;"
        " /pool: over the pool floor, the same statement on a connection checked out of"
        " the pool per call"
    )
    wall, one = spread(single), spread(single, floor="one-statement floor")
    pool = spread(single, floor="pool floor")
    cpu = ratios(single, "cpu_us", "one-statement floor")
    cpu_pool = ratios(single, "cpu_us", "pool floor")
    for name, row in single["variants"].items():
        form, group = _form(name), single["groups"][name]
        print(
            f"  {name:42} {row['wall_us']:7.1f}µs {_cell(wall[name]):>18}"
            f" {_verdict(wall[name][0], floor_target(group, form)):>12} {_cell(one[name]):>18}"
            f" {_verdict(one[name][0], one_target(group, form)):>12} {_cell(pool[name]):>18}"
            f"  {row['cpu_us']:8.1f}µs {cpu[name]:5.2f}x {cpu_pool[name]:5.2f}x"
        )
    for name, why in single["skipped"].items():
        print(f"  {name:36} not run: {why}")
    print(
        "  an awa-sa form's time over its one-statement floor = what it keeps (Engine"
        " forms: the pool floor; Connection forms: SQLAlchemy's exec_driver_sql) + ours"
        " (wall µs | client CPU µs; medians across rounds)"
    )
    figures = single["variants"]
    for name, row in figures.items():
        if "awa-sa" not in name:
            continue
        group = single["groups"][name]
        if name.endswith("Engine"):
            minimal = figures.get(f"{group} pool floor")
        else:
            minimal = figures.get(name.replace("awa-sa", "SQLAlchemy"))
        if minimal:
            cells = []
            for key in ("wall_us", "cpu_us"):
                base = figures[f"{group} one-statement floor"][key]
                gap, sa_part = row[key] - base, minimal[key] - base
                cells.append(f"{gap:+6.0f} = {sa_part:+6.0f} + {gap - sa_part:+5.0f}")
            print(f"    {name:34} {cells[0]}  |  {cells[1]}")


def _endings(
    part: dict[str, Any], title: str = "6. each ending, psycopg 3, against the worker's own UPDATE"
) -> None:
    n = len(part.get("rounds") or [0])
    print(
        f"{title} ({n} rounds; x its floor, median [min-max]; the Connection form against it"
        " inside an open transaction)"
    )
    wall = spread(part)
    for name, row in part["variants"].items():
        print(f"  {name:42} {row['wall_us']:9.1f} µs  {_cell(wall[name])}")


def _breakdown(steps: dict[str, dict[str, float]]) -> None:
    print("   SQLAlchemy's steps, each timed alone (client CPU µs; warm, so below part 1's share)")
    names = list(dict.fromkeys(name for group in steps.values() for name in group))
    print(f"     {'':52}" + "".join(f"{group:>15}" for group in steps))
    for name in names:
        cells = "".join(
            f"{steps[g][name]:15.1f}" if name in steps[g] else f"{'':15}" for g in steps
        )
        print(f"     {name:52}{cells}")


def _layers(cpu: dict[str, float]) -> None:
    print(
        "   awa-sa's layers over the pool floor, each in its real place (psycopg Engine form,"
        " client CPU µs per call)"
    )
    floor = cpu["pool floor"]
    for name, median in cpu.items():
        base = BUILDS_ON.get(name)
        step = (
            "" if base is None else f"  {median - cpu[base]:+6.1f} over {base.removeprefix('+ ')}"
        )
        print(f"     {name:32} {median:7.1f} µs  {median / floor:5.2f}x{step}")


def _distance(far: dict[str, Any]) -> None:
    print(
        f"2. the server {far['added_rtt_us'] / 1000:.2f} ms further away (measured per round"
        " trip); round trips counted at the proxy"
    )
    figures = far["variants"]
    for name, row in figures.items():
        floor = figures.get(f"{far['groups'][name]} {floor_of(name)}")
        ratio = row["wall_us"] / floor["wall_us"] if floor else float("nan")
        form = _form(name)
        trips = ROUND_TRIPS.get(form) if form else None
        trips_verdict = ""
        if trips is not None:
            trips_verdict = "met" if row["round_trips"] <= trips else "MISSED"
        print(
            f"  {name:42} {row['round_trips']:4.1f} round trips {trips_verdict:6}"
            f" {row['wall_us']:8.1f}µs  {ratio:5.2f}x"
            f" {_verdict(ratio, FAR_TARGET.get(form) if form else None):>12}"
        )


def _server(server: dict[str, Any]) -> None:
    print("3. database time per canonical reschedule (pg_stat_statements: execution + planning)")
    if "awa-sa" in server and "two statements" in server:
        ours, before = server["awa-sa"], server["two statements"]
        ratio = ours["ms_per_reschedule"] / before["ms_per_reschedule"]
        verdict = _verdict(ratio, SERVER_TARGET)
        print(f"  awa-sa over the two-statement path: {ratio:.2f}x {verdict}")
    for form, row in server.items():
        print(
            f"  {form:16} {row['ms_per_reschedule']:.3f} ms in"
            f" {row['statements_per_reschedule']:.1f} statements"
        )
        for s in row["statements"]:
            print(
                f"    {s['exec_ms']:.3f} + {s['plan_ms']:.3f} ms  x{s['per_call']:.1f}"
                f"  {' '.join(s['statement'].split())}"
            )


def _callers(callers: dict[str, Any]) -> None:
    print("4. concurrent callers, own connection each, psycopg (attempts per second, best round)")
    for name, row in callers.items():
        waits = ", ".join(f"{k} {v:.0%}" for k, v in list(row["waits"].items())[:4])
        server = row["server_us"]
        print(
            f"  {name:22} {row['per_s']:7.0f}/s  server: lock {server.get('lock', 0):5.1f}µs"
            f" move {server.get('move', 0):5.1f}µs one {server.get('one statement', 0):5.1f}µs"
            "  MultiXacts/attempt"
            f" {row['multixacts_per_attempt']:.2f}  backends: {waits}"
        )
    for name, row in callers.items():
        moved = {k: v for k, v in row["slru"].items() if v}
        if moved:
            print(f"  {name:22} MultiXact SLRU: {moved}")
