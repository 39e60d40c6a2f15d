"""Reproduce a run from its record, and manage runs.

``replay`` rebuilds the run's learner from the run manifest (resolved config, seeds; from the
run log) and feeds it the admitted records each weight manifest names (one manifest per version,
from the run's manifest log), in the recorded order, checking every new version's state hash
against the recorded one. On CPU the reproduction is bit-exact; the first divergence is reported
with the version and the first tensor whose hash differs. Manifests are read as an audit
(``ManifestLog(audit=True)``): a run recorded before weight keys replays unverified, and the
xxh3 hashes of old logs are compared under their own algorithm. A run whose learner had N ranks (its
manifests' ``stats.ranks``, else the recorded ``learner.ranks``) is replayed on N ranks (local
processes on gloo), as the gradient average is bit-exact for a given rank count only
(``trainer.distributed``).

``rescore`` re-judges a run's recorded trajectories with another judge into a second run's
topics (trajectories copied, rewards new), so two judges can be compared on the same data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlstream.consumers.run_log import run_manifests
from rlstream.consumers.tap import tap
from rlstream.consumers.weights.manifest_log import manifests_by_version
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import reassembly, topics
from rlstream.schemas.deltacodec.bits import state_hash
from rlstream.schemas.deltacodec.manifest import hash_algorithm


@dataclass
class ReplayResult:
    versions: int
    diverged_at: int | None = None
    tensor: str | None = None
    detail: str = ""


def admitted_by_ref(
    settings: KafkaSettings, run: str
) -> dict[tuple[str, int, int], dict[str, Any]]:
    records = {}
    for msg, decoded, _ in tap(settings, topics.topic_name(run, "admitted")):
        if decoded is not None:
            position = (str(msg.topic()), int(msg.partition() or 0), int(msg.offset() or 0))
            records[position] = decoded.record
    return records


def step_inputs(
    manifest: dict[str, Any], admitted: dict[tuple[str, int, int], dict[str, Any]]
) -> list[Any]:
    """The step's groups, in training order, joined from their parts."""
    from rlstream.trainer.learner_step import StepInput

    parts = reassembly.group_reassembler()
    inputs = []
    for ref in manifest["step_inputs"]:
        key = (ref["topic"], ref["partition"], ref["offset"])
        if key not in admitted:
            raise LookupError(
                f"admitted record {key} named by version {manifest['version']} is gone"
            )
        joined = parts.add(admitted[key])
        if joined is not None:
            inputs.append(StepInput(joined, [key]))
    return inputs


def recorded_ranks(manifests: dict[int, dict[str, Any]], configured: int) -> int:
    """The learner's rank count: the newest manifest's ``stats.ranks``, else ``configured``.

    Rule: a multi-rank learner records its rank count in every manifest's stats; a manifest
    without it was published by one rank (``configured`` decides only without manifests)."""
    if not manifests:
        return configured
    return int(manifests[max(manifests)]["stats"].get("ranks", 1))


def learner_config(settings: KafkaSettings, run: str) -> Any:
    from rlstream.ops.run.config import RunConfig
    from rlstream.trainer.config import LearnerConfig

    runs = run_manifests(settings)
    if run not in runs:
        raise LookupError(f"no run manifest for {run!r} in {topics.RUNS_TOPIC}")
    config = RunConfig.model_validate(json.loads(runs[run]["config_json"]))
    cfg = config.role("learner")
    assert isinstance(cfg, LearnerConfig)
    return cfg


def replay(
    settings: KafkaSettings,
    run: str,
    to_version: int | None = None,
    log: Callable[[str], None] = print,
    verifier: Any = None,
) -> ReplayResult:
    """Re-run the learner on the recorded admitted stream; see the module docstring.
    ``verifier``: the run's key, given (else this host's pin, else unverified)."""
    cfg = learner_config(settings, run)
    # old logs replay too; a forged manifest is refused wherever the run's key is known
    manifests = manifests_by_version(settings, run, audit=True, verifier=verifier)
    ranks = recorded_ranks(manifests, cfg.ranks)
    if ranks > 1:
        return _replay_ranks(settings, run, to_version, ranks, log, cfg, manifests)
    return _replay(settings, run, to_version, log, cfg, manifests)


def _replay_ranks(
    settings: KafkaSettings,
    run: str,
    to_version: int | None,
    world: int,
    log: Callable[[str], None],
    cfg: Any,
    manifests: dict[int, dict[str, Any]],
) -> ReplayResult:
    """``_replay`` on ``world`` local rank processes (gloo); rank 0's result."""
    from rlstream.ops.run.ranks import run_local_ranks

    args = (settings, run, to_version, cfg, manifests)
    lines, result = run_local_ranks(_replay_rank, world, args, "replay", timeout=3600)
    for line in lines:
        log(line)
    return result


