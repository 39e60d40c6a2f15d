"""Where a run's time between two policy versions goes: the critical path of each version.

Version v's interval runs from the learner's end of training v-1 (manifest ``created_ms`` of
v-1) to its end of training v. The learner could not train v before the *last* group of its step
was admitted, so that group's path is the critical one; its marks, in order:

    publish       v-1's chunks and manifest written (the manifest's Kafka timestamp)
    kafka_hops    the scheduler saw v-1 and released the first task of v's groups
    refill        the group's task was released (after the first of v's groups: in a
                  synchronous run, the rounds that did not give a whole step; in an
                  asynchronous one, releases paced by the staleness budget)
    queued        a worker started the group (it was busy with other groups until then)
    generate      the worker's model finished the group's samples
    environment   the group's environment time ended (its trajectories' ``finished_ms``)
    judges        the last judge's reward of the group (``created_ms``)
    admission     admission decided the group (``decided_ms``)
    kafka_hops    the learner started training v (end minus its ``step_s``)
    train         the learner finished training v

Each stage gets the time from the previous mark to its own, clipped to the interval: in a
synchronous run every stage lies inside it; in an asynchronous one the group was released and
generated while v-1 trained, so those stages get nothing and the interval is mostly training and
waiting for admission. The stages of one interval add up to the interval.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

STAGES = (
    "publish",
    "kafka_hops",
    "refill",
    "queued",
    "generate",
    "environment",
    "judges",
    "admission",
    "train",
)


def split_interval(start: float, end: float, marks: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds of ``[start, end]`` per stage: each stage runs from the previous mark (or
    ``start``) to its own mark, every mark clipped into the interval and never before the
    previous one; what is left after the last mark goes to the last stage."""
    out = dict.fromkeys(STAGES, 0.0)
    t = start
    for stage, mark in marks:
        m = min(max(mark, t), end)
        out[stage] += m - t
        t = m
    if marks:
        out[marks[-1][0]] += end - t
    return out


def version_marks(
    prev: dict[str, Any], version: dict[str, Any], group: dict[str, Any], first_release_ms: int
) -> list[tuple[str, float]]:
    """The marks (seconds) of ``version``'s interval for its last admitted ``group`` (the
    fields ``read_run`` gathers); ``first_release_ms``: the first release of its groups."""
    train_start = version["created_ms"] - 1000 * version["step_s"]
    return [
        ("publish", prev["published_ms"] / 1000),
        ("kafka_hops", first_release_ms / 1000),
        ("refill", group["released_ms"] / 1000),
        ("queued", group["started_ms"] / 1000),
        ("generate", (group["finished_ms"] - group["env_ms"]) / 1000),
        ("environment", group["finished_ms"] / 1000),
        ("judges", group["rewarded_ms"] / 1000),
        ("admission", group["decided_ms"] / 1000),
        ("kafka_hops", train_start / 1000),
        ("train", version["created_ms"] / 1000),
    ]


def breakdown(run: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds per version interval by stage over versions 2..last (version 1's interval
    starts at the warm start), the mean interval, and the learner's idle share (neither
    training nor publishing)."""
    versions, groups = run["versions"], run["groups"]
    totals: dict[str, float] = defaultdict(float)
    counted = 0
    for v in sorted(versions):
        if v < 2 or v - 1 not in versions:
            continue
        mine = [groups[g] for g in versions[v]["groups"] if g in groups]
        if not mine:
            continue
        last = max(mine, key=lambda g: g["decided_ms"])
        prev, cur = versions[v - 1], versions[v]
        parts = split_interval(
            prev["created_ms"] / 1000,
            cur["created_ms"] / 1000,
            version_marks(prev, cur, last, min(g["released_ms"] for g in mine)),
        )
        for stage, seconds in parts.items():
            totals[stage] += seconds
        counted += 1
    if counted == 0:
        return {"versions": 0}
    per = {stage: totals[stage] / counted for stage in STAGES}
    interval = sum(per.values())
    return {
        "versions": counted,
        "interval_s": interval,
        "stages_s": per,
        "learner_idle": 1 - (per["train"] + per["publish"]) / interval if interval else 0.0,
    }


def read_run(settings: Any, run: str) -> dict[str, Any]:
    """A run's versions (``created_ms``, ``published_ms``, ``step_s``, the group ids trained)
    and groups (``released_ms``, ``started_ms``, ``finished_ms``, ``env_ms``, ``rewarded_ms``,
    ``decided_ms``), read from its streams."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import events, topics

    def records(stream: str) -> Any:
        name = topics.topic_name(run, stream)
        for msg in read_topic(settings, name, name="bench-path"):
            try:
                yield msg, events.decode(msg.value() or b"").record
            except events.DecodeError:
                continue

    groups: dict[str, dict[str, Any]] = defaultdict(dict)
    for _, rec in records("tasks"):
        groups[rec["task_id"]]["released_ms"] = int(rec["created_ms"])  # the last release
    for _, rec in records("trajectories"):
        g, t = groups[rec["group_id"]], rec["timings"]
        g["started_ms"] = min(g.get("started_ms", t["started_ms"]), t["started_ms"])
        g["finished_ms"] = max(g.get("finished_ms", 0), t["finished_ms"])
        g["env_ms"] = max(g.get("env_ms", 0), t["env_ms"])
    for _, rec in records("rewards"):
        g = groups[rec["group_id"]]
        g["rewarded_ms"] = max(g.get("rewarded_ms", 0), int(rec["created_ms"]))
    at: dict[tuple[str, int, int], str] = {}
    for msg, rec in records("admitted"):
        at[(msg.topic(), msg.partition(), msg.offset())] = rec["group_id"]
        groups[rec["group_id"]]["decided_ms"] = int(rec["decided_ms"])
    versions: dict[int, dict[str, Any]] = {}
    for msg, rec in records("weights.manifests"):
        v = int(rec["version"])
        if v in versions:
            continue  # a re-published copy: the first one counts
        trained = {at.get((r["topic"], r["partition"], r["offset"])) for r in rec["step_inputs"]}
        versions[v] = {
            "created_ms": int(rec["created_ms"]),
            "published_ms": int(msg.timestamp()[1]),
            "step_s": float((rec.get("stats") or {}).get("step_s", 0.0)),
            "groups": sorted(g for g in trained if g is not None),
        }
    complete = ("released_ms", "started_ms", "rewarded_ms", "decided_ms")
    return {
        "versions": versions,
        "groups": {k: g for k, g in groups.items() if all(f in g for f in complete)},
    }
