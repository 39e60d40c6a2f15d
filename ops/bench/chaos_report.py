"""What ``rlstream bench chaos`` reports: several seeds' runs combined, whether a run held, and
the lines it prints (the runs themselves: ``ops.bench.chaos``)."""

from __future__ import annotations

from typing import Any

#: Figures that add up over seeds (counts); the others are kept per seed only.
_SUMMED = [
    "tasks",
    "groups_released",
    "groups_reissued",
    "groups_decided",
    "groups_admitted",
    "groups_lost",
    "groups_decided_twice",
    "groups_decided_unreleased",
    "groups_trained",
    "groups_trained_twice",
    "groups_trained_unadmitted",
    "inputs_trained",
    "inputs_trained_twice",
    "groups_admitted_untrained",
    "groups_rejected_unjudged",
    "poison_injected",
    "poison_dead_lettered",
    "poison_missed",
    "poison_groups_decided",
    "poison_trained",
    "dead_letters",
    "dead_letters_of_genuine_records",
    "forged_injected",
    "forged_refused",
    "forged_refusals_logged",
    "genuine_refused",
    "role_kills",
    "role_restarts",
    "roles_given_up",
    "broker_kills",
    "feedback_replays",
    "feedback_replays_refused",
    "feedback_replays_deduplicated",
    "feedback_stored",
    "leader_kills",
    "coordinator_kills",
    "controller_kills",
    "rolling_restarts",
    "wall_seconds",
]


def combine(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One run's figures as they are (with ``seeds``); several runs' counts summed, the
    attacks' tries and refusals summed per kind, the broker stalls pooled (``max_stall_s`` over
    all of them), and each run's own figures under ``per_seed``."""
    if len(runs) == 1:
        return {**runs[0], "seeds": seeds}
    out: dict[str, Any] = {"seeds": seeds, "finished": all(r["finished"] for r in runs)}
    for key in _SUMMED:
        if all(key in r for r in runs):
            out[key] = round(sum(r[key] for r in runs), 1)
    kinds = sorted({k for r in runs for k in r["attacks"]})
    out["attacks"] = {
        k: {
            field: sum(r["attacks"].get(k, {}).get(field, 0) for r in runs)
            for field in ("tried", "refused")
        }
        for k in kinds
    }
    out["held_per_seed"] = [held(r) for r in runs]
    out["final_success_per_seed"] = [r["final_success"] for r in runs]
    out["brokers"] = runs[0]["brokers"]
    if all("stalls_s" in r for r in runs):
        stalls = [s for r in runs for s in r["stalls_s"]]
        known = [s for s in stalls if s is not None]
        out["replication_factor"] = runs[0]["replication_factor"]
        out["stalls_s"] = stalls
        out["max_stall_s"] = max(known) if known else None
        for key in ("faults_after_the_work", "faults_never_recovered"):
            if all(key in r for r in runs):
                out[key] = sum(r[key] for r in runs)
        if all("stall_kinds" in r for r in runs):
            out["stall_kinds"] = [k for r in runs for k in r["stall_kinds"]]
            left = [w for r in runs for w in r.get("stall_work_left", [True] * len(r["stalls_s"]))]
            out["stall_work_left"] = left
            out["max_stall_s_by_kind"] = max_by_kind(out["stall_kinds"], stalls, left)
    out["per_seed"] = runs
    return out


def max_by_kind(
    kinds: list[str], stalls: list[float | None], work_left: list[bool]
) -> dict[str, float | None]:
    """The longest stall after each kind of broker fault (None: no version came after one
    that struck while work was left); a fault after the work ended counts for nothing."""
    out: dict[str, float | None] = {}
    for kind, stall, left in zip(kinds, stalls, work_left, strict=True):
        if stall is None and not left:
            continue
        if stall is None or out.get(kind, 0.0) is None:
            out[kind] = None
        else:
            out[kind] = max(out.get(kind, 0.0) or 0.0, stall)
    return dict(sorted(out.items()))


