"""Lineage: the records that made a weight version, found by joining positions in the log.

A weight manifest names the admitted records of its step (``step_inputs``); an admitted sample
names its trajectory (for an online sample: the served record), its reward records
(``reward_refs``) and, online, its feedback record (``feedback``); a decision names its task's
release (``task_ref``). ``trace`` follows those positions, so lineage is a join, never a search:
every record is read at the position its parent names (``read_to_end.read_at``).

Rules:

- the log only: manifests come from the run's manifest log (read as an audit, like replay), every
  other record from its position; nothing is written;
- a mirrored copy (``source``, a region name): every topic is read as MirrorMaker's copy from that
  region (``SOURCE.TOPIC``, the resolution ``ManifestLog.of_run`` uses). Every record read is
  checked against what its parent says it is (run, group, sample, judge, task); a copy whose
  offsets differ from the source's (MirrorMaker keeps data, not offsets) fails that check and is
  reported as an error, never answered wrongly;
- an unknown run, a version the run does not have, or a position that holds nothing is a
  ``LineageError`` naming what is missing;
- a record written before the trace fields existed joins what it can: its rewards from the
  sample's score map (no detail), its task by id only (no family, no split).

``versions_with(ref)`` answers the reverse question: the versions one of whose samples names the
record at ``ref`` (its admitted record, trajectory, served record, a reward, its feedback or its
task release).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rlstream.consumers.read_to_end import lookup_reader, read_at
from rlstream.consumers.run_log import run_manifest
from rlstream.consumers.weights.manifest_log import manifests_by_version
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import reassembly, topics
from rlstream.schemas.errors import RlstreamError

Position = tuple[str, int, int]


class LineageError(RlstreamError, LookupError):
    """A run, version or record that the log does not hold (nothing is written)."""


def parse_position(text: str) -> dict[str, Any]:
    """``TOPIC:PARTITION:OFFSET`` as a RecordRef; ``ValueError`` saying what is wrong."""
    topic, sep, rest = text.rpartition(":")
    topic, sep2, partition = topic.rpartition(":")
    if not (sep and sep2 and topic and partition.isdigit() and rest.isdigit()):
        raise ValueError(f"{text!r} is not TOPIC:PARTITION:OFFSET (e.g. rl.r1.feedback:0:42)")
    return {"topic": topic, "partition": int(partition), "offset": int(rest)}


def position(ref: dict[str, Any] | None) -> Position | None:
    return None if ref is None else (ref["topic"], int(ref["partition"]), int(ref["offset"]))


def as_ref(where: Position) -> dict[str, Any]:
    return {"topic": where[0], "partition": where[1], "offset": where[2]}


class Log:
    """Records by position, read once each (one reader of its own, no group, no commits)."""

    def __init__(self, settings: KafkaSettings, source: str | None = None) -> None:
        self.source = source
        self._reader = lookup_reader(settings, "lineage")
        self._cache: dict[Position, dict[str, Any] | None] = {}

    def at(self, ref: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
        """The record at ``ref`` (None when ``ref`` is None); ``LineageError`` if absent."""
        where = position(ref)
        if where is None:
            return None
        if where not in self._cache:
            topic = topics.remote_topic(self.source, where[0])
            self._cache[where] = read_at(self._reader, topic, where[1], where[2])
        found = self._cache[where]
        if found is None:
            copy = f" (copy from {self.source})" if self.source else ""
            raise LineageError(f"no {what} at {where[0]}:{where[1]}:{where[2]}{copy}")
        return found

    def close(self) -> None:
        self._reader.close()


@dataclass
class Group:
    """One admitted decision of a step, joined from its parts, and where its parts lie."""

    decision: dict[str, Any]
    parts: list[Position]


@dataclass
class TracedSample:
    """One trained sample and every record it joins to (None where the log has no link)."""

    group: Group
    sample: dict[str, Any]
    trajectory: dict[str, Any] | None = None
    task: dict[str, Any] | None = None
    rewards: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    feedback: dict[str, Any] | None = None

    def positions(self) -> set[Position]:
        """Every position this sample names (its admitted parts included)."""
        s, out = self.sample, set(self.group.parts)
        for ref in (s.get("trajectory"), s.get("feedback"), self.group.decision.get("task_ref")):
            if (where := position(ref)) is not None:
                out.add(where)
        out |= {p for _, r in self.rewards if (p := position(r)) is not None}
        return out


class Lineage:
    """The lineage of one run's versions (see the module rules)."""

    def __init__(self, settings: KafkaSettings, run: str, source: str | None = None) -> None:
        self.run, self.source = run, source
        self.manifests = manifests_by_version(settings, run, audit=True, source=source)
        topic = topics.remote_topic(source, topics.RUNS_TOPIC)
        if not self.manifests and run_manifest(settings, run, topic=topic) is None:
            raise LineageError(f"unknown run {run!r}: no run manifest and no weight version")
        self.log = Log(settings, source)

    def check_version(self, version: int) -> dict[str, Any]:
        if version not in self.manifests:
            have = f"0..{max(self.manifests)}" if self.manifests else "none"
            raise LineageError(f"run {self.run!r} has no version {version} (versions: {have})")
        return self.manifests[version]

    def groups(self, version: int) -> list[Group]:
        """The admitted groups version ``version`` trained on, in training order."""
        parts, out = reassembly.group_reassembler(), []
        names: list[Position] = []
        for ref in self.check_version(version)["step_inputs"]:
            record = self.log.at(ref, f"admitted record of version {version}")
            assert record is not None and position(ref) is not None
            if record.get("run") != self.run or record.get("decision") != "admitted":
                raise LineageError(f"{ref} is not an admitted decision of run {self.run!r}")
            names.append(position(ref))  # type: ignore[arg-type]
            joined = parts.add(record)
            if joined is not None:
                out.append(Group(joined, names))
                names = []
        return out

    def samples(self, version: int) -> Iterator[TracedSample]:
        for group in self.groups(version):
            for sample in group.decision["samples"]:
                yield self.join(group, sample)

    def join(self, group: Group, sample: dict[str, Any]) -> TracedSample:
        """``sample`` with its trajectory, task, rewards and feedback read at their positions."""
        d, index = group.decision, int(sample["sample_index"])
        out = TracedSample(group, sample)
        out.trajectory = self.log.at(sample.get("trajectory"), "trajectory")
        if out.trajectory is not None and d["source"] == "rollout":
            _expect(out.trajectory, {"group_id": d["group_id"], "sample_index": index}, sample)
        out.task = self.log.at(d.get("task_ref"), "task")
        if out.task is not None:
            _expect(out.task, {"task_id": d["task_id"]}, d["task_ref"])
        for ref in sample.get("reward_refs") or []:
            reward = self.log.at(ref, "reward")
            assert reward is not None
            _expect(reward, {"group_id": d["group_id"], "sample_index": index}, ref)
            out.rewards.append((reward, ref))
        out.feedback = self.log.at(sample.get("feedback"), "feedback")
        return out

    def versions_with(self, ref: dict[str, Any]) -> list[int]:
        """The versions one of whose samples names the record at ``ref``."""
        where = position(ref)
        found = [
            v
            for v in sorted(self.manifests)
            if any(where in s.positions() for s in self.samples(v))
        ]
        return found

    def close(self) -> None:
        self.log.close()


