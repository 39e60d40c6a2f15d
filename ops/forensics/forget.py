"""Forget: a run recomputed without a user's records (a deletion request), and its audit.

``forget`` finds, by lineage (``ops.forensics.lineage``), every sample of run R built from the records
asked to be forgotten: those whose feedback carries one of the user hashes, or that name one of
the given positions (admitted, trajectory, served, reward, feedback or task record). It then
writes a new run R' (``R-forget-DIGEST``, one name per request):

- R''s admitted stream holds, version by version, the groups of R's steps with those samples
  left out; a group left with fewer than two samples is left out whole (GRPO's advantage is
  relative to the group); a step left with no group keeps its weights (``replay`` does the same);
- R''s learner is R's (the recorded config and seeds): versions are recomputed from the warm
  start, because the optimizer state of the version before the first affected one is not in the
  log; the versions before it come out bit for bit equal to R's (checked: ``versions_differ``
  lists every version whose state hash differs, so it starts at the first affected version);
- R''s run manifest names its parent, the excluded records and user hashes and the first
  recomputed version; it is written ``running`` before the first record of R' and ``finished``
  after its last manifest. The audit stream ``rl.audit`` (cluster-wide, kept forever) gets a
  ``started`` and a ``finished`` record of the request;
- bad input (no such run, no such record, a user hash or record nothing trained on) is a
  ``LineageError`` before anything is written;
- an interrupted forget leaves R' ``running``, never ``finished``: run again, it deletes what
  the interrupted attempt wrote of R' and starts over. A request already finished is refused
  with the name of its run.

What forgetting guarantees about the original run is stated in ``docs/lineage.md``: R' holds no
record of the user; R's own records of them are removed by deleting R (``rlstream runs delete
R``) in every region that holds a copy of its topics.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlstream.consumers.run_log import run_manifest
from rlstream.ops.forensics.lineage import (
    Group,
    Lineage,
    LineageError,
    Position,
    TracedSample,
    as_ref,
)
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import arrays, topics

MIN_GROUP = 2
"""Samples a group needs to keep a GRPO signal once records are left out of it."""


@dataclass
class ForgetPlan:
    """What a forget leaves out of which version, decided before anything is written."""

    run: str
    new_run: str
    user_hashes: list[str]
    requested: list[dict[str, Any]]
    first_affected: int
    last_version: int
    excluded: list[Position] = field(default_factory=list)
    keep: dict[int, list[Group]] = field(default_factory=dict)


def new_run_name(run: str, user_hashes: Sequence[str], records: Sequence[dict[str, Any]]) -> str:
    """``RUN-forget-DIGEST``: one name per request (the same request names the same run)."""
    request = json.dumps([run, sorted(user_hashes), sorted(map(str, map(as_key, records)))])
    digest = hashlib.sha256(request.encode()).hexdigest()[:10]
    return topics.validate_name(f"{run[: topics.MAX_NAME_LENGTH - 18]}-forget-{digest}")


def as_key(ref: dict[str, Any]) -> Position:
    return (ref["topic"], int(ref["partition"]), int(ref["offset"]))


def hits(s: TracedSample, user_hashes: set[str], records: set[Position]) -> set[str]:
    """Which of the requested items sample ``s`` was built from (hashes and positions)."""
    found = {f"{p[0]}:{p[1]}:{p[2]}" for p in s.positions() & records}
    if s.feedback is not None and s.feedback["user_id_hash"] in user_hashes:
        found.add(s.feedback["user_id_hash"])
    return found


def plan_forget(
    lineage: Lineage, user_hashes: Sequence[str], records: Sequence[dict[str, Any]]
) -> ForgetPlan:
    """The plan (see the module rules); ``LineageError`` when something asked for is unknown."""
    if not user_hashes and not records:
        raise ValueError("forget what? give --user-hash or --record")
    wanted, positions = set(user_hashes), {as_key(r) for r in records}
    last = max(lineage.manifests)
    plan = ForgetPlan(lineage.run, new_run_name(lineage.run, user_hashes, records), sorted(wanted),
                list(records), -1, last)  # fmt: skip
    seen: set[str] = set()
    for version in range(1, last + 1):
        plan.keep[version] = []
        for group in lineage.groups(version):
            left: list[dict[str, Any]] = []
            dropped: list[dict[str, Any]] = []
            for sample in group.decision["samples"]:
                found = hits(lineage.join(group, sample), wanted, positions)
                seen |= found
                (dropped if found else left).append(sample)
            if not dropped:
                plan.keep[version].append(group)
                continue
            if plan.first_affected < 0:
                plan.first_affected = version
            plan.excluded += sorted(_records_of(group, dropped) - set(plan.excluded))
            if len(left) >= MIN_GROUP:
                plan.keep[version].append(Group({**group.decision, "samples": left}, group.parts))
    missing = sorted((wanted | {f"{p[0]}:{p[1]}:{p[2]}" for p in positions}) - seen)
    if missing:
        raise LineageError(f"no version of run {lineage.run!r} trained on {', '.join(missing)}")
    return plan


def _records_of(group: Group, dropped: list[dict[str, Any]]) -> set[Position]:
    """Where the left-out samples' data lies: their feedback and served (or trajectory)
    records, and the admitted records of their group."""
    refs = [s.get(name) for s in dropped for name in ("feedback", "trajectory")]
    return {as_key(r) for r in refs if r is not None} | set(group.parts)


@dataclass
class ForgetResult:
    run: str
    new_run: str
    first_affected_version: int
    excluded_records: list[dict[str, Any]]
    versions_differ: list[int]

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def forget(
    settings: KafkaSettings,
    run: str,
    user_hashes: Sequence[str] = (),
    records: Sequence[dict[str, Any]] = (),
    log: Callable[[str], None] = print,
) -> ForgetResult:
    """Write the new run of a forget request (see the module rules)."""
    from rlstream.ops.forensics.replay import learner_config

    lineage = Lineage(settings, run)
    try:
        plan = plan_forget(lineage, user_hashes, records)
    finally:
        lineage.close()
    cfg = learner_config(settings, run)
    _start_over(settings, plan)
    _audit(settings, plan, "started", [])
    _record_run(settings, plan, "running")
    refs = _write_admitted(settings, plan)
    log(
        f"forget: {plan.new_run}: admitted groups written; recomputing {plan.last_version} versions"
    )
    differ = _recompute(settings, plan, cfg, refs, lineage.manifests, log)
    _record_run(settings, plan, "finished")
    _audit(settings, plan, "finished", differ)
    excluded = [as_ref(p) for p in plan.excluded]
    return ForgetResult(run, plan.new_run, plan.first_affected, excluded, differ)


def _start_over(settings: KafkaSettings, plan: ForgetPlan) -> None:
    """Refuse a finished request; delete what an interrupted attempt wrote of the new run."""
    from rlstream.producers.client.admin import admin_client, delete_topics, ensure_run_topics

    recorded = run_manifest(settings, plan.new_run)
    if recorded is not None and recorded["status"] == "finished":
        raise LineageError(f"already forgotten: run {plan.new_run!r} is this request's result")
    admin = admin_client(settings)
    names = set(topics.run_topics(plan.new_run).values())
    existing = sorted(names & set(admin.list_topics(timeout=10).topics))
    delete_topics(admin, existing)
    deadline = time.monotonic() + 60
    while names & set(admin.list_topics(timeout=10).topics):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the topics of {plan.new_run} are still being deleted")
        time.sleep(0.5)
    ensure_run_topics(settings, plan.new_run)


def _audit(settings: KafkaSettings, plan: ForgetPlan, status: str, differ: list[int]) -> None:
    from rlstream.producers.client.producer import EventProducer

    record = {
        "run": plan.run,
        "new_run": plan.new_run,
        "status": status,
        "user_hashes": plan.user_hashes,
        "requested_records": plan.requested,
        "excluded_records": [as_ref(p) for p in plan.excluded],
        "first_affected_version": plan.first_affected,
        "versions_differ": differ,
        "created_ms": int(time.time() * 1000),
    }
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.AUDIT_TOPIC, "forget_audit", record, plan.run)


def _record_run(settings: KafkaSettings, plan: ForgetPlan, status: str) -> None:
    """The new run's manifest: the parent's, with its name, status, parent and exclusions
    (and the weight key the new run's learner recorded, once it has one)."""
    from rlstream.consumers.weights.trust import weight_fields
    from rlstream.producers.client.producer import EventProducer

    parent = run_manifest(settings, plan.run)
    assert parent is not None  # learner_config read it
    now = int(time.time() * 1000)
    mine = run_manifest(settings, plan.new_run)
    record = {
        **parent,
        "run": plan.new_run,
        "created_ms": mine["created_ms"] if mine else now,
        "updated_ms": now,
        "status": status,
        "topics": sorted(topics.run_topics(plan.new_run).values()),
        "parent_run": plan.run,
        "description": f"{plan.run} recomputed from version {plan.first_affected} without "
        f"{len(plan.excluded)} records (rlstream forget)",
        "excluded_records": [as_ref(p) for p in plan.excluded],
        "excluded_user_hashes": plan.user_hashes,
        "recomputed_from": plan.first_affected,
        **weight_fields(mine),
    }
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", record, plan.new_run)


def _write_admitted(settings: KafkaSettings, plan: ForgetPlan) -> dict[int, list[list[Position]]]:
    """Write the kept groups to the new run's admitted stream, version by version; returns,
    per version, each group's part positions there."""
    from rlstream.producers.client.producer import EventProducer

    topic = topics.topic_name(plan.new_run, "admitted")
    limit = topics.STREAMS["admitted"].max_value_bytes
    out: dict[int, list[list[Position]]] = {}
    with EventProducer.connect(settings) as producer:
        for version, groups in sorted(plan.keep.items()):
            out[version] = []
            for group in groups:
                record = {**group.decision, "run": plan.new_run, "part_index": 0, "part_count": 1}
                where: list[Position] = []
                for part in arrays.split_group(record, limit):
                    producer.produce(
                        topic, "admission", part, part["group_id"], on_delivery=_noting(where)
                    )
                    producer.flush()  # in order: a part's position before the next is written
                out[version].append(where)
    return out


def _noting(where: list[Position]) -> Any:
    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            raise RuntimeError(f"writing {msg.topic()}: {err.str()}")
        where.append((str(msg.topic()), int(msg.partition()), int(msg.offset())))

    return delivered


def _recompute(
    settings: KafkaSettings,
    plan: ForgetPlan,
    cfg: Any,
    refs: dict[int, list[list[Position]]],
    recorded: dict[int, dict[str, Any]],
    log: Callable[[str], None],
) -> list[int]:
    """Train the new run's versions on the kept groups and publish them; the versions whose
    state differs from the original's."""
    import torch

    from rlstream.consumers.weights.trust import ensure_run_key
    from rlstream.producers.weights.publisher import rank_publisher
    from rlstream.producers.weights.run_keys import RunKeys
    from rlstream.schemas.deltacodec.bits import state_hash
    from rlstream.schemas.deltacodec.manifest import hash_algorithm
    from rlstream.trainer.learner import learner_key
    from rlstream.trainer.learner_step import StepInput, init_model, published_state, train_step

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    signer = ensure_run_key(
        settings,
        plan.new_run,
        learner_key(cfg, plan.new_run, RunKeys.from_env()),
        insecure=cfg.insecure_weights,
    )
    txn = f"{topics.group_id(plan.new_run, 'learner')}.forget"
    publisher = rank_publisher(
        settings, plan.new_run, cfg.model, txn, None, cfg.keyframe_every, signer
    )
    publisher.epoch = 1
    model, optimizer = init_model(cfg, lambda line: None)
    differ = []
    try:
        for version in range(plan.last_version + 1):
            groups = plan.keep.get(version, [])
            inputs = [
                StepInput(g.decision, parts)
                for g, parts in zip(groups, refs.get(version, []), strict=True)
            ]
            stats = train_step(model, optimizer, inputs, cfg) if inputs else {}
            state = published_state(model, cfg.publish_dtype)
            step = [as_ref(p) for item in inputs for p in item.refs]
            publisher.publish_version(state, version, step_inputs=step, stats=stats)
            if (
                state_hash(state, hash_algorithm(recorded[version]))
                != recorded[version]["state_hash"]
            ):
                differ.append(version)
            log(
                f"forget: version {version} published{' (differs)' if differ[-1:] == [version] else ''}"
            )
    finally:
        publisher.close(10)
    return differ
