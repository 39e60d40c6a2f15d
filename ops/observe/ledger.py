"""A run's ledger, read back from its streams: what was released, decided and trained.

The ledger is how a fault test or the chaos bench proves that nothing was lost and nothing
trained twice, from the log alone (never from what a driver believes it did):

- released: per task id (= group id), each release on the tasks stream, ``(attempt, region)``
  in log order (a re-issued group has more than one);
- decided: per group id, one entry per decision on the admitted or rejected stream
  (``"admitted"`` or the rejection reason; the first part of a split decision only);
- trained: the group ids behind every published version's inputs, in version order (a keyframe
  and a delta of one version share their inputs and count once), and every input reference
  with its multiplicity (``inputs``: the same admitted record named twice, in one step or in
  two, is trained twice). Only manifests the run's manifest log accepts count: a forged,
  foreign-key or implausible manifest (refused by ``consumers.weights.manifest_log`` with the
  run's key) trains nothing.

``Ledger.figures`` states the rules as numbers: every released group decided (``groups_lost``
0), decided once, trained at most once and only when admitted. It also reports what is not a
failure by itself: admitted groups never trained (the run ended before their step) and
rejections that are no verdict on the samples (``judge_error``: the judge could not score
them). Group ids a caller names as foreign (a chaos driver's own poison, say) are counted
apart and never as lost.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlstream.consumers.read_to_end import read_topic
from rlstream.consumers.weights.manifest_log import ManifestLog
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics


@dataclass
class Ledger:
    """What the trainer region's streams say about a run's groups."""

    released: dict[str, list[tuple[int, str | None]]]  # task id -> [(attempt, region)] in order
    decided: dict[str, list[str]]  # group id -> ["admitted"] or [reason], one per decision
    trained: list[str]  # group ids behind every published version's inputs
    online: dict[str, list[str]] = field(default_factory=dict)
    """feedback-rl's decisions (``source`` online: groups of editor feedback, not of tasks)."""
    inputs: list[tuple[tuple[str, int, int], str]] = field(default_factory=list)
    """Every input reference of every accepted version, with its group id, as often as named."""

    @property
    def reissued(self) -> set[str]:
        return {t for t, r in self.released.items() if len(r) > 1}

    def figures(self, foreign: Callable[[str], bool] = lambda _: False) -> dict[str, int]:
        """The ledger's counts; a group id for which ``foreign`` holds was never released by
        the run and is counted in ``foreign_decided``/``foreign_trained`` only."""
        own = {g: v for g, v in self.decided.items() if not foreign(g)}
        counts = collections.Counter(g for g in self.trained if g not in self.online)
        named = collections.Counter(ref for ref, _ in self.inputs)
        for ref, group in dict(self.inputs).items():  # a record named twice trains it twice
            if group not in self.online and named[ref] > 1:
                counts[group] = max(counts[group], named[ref])
        admitted = {g for g, v in own.items() if v == ["admitted"]}
        released = set(self.released)
        return {
            "groups_released": len(self.released),
            "groups_reissued": len(self.reissued),
            "groups_decided": len(set(own) & set(self.released)),
            "groups_admitted": len(admitted & set(self.released)),
            "groups_lost": len(set(self.released) - set(own)),
            "groups_decided_twice": sum(1 for v in own.values() if len(v) > 1),
            "groups_decided_unreleased": len(set(own) - set(self.released)),
            "groups_trained": sum(1 for g in counts if not foreign(g)),
            "groups_trained_twice": sum(1 for c in counts.values() if c > 1),
            "groups_trained_unadmitted": sum(
                1 for g in counts if not foreign(g) and g not in admitted
            ),
            "inputs_trained": sum(named.values()),
            "inputs_trained_twice": sum(1 for c in named.values() if c > 1),
            "groups_admitted_untrained": len((admitted & released) - set(counts)),
            "groups_rejected_unjudged": sum(
                1 for g, v in own.items() if g in released and "judge_error" in v
            ),
            "foreign_decided": sum(1 for g in self.decided if foreign(g)),
            "foreign_trained": sum(1 for g in counts if foreign(g)),
            "online_decided": len(self.online),
            "online_trained": sum(1 for g in set(self.trained) if g in self.online),
        }