def _expect(record: dict[str, Any], fields: dict[str, Any], named_by: Any) -> None:
    """Refuse a record that is not the one its parent names (a copy with other offsets)."""
    wrong = {k: record.get(k) for k, v in fields.items() if record.get(k) != v}
    if wrong:
        raise LineageError(
            f"the record named by {named_by!r} is not the expected one ({wrong} instead of "
            f"{fields}): a copy whose offsets differ from its source's?"
        )


def sample_json(s: TracedSample) -> dict[str, Any]:
    """One sample in the JSON shape of ``rlstream lineage --json``."""
    d, sample, traj = s.group.decision, s.sample, s.trajectory or {}
    where = sample.get("trajectory") or {}
    task = s.task or {}
    if s.rewards:
        rewards = [
            {"judge": r["judge"], "score": r["score"], "detail": r.get("rationale") or None}
            for r, _ in s.rewards
        ]
    else:  # online samples, and records written before reward_refs
        rewards = [
            {"judge": k, "score": v, "detail": None} for k, v in sorted(sample["rewards"].items())
        ]
    feedback = None
    if s.feedback is not None:
        feedback = {
            "user_hash": s.feedback["user_id_hash"],
            "feedback_id": s.feedback["feedback_id"],
            "served": {k: where.get(k) for k in ("topic", "partition", "offset")},
        }
    return {
        "trajectory": {
            "topic": where.get("topic"),
            "partition": where.get("partition"),
            "offset": where.get("offset"),
            "region": traj.get("region", sample.get("region")),
            "worker": traj.get("worker_id"),
            "engine": traj.get("engine"),
            "behaviour_version": int(sample["policy_version"]),
        },
        "task": {
            "family": task.get("family", d.get("task_class")),
            "task_id": d["task_id"],
            # the scheduler releases training tasks only (held-out ones are the eval role's)
            "split": (task.get("tags") or {}).get("split", "train") if task else None,
        },
        "rewards": rewards,
        "feedback": feedback,
        "admitted": as_ref(s.group.parts[0]),
    }


def version_json(lineage: Lineage, version: int) -> dict[str, Any]:
    """``{"run", "version", "samples"}`` of one version."""
    samples = [sample_json(s) for s in lineage.samples(version)]
    return {"run": lineage.run, "version": version, "samples": samples}