def _replay_rank(
    rank: int,
    world: int,
    port: int,
    settings: KafkaSettings,
    run: str,
    to_version: int | None,
    cfg: Any,
    manifests: dict[int, dict[str, Any]],
    out: Any,
) -> None:  # pragma: no cover (runs in a spawned process)
    from rlstream.trainer.distributed import RankEnv, Ranks

    ranks = Ranks(RankEnv(rank, world, "127.0.0.1", port))
    lines: list[str] = []
    try:
        result = _replay(settings, run, to_version, lines.append, cfg, manifests, ranks)
    except BaseException as exc:
        if rank == 0:
            out.put(
                ([*lines, f"replay rank 0 failed: {exc!r}"], ReplayResult(0, 0, None, str(exc)))
            )
        raise
    if rank == 0:
        out.put((lines, result))
    ranks.close()


def _replay(
    settings: KafkaSettings,
    run: str,
    to_version: int | None,
    log: Callable[[str], None],
    cfg: Any,
    manifests: dict[int, dict[str, Any]],
    ranks: Any = None,
) -> ReplayResult:
    """The replay loop of one learner rank (``ranks`` None: the only one), given the run's
    learner config and its manifests by version."""
    import torch

    from rlstream.trainer.learner_step import (
        init_model,
        published_state,
        reference_policy,
        train_step,
    )

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    admitted = admitted_by_ref(settings, run)
    lead = ranks is None or ranks.rank == 0
    model, optimizer = init_model(cfg, lambda line: None, warm=lead)
    reference = reference_policy(cfg, model)
    if ranks is not None:
        optimizer = ranks.adopt(model, optimizer)
    last = max(manifests) if to_version is None else min(to_version, max(manifests))
    for version in range(0, last + 1):
        inputs = step_inputs(manifests[version], admitted) if version > 0 else []
        if inputs:  # a forget may leave a step without groups: its weights stay as they were
            train_step(model, optimizer, inputs, cfg, ranks, reference)
        state = published_state(model, cfg.publish_dtype)
        recorded = manifests[version]
        if state_hash(state, hash_algorithm(recorded)) != recorded["state_hash"]:
            tensor = _first_differing(state, recorded)
            return ReplayResult(
                version,
                version,
                tensor,
                f"version {version}: state hash differs (first tensor: {tensor})",
            )
        log(f"version {version}: state hash {recorded['state_hash'][:16]} reproduced")
    return ReplayResult(last)


def _first_differing(state: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    recorded = {t["name"]: t["hash"] for t in manifest["tensors"]}
    for name, bits in state.items():
        if recorded.get(name) != bits.hash_of(hash_algorithm(manifest)):
            return name
    return None


def rescore(
    settings: KafkaSettings, run: str, judge: str, into: str, log: Callable[[str], None] = print
) -> int:
    """Copy ``run``'s trajectories into ``into`` and judge them there with ``judge``."""
    from rlstream.envs.judges import Judge, JudgeConfig
    from rlstream.ops.run.config import RunConfig
    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.producers.client.producer import EventProducer

    runs = run_manifests(settings)
    config = (
        RunConfig.model_validate(json.loads(runs[run]["config_json"]))
        if run in runs
        else RunConfig()
    )
    config.judges.setdefault(judge, JudgeConfig(kind=judge))
    judge_cfg = config.role("judge", judge)  # the run's families and isolation injected
    assert isinstance(judge_cfg, JudgeConfig)
    scorer = Judge(into, judge, judge_cfg)
    ensure_run_topics(settings, into)
    count = 0
    with EventProducer.connect(settings) as producer:
        for msg, decoded, _ in tap(settings, topics.topic_name(run, "trajectories")):
            if decoded is None:
                continue
            traj = {**decoded.record, "run": into}
            source = {"topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset()}
            producer.produce(
                topics.topic_name(into, "trajectories"), "trajectory", traj, traj["group_id"]
            )
            reward = scorer.rubric(traj, scorer.cfg)
            producer.produce(
                topics.topic_name(into, "rewards"),
                "reward",
                {
                    "run": into,
                    "group_id": traj["group_id"],
                    "task_id": traj["task_id"],
                    "sample_index": traj["sample_index"],
                    "judge": judge,
                    "judge_version": "1",
                    "latency_ms": 0,
                    "policy_version": traj["policy_version"],
                    "trajectory": source,
                    **reward,
                },
                traj["group_id"],
            )
            count += 1
    log(f"re-scored {count} trajectories of {run} with judge {judge} into {into}")
    return count