def read_ledger(settings: KafkaSettings, run: str, timeout: float = 60.0) -> Ledger:
    """The ledger of ``run`` from its streams in the region ``settings`` reaches."""
    manifests = accepted_manifests(settings, run, timeout)  # first: their inputs are read after
    released: dict[str, list[tuple[int, str | None]]] = collections.defaultdict(list)
    for rec, _ in _records(settings, topics.topic_name(run, "tasks"), "task", timeout):
        released[rec["task_id"]].append((rec["attempt"], (rec["tags"] or {}).get("region")))
    decided: dict[str, list[str]] = collections.defaultdict(list)
    online: dict[str, list[str]] = collections.defaultdict(list)
    by_ref: dict[tuple[str, int, int], str] = {}
    for stream in ("admitted", "rejected"):
        topic = topics.topic_name(run, stream)
        for rec, (partition, offset) in _records(settings, topic, "admission", timeout):
            if stream == "admitted":
                by_ref[(topic, partition, offset)] = rec["group_id"]
            if rec["part_index"] == 0:
                into = online if rec.get("source") == "online" else decided
                into[rec["group_id"]].append(rec["reason"] or "admitted")
    inputs = _inputs(manifests, by_ref)
    return Ledger(dict(released), dict(decided), _trained(manifests, by_ref), dict(online), inputs)


def trained_groups(settings: KafkaSettings, run: str, timeout: float = 60.0) -> list[str]:
    """Group ids behind every accepted version's inputs (from the manifests), in version order;
    the first accepted manifest of a version names its inputs."""
    manifests = accepted_manifests(settings, run, timeout)
    by_ref = {}  # read after the manifests: every input they name is there
    for msg in read_topic(
        settings, topics.topic_name(run, "admitted"), name="ledger", timeout=timeout
    ):
        by_ref[(msg.topic(), msg.partition(), msg.offset())] = (msg.key() or b"").decode()
    return _trained(manifests, by_ref)


def _trained(manifests: list[dict[str, Any]], by_ref: dict[Any, str]) -> list[str]:
    seen, groups = set(), []
    for rec in manifests:
        if rec["version"] in seen:
            continue  # a keyframe and a delta of one version share their inputs
        seen.add(rec["version"])
        refs = {(r["topic"], r["partition"], r["offset"]) for r in rec["step_inputs"]}
        groups += sorted({by_ref[r] for r in refs})
    return groups


def _inputs(
    manifests: list[dict[str, Any]], by_ref: dict[Any, str]
) -> list[tuple[tuple[str, int, int], str]]:
    """Every input reference of every accepted version (a version's first manifest), as often
    as its manifest names it, with the group id it holds."""
    seen, out = set(), []
    for rec in manifests:
        if rec["version"] in seen:
            continue
        seen.add(rec["version"])
        for r in rec["step_inputs"]:
            ref = (r["topic"], r["partition"], r["offset"])
            out.append((ref, by_ref[ref]))
    return out


def accepted_manifests(
    settings: KafkaSettings, run: str, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Every manifest record of ``run`` in log order, less those its manifest log refuses (not
    authentic, an older learner epoch, an implausible version)."""
    with ManifestLog.of_run(settings, run) as log:
        log.catch_up(timeout)
        refused = {(p, o) for p, o, _ in log.refused}
    topic = topics.topic_name(run, "weights.manifests")
    return [
        rec
        for rec, position in _records(settings, topic, "weight_manifest", timeout)
        if position not in refused
    ]


def _records(
    settings: KafkaSettings, topic: str, event: str, timeout: float
) -> list[tuple[dict[str, Any], tuple[int, int]]]:
    """The ``event`` records of ``topic`` with their (partition, offset), in log order per
    partition (records of another kind, or undecodable, skipped)."""
    out = []
    for msg in read_topic(settings, topic, name="ledger", timeout=timeout):
        try:
            decoded = events.decode(msg.value() or b"")
        except events.EventError:
            continue
        if decoded.event == event:
            out.append((decoded.record, (int(msg.partition() or 0), int(msg.offset() or 0))))
    return out