def held(r: dict[str, Any]) -> bool:
    """The run survived: nothing lost, decided twice or trained twice, no poison trained, no
    role given up, no genuine manifest refused, the replayed feedback stored once; with several
    seeds, every run did."""
    if "per_seed" in r:
        return all(held(one) for one in r["per_seed"])
    if r.get("faults_never_recovered"):
        return False  # work was left and no version ever came after a broker fault
    zero = (
        "groups_lost",
        "groups_decided_twice",
        "groups_trained_twice",
        "inputs_trained_twice",  # absent from results kept before it was counted
        "poison_trained",
        "roles_given_up",
        "genuine_refused",
    )
    attacks_held = all(held_off(a) for a in r["attacks"].values())
    return all(r.get(k, 0) == 0 for k in zero) and r["feedback_stored"] == 1 and attacks_held


def held_off(attempts: dict[str, int]) -> bool:
    """An attack kind was tried and refused every time."""
    return attempts["tried"] > 0 and attempts["refused"] == attempts["tried"]


def lines(r: dict[str, Any]) -> list[str]:
    if "per_seed" in r:
        out: list[str] = []
        for seed, one in zip(r["seeds"], r["per_seed"], strict=True):
            out += [f"seed {seed}:", *(f"  {line}" for line in lines(one))]
        stall = f", max stall {r['max_stall_s']} s" if "max_stall_s" in r else ""
        return [
            *out,
            f"over {len(r['seeds'])} seeds: {r['groups_lost']} lost, "
            f"{r['groups_trained_twice']} trained twice, held {r['held_per_seed']}{stall}",
        ]
    return [
        f"groups: {r['groups_released']} released, {r['groups_decided']} decided, "
        f"{r['groups_lost']} lost, {r['groups_trained_twice']} trained twice "
        f"({r['groups_trained']} trained, {r['groups_reissued']} re-issued)",
        f"inputs: {r.get('inputs_trained', '?')} trained, "
        f"{r.get('inputs_trained_twice', '?')} twice; admitted never trained "
        f"{r.get('groups_admitted_untrained', '?')}, rejected unjudged (judge_error) "
        f"{r.get('groups_rejected_unjudged', '?')}; dead letters of genuine records by reason "
        f"{r.get('dead_letters_of_genuine_records_by_reason', '?')}",
        f"replayed from the record: versions 0-{r.get('replay_reproduced_through', '?')} "
        f"reproduced bit-exactly{'; ' + r['replay_detail'] if r.get('replay_detail') else ''}",
        f"faults: {r['role_kills']} role kills ({r['role_restarts']} restarts logged, "
        f"{r['roles_given_up']} given up), {r['broker_kills']} broker kills",
        f"poison: {r['poison_dead_lettered']} of {r['poison_injected']} records dead-lettered "
        f"({r['poison_missed']} missed; {r['dead_letters_by_reason']}), "
        f"{r['poison_trained']} poison groups trained",
        f"forged manifests: {r['forged_refused']} of {r['forged_injected']} refused "
        f"({r['forged_refusals_logged']} refusals logged by the roles)",
        "attacks refused: "
        + ", ".join(f"{k} {a['refused']}/{a['tried']}" for k, a in r["attacks"].items()),
        f"feedback replays: {r['feedback_replays_refused']} of {r['feedback_replays']} refused, "
        f"{r['feedback_replays_deduplicated']} answered as duplicates; stored "
        f"{r['feedback_stored']} time(s)",
        f"success: {r['warm_start_success']} (v0) -> {r['final_success']} "
        f"(v{r['final_versions']}); {r['wall_seconds']} s",
        *_failover_lines(r),
    ]


def _failover_lines(r: dict[str, Any]) -> list[str]:
    if "max_stall_s" not in r:
        return []
    return [
        f"brokers: {r['brokers']} (replication factor {r['replication_factor']}): "
        f"{r['leader_kills']} leader, {r['coordinator_kills']} coordinator and "
        f"{r['controller_kills']} controller kills, {r['rolling_restarts']} rolling restarts; "
        f"stall after each {_each_stall(r)} (max {r['max_stall_s']} s; versions every "
        f"{r.get('version_gap_p50_s')} s, median, without a fault; "
        f"{r.get('faults_after_the_work', 0)} struck after the work ended, "
        f"{r.get('faults_never_recovered', 0)} never recovered from)"
    ]


def _each_stall(r: dict[str, Any]) -> str:
    if "stall_kinds" not in r:
        return f"{r['stalls_s']} s"
    return ", ".join(f"{k} {s} s" for k, s in zip(r["stall_kinds"], r["stalls_s"], strict=True))
