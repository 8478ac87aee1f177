"""Which plane a transition phase puts running attempts on, and what awa-sa can do there.

The words ``awa-sa status`` prints and docs/attempts.md's table uses and explains.
"""

from __future__ import annotations

from typing import Protocol


class ClusterFacts(Protocol):
    """What :func:`explain` reads of a ``ClusterStatus``."""

    @property
    def plane(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def prepared_engine(self) -> str | None: ...
    @property
    def jobs(self) -> int | None: ...
    @property
    def auto_finalizes(self) -> bool | None: ...
    @property
    def recent_runtimes(self) -> int | None: ...


PLANES = {
    "canonical": "canonical",
    "prepared": "prepared",
    "mixed_transition": "mixed",
    "active": "queue storage",
}
"""The plane a transition phase puts attempts on, in the words docs/attempts.md uses."""

WHAT_AWA_SA_CAN_DO = {
    "canonical": (
        "every running attempt is a row of awa.jobs_hot: awa-sa lists, resolves and "
        "settles them every way"
    ),
    "prepared": (
        "routing is still canonical, so every running attempt is a row of awa.jobs_hot: awa-sa "
        "lists, resolves and settles them every way"
    ),
    "mixed": (
        "attempts claimed before the flip still run in awa.jobs_hot; new claims are "
        "queue-storage receipts: awa-sa lists, resolves (running_attempts, attempt_of) and "
        "settles both (awa_sa.settle), a bare (job_id, run_lease) only where it names one"
    ),
    "queue storage": (
        "new claims are queue-storage receipts, which awa-sa lists, resolves "
        "(running_attempts, attempt_of) and settles every way (awa_sa.settle); canonical "
        "attempts left from before the flip still settle"
    ),
}
"""What awa-sa 0.x can do with the running attempts of each plane."""


def explain(st: ClusterFacts) -> tuple[str, ...]:
    """The plane, what awa-sa can do there, and whether the cluster is fresh, as status lines."""
    lines = [f"plane        {st.plane}: {WHAT_AWA_SA_CAN_DO.get(st.plane, 'unknown phase')}"]
    fresh = st.auto_finalizes
    if st.phase not in ("canonical", "prepared"):
        return tuple(lines)  # past the gate: auto-finalize runs only on a canonical cluster
    if st.prepared_engine is not None or st.phase == "prepared":
        why = f"stays canonical: {st.prepared_engine or 'an engine'} is prepared"
    elif st.jobs:
        why = f"stays canonical: awa.jobs holds {st.jobs} job(s)"
    elif fresh is None:
        why = (
            "awa.jobs is empty; whether a runtime was seen in the last 90 s is not recorded "
            "(no awa.runtime_instances table)"
        )
    elif fresh:
        why = (
            "the first `auto` runtime to start finalizes it to queue storage (awa.jobs is "
            "empty, no runtime seen in the last 90 s); enqueue first, or run "
            "`awa storage prepare`, to stay canonical"
        )
    else:
        why = f"stays canonical for now: {st.recent_runtimes} runtime(s) seen in the last 90 s"
    lines.append(f"fresh        {why}")
    return tuple(lines)
