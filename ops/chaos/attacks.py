"""Attacks a chaos driver tries against a live run, and how many of each the run refused.

Each helper does what an attacker in that position would, with real requests or real records
(only 127.0.0.1 and the run's own topics), and the refusals are counted from what the run
answered or wrote, never assumed. ``Attempts`` is one entry of ``bench chaos --json``'s
``attacks``: ``{"tried": N, "refused": N}``. Kinds: ``unauthenticated_policy_push``,
``forged_feedback_tokens``, ``feedback_replay``, ``unreleased_task``, ``heldout_task``, the
verdict forgeries and ``planted_stdlib_module``.

Details: docs/security.md (The attacks a chaos run tries).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, Message

from rlstream.ops.chaos.faults import Injected, _injected, _sample_record
from rlstream.ops.run.services import _opener, _post, post
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

UNRELEASED_PREFIX = "chaos-unreleased-"
HELDOUT_PREFIX = "chaos-heldout-"
FORGED_PREFIX = "chaos-forged-"
#: Group ids of records an attack wrote: the ledger counts them apart from the run's own.
ATTACK_PREFIXES = (UNRELEASED_PREFIX, HELDOUT_PREFIX, FORGED_PREFIX)
#: The run's families a chaos run adds for the verdict forgeries (never released: the least
#: weight there is), and the dataset family's one problem (``attack_problems``).
FORGERY_FAMILIES = ("repo", "attacks")
FAR_VERSION = 10**11


@dataclass
class Attempts:
    """How often one kind of attack was tried, and how often the run refused it."""

    tried: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"tried": self.tried, "refused": self.refused}


Position = tuple[str, int, int]


# --- the policy server ------------------------------------------------------------------------


def _served_version(url: str) -> int:
    with _opener().open(f"{url}/healthz", timeout=10) as r:
        return int(json.loads(r.read())["policy_version"])


def unauthenticated_policy_push(url: str, model_path: str = "/") -> Attempts:
    """Push to the policy server at ``url`` without its token (see the module)."""
    before = _served_version(url)
    body = {"model_path": model_path, "weight_version": str(before + 1), "state_hash": "0" * 64}
    far = {**body, "weight_version": str(FAR_VERSION)}
    typed = {"Content-Type": "application/json"}
    tries = [
        (typed, body),
        ({**typed, "Authorization": "Bearer not-the-push-token-0123456789"}, body),
        ({**typed, "Authorization": "Basic YWRtaW46YWRtaW4="}, body),
        (typed, far),
    ]
    statuses = [
        _post(f"{url}/update_weights_from_disk", json.dumps(b).encode(), h) for h, b in tries
    ]
    unchanged = _served_version(url) == before
    return Attempts(len(tries), sum(1 for s in statuses if s == 401) if unchanged else 0)


def complete(url: str, model: str, auth: dict[str, str], timeout: float = 90.0) -> dict[str, Any]:
    """One completion from the policy server at ``url`` (recorded in the run's served stream
    before it is answered; ``auth``: its Authorization header), waiting while it answers 503
    (no version loaded yet)."""
    body = json.dumps({"model": model, "prompt": "f(x)", "max_tokens": 6}).encode()
    deadline = time.monotonic() + timeout
    while True:
        headers = {"Content-Type": "application/json", **auth}
        answer = _request(f"{url}/v1/completions", body, headers)
        if answer is not None:
            return answer
        if time.monotonic() > deadline:
            raise TimeoutError(f"no completion from {url} within {timeout:.0f}s")
        time.sleep(1.0)


# --- feedback -----------------------------------------------------------------------------------


def _served_feedback(settings: KafkaSettings, run: str) -> dict[str, Any]:
    """A genuine feedback event on the first completion the run served (what its user would
    send: its tokens, logprobs, version and model)."""
    import numpy as np

    served = _sample_record(settings, topics.topic_name(run, "served"), "trajectory")
    tokens = np.frombuffer(served["token_ids"], np.int32)
    logprobs = np.frombuffer(served["logprobs"], np.float32)
    event = {
        "request_id": served["group_id"],
        "policy_version": int(served["policy_version"]),
        "model": served["model"],
        "action": "accepted",
        "token_ids": tokens.tolist(),
        "logprobs": logprobs.tolist(),
        "prompt_tokens": int(served["prompt_tokens"]),
        "user_id": "chaos-attacker",
        "metadata": {"choice": str(served["sample_index"])},
    }
    return event


def _send_feedback(
    url: str, run: str, key: bytes, key_id: str, events_: list[dict[str, Any]], ids: list[str]
) -> list[Position]:
    """Send each event under its feedback id, signed with ``key``; where each was stored."""
    from rlstream.producers.feedback import auth as fa
    from rlstream.producers.feedback.models import FEEDBACK_PATH

    target = fa.Target("POST", FEEDBACK_PATH, run)
    landed = []
    for rec, feedback_id in zip(events_, ids, strict=True):
        body = json.dumps({**rec, "feedback_id": feedback_id}).encode()
        headers = fa.signed_headers(key, key_id, target, body)
        request = _request(f"{url}{FEEDBACK_PATH}", body, headers)
        if request is not None:
            [stored] = request["results"]
            landed.append(
                (topics.topic_name(run, "feedback"), stored["partition"], stored["offset"])
            )
    return landed


def forged_feedback_tokens(
    settings: KafkaSettings, url: str, run: str, key: bytes, key_id: str = "k1"
) -> list[Position]:
    """Send forged feedback through the ingest service at ``url`` (signed with ``key``): on a
    served completion with altered token ids, with altered logprobs, with another policy version,
    and tokens for a request never served. Returns where each was stored."""
    event = _served_feedback(settings, run)
    tokens = event["token_ids"]
    tag = f"{time.time_ns()}"
    forged = [
        {**event, "token_ids": [(t + 1) % 1000 for t in event["token_ids"]]},
        {**event, "logprobs": [0.0] * len(tokens)},
        {**event, "policy_version": event["policy_version"] + 1},
        {**event, "request_id": f"chaos-never-served-{tag}"},
    ]
    ids = [f"chaos-forged-{tag}-{i}" for i in range(len(forged))]
    return _send_feedback(url, run, key, key_id, forged, ids)


def feedback_replay(
    settings: KafkaSettings, url: str, run: str, key: bytes, replays: int = 3, key_id: str = "k1"
) -> tuple[list[Position], list[Position]]:
    """Send the genuine feedback on a served completion once, then ``replays`` times more under
    feedback ids of its own (as a client would to train one completion many times). Returns where
    the first and the replays were stored."""
    event = _served_feedback(settings, run)
    tag = f"{time.time_ns()}"
    ids = [f"chaos-replay-{tag}-{i}" for i in range(replays + 1)]
    landed = _send_feedback(url, run, key, key_id, [event] * (replays + 1), ids)
    return landed[:1], landed[1:]


def _request(url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
    """The JSON answer of a POST that succeeded (2xx), else None."""
    status, answer = post(url, body, headers)
    return answer if 200 <= status < 300 else None


def replay_refusals(
    settings: KafkaSettings, run: str, first: Iterable[Position], replays: Iterable[Position]
) -> Attempts:
    """How many ``replays`` feedback-rl dropped as the served completion's duplicates (named by
    no decision, admitted or rejected) while the first feedback was decided (the control: a
    feedback-rl that decided nothing would drop every replay and prove nothing)."""
    named = _online_inputs(settings, run)
    decided = named["admitted"] | named["rejected"]
    replays = list(replays)
    if not all(p in decided for p in first):
        return Attempts(len(replays), 0)
    return Attempts(len(replays), sum(1 for p in replays if p not in decided))


def _online_inputs(settings: KafkaSettings, run: str) -> dict[str, set[Position]]:
    """The feedback positions each kind of feedback-rl decision (admitted, rejected) names."""
    from rlstream.consumers.read_to_end import read_topic

    named: dict[str, set[Position]] = collections.defaultdict(set)
    for stream in ("admitted", "rejected"):
        for msg in read_topic(settings, topics.topic_name(run, stream), name="chaos-decisions"):
            rec = events.decode(msg.value() or b"").record
            if rec.get("source") == "online":
                named[stream] |= {(i["topic"], i["partition"], i["offset"]) for i in rec["inputs"]}
    return named


def feedback_refusals(settings: KafkaSettings, run: str, landed: Iterable[Position]) -> Attempts:
    """How many of the feedback records at ``landed`` feedback-rl rejected (named by a rejected
    decision's inputs and by no admitted one)."""
    named = _online_inputs(settings, run)
    landed = list(landed)
    refused = [p for p in landed if p in named["rejected"] and p not in named["admitted"]]
    return Attempts(len(landed), len(refused))


# --- admission ----------------------------------------------------------------------------------


def unreleased_task(
    settings: KafkaSettings, run: str, tag: str, region: str | None = None
) -> list[Injected]:
    """Write a trajectory and a reward of a task never released into the run's trajectories and
    rewards streams (with ``region``: into the copies MirrorMaker brings home from it, as a
    compromised rollout region would), built from genuine records of the run."""
    names = topics.run_topics(run)
    task = f"{UNRELEASED_PREFIX}{tag}"
    group = {"group_id": task, "task_id": task, "sample_index": 0}
    trajectory = {
        **_sample_record(settings, names["trajectories"], "trajectory"),
        **group,
        "group_size": 1,
    }
    reward = {**_sample_record(settings, names["rewards"], "reward"), **group, "score": 1.0}
    where = (lambda t: topics.remote_topic(region, t)) if region else (lambda t: t)
    return _write(
        settings,
        [
            ("unreleased_trajectory", where(names["trajectories"]), "trajectory", trajectory),
            ("unreleased_reward", where(names["rewards"]), "reward", reward),
        ],
    )


def _write(
    settings: KafkaSettings, records: list[tuple[str, str, str, dict[str, Any]]]
) -> list[Injected]:
    """Write each (kind, topic, event, record), keyed by its group id; where each landed, as
    records a role must dead-letter."""
    landed: list[Injected] = []
    producer = EventProducer.connect(settings)
    for kind, topic, event, rec in records:

        def done(err: KafkaError | None, msg: Message, kind: str = kind) -> None:
            if err is None:
                landed.append(_injected(kind, msg, dead_letter=True))

        producer.produce_raw(topic, events.encode(event, rec), rec["group_id"], on_delivery=done)
    producer.wait(30)
    return landed


def dead_letter_positions(settings: KafkaSettings, run: str) -> dict[Position, list[str]]:
    """Source position -> the reasons of the dead letters the run's roles wrote for it."""
    from rlstream.consumers.read_to_end import read_topic

    out: dict[Position, list[str]] = collections.defaultdict(list)
    for msg in read_topic(settings, topics.topic_name(run, "dlq"), name="chaos-dlq"):
        rec = events.decode(msg.value() or b"").record
        out[(rec["source_topic"], rec["partition"], rec["offset"])].append(rec["reason"])
    return dict(out)


def dead_lettered(settings: KafkaSettings, run: str, injected: Iterable[Injected]) -> Attempts:
    """How many of ``injected`` some role dead-lettered."""
    letters = dead_letter_positions(settings, run)
    injected = list(injected)
    refused = [i for i in injected if (i.topic, i.partition, i.offset) in letters]
    return Attempts(len(injected), len(refused))


# --- the verdict ----------------------------------------------------------------------------


def heldout_task(
    settings: KafkaSettings, run: str, task_ids: Iterable[str], tag: str
) -> tuple[list[str], list[Injected]]:
    """Write a trajectory of each held-out task of ``task_ids`` into the run's trajectories
    stream (built from a genuine one, a group of one; admission dead-letters it, since no such
    task was released). Returns the group ids and where each landed."""
    stream = topics.topic_name(run, "trajectories")
    genuine = _sample_record(settings, stream, "trajectory")
    groups = [f"{HELDOUT_PREFIX}{tag}-{i}" for i, _ in enumerate(task_ids)]
    records = [
        ("heldout_task", stream, "trajectory", {**genuine, "group_id": g, "task_id": t})
        for g, t in zip(groups, task_ids, strict=True)
    ]
    for _, _, _, rec in records:
        rec.update(sample_index=0, group_size=1)
    return groups, _write(settings, records)


def attack_families(folder: Path) -> list[str]:
    """``--set`` items adding the forgeries' families to a run (the dataset family's problem file
    written into ``folder``): they exist for the judge, the scheduler all but never picks them."""
    from rlstream.envs.sandbox.attacks import STOP_ITERATION_PROBLEM

    path = folder / "attack-problems.jsonl"
    path.write_text(json.dumps(STOP_ITERATION_PROBLEM) + "\n")
    repo = {"plugin": "repo", "weight": 1e-6, "options": {"path": "builtin:repo/tasks.jsonl"}}
    data = {"plugin": "dataset", "weight": 1e-6,
            "options": {"path": str(path), "eval_fraction": 0.0}}  # fmt: skip
    return [f"families.repo={json.dumps(repo)}", f"families.attacks={json.dumps(data)}"]


def forged_answers(families: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Kind -> (task id, completion): each verdict forgery, and ``control:FAMILY`` answers that
    must pass (``repo``'s reference patch, the dataset problem's own solution)."""
    from rlstream.envs import repo
    from rlstream.envs.family import build_family
    from rlstream.envs.sandbox import attacks as sandbox_attacks

    fam = build_family("repo", families["repo"])
    assert isinstance(fam, repo.RepoFamily)
    task_id = fam.sample(0).task_id
    task = fam.task(task_id)
    base = repo.base_files(task, fam.loaded.trees[task.base])
    out = {k: (task_id, p) for k, p in sandbox_attacks.repo_forged_patches(base).items()}
    out["control:repo"] = (task_id, task.patch)
    problem = sandbox_attacks.STOP_ITERATION_PROBLEM
    stop_id = f"attacks-0:{problem['task_id']}"
    out["stop_iteration"] = (stop_id, sandbox_attacks.STOP_ITERATION_ANSWER)
    out["control:attacks"] = (stop_id, problem["prompt"] + problem["canonical_solution"])
    fx_id = build_family("fx", families["fx"]).sample(3).task_id
    out["setup_failure_veto"] = (fx_id, sandbox_attacks.SETUP_FAILURE_ANSWER)
    return out


def verdict_forgeries(
    settings: KafkaSettings, run: str, families: Mapping[str, Any], tag: str
) -> tuple[dict[str, str], list[Injected]]:
    """Write each of ``forged_answers`` as a trajectory (built from a genuine one, a group of one)
    into the run's trajectories stream for its judges; kind -> group id, and where each landed
    (admission dead-letters them: no such task was released)."""
    stream = topics.topic_name(run, "trajectories")
    genuine = _sample_record(settings, stream, "trajectory")
    groups, records = {}, []
    for i, (kind, (task_id, completion)) in enumerate(forged_answers(families).items()):
        groups[kind] = f"{FORGED_PREFIX}{tag}-{i}"
        rec = {**genuine, "group_id": groups[kind], "task_id": task_id, "completion": completion}
        rec.update(sample_index=0, group_size=1)
        records.append(("verdict_forgery", stream, "trajectory", rec))
    return groups, _write(settings, records)


def verdict_refusals(
    settings: KafkaSettings, run: str, groups: Mapping[str, str], judge: str = "tests"
) -> dict[str, Attempts]:
    """Per forgery kind of ``groups``: refused when the ``judge``'s reward did not pass and is no
    error, and the control of its family (``control:FAMILY``) passed; a kind whose control did
    not pass counts as not refused (the judge proved nothing)."""
    from rlstream.consumers.read_to_end import read_topic

    by_group = {g: k for k, g in groups.items()}
    rewards: dict[str, dict[str, Any]] = {}
    for msg in read_topic(settings, topics.topic_name(run, "rewards"), name="chaos-rewards"):
        try:
            rec = events.decode(msg.value() or b"").record
        except events.EventError:  # a chaos driver's poison
            continue
        if rec.get("group_id") in by_group and rec.get("judge") == judge:
            rewards[by_group[rec["group_id"]]] = rec
    family = {"setup_failure_veto": None, "stop_iteration": "attacks"}
    out = {}
    for kind in groups:
        if kind.startswith("control:"):
            continue
        control = family.get(kind, "repo")
        held = control is None or bool(rewards.get(f"control:{control}", {}).get("passed"))
        got = rewards.get(kind)
        refused = got is not None and not got.get("passed") and not got.get("error") and held
        out[kind] = Attempts(1, int(refused))
    return out


def heldout_ids(families: Mapping[str, Any]) -> list[str]:
    """Held-out task ids a training-side attacker would send (``envs.sandbox.attacks``), of the
    first of the run's families (``FamilySpec`` by name) that tells a task's split."""
    from rlstream.envs import dataset, fx
    from rlstream.envs.family import build_family
    from rlstream.envs.sandbox.attacks import heldout_task_ids

    for name, spec in families.items():
        family = build_family(name, spec)
        if isinstance(family, dataset.DatasetFamily | fx.FxFamily):
            return heldout_task_ids(family)
    raise ValueError(f"no family of {sorted(families)} holds tasks out")


def judge_refusals(
    settings: KafkaSettings, run: str, groups: Iterable[str], judge: str = "tests"
) -> Attempts:
    """How many of ``groups`` the ``judge`` refused to score as held-out (an unscorable reward
    saying so) without ever passing them."""
    from rlstream.consumers.read_to_end import read_topic

    groups = list(groups)
    wanted, refused, passed = set(groups), set(), set()
    for msg in read_topic(settings, topics.topic_name(run, "rewards"), name="chaos-rewards"):
        try:
            rec = events.decode(msg.value() or b"").record
        except events.EventError:  # a chaos driver's poison
            continue
        if rec.get("group_id") in wanted and rec.get("judge") == judge:
            if rec.get("passed"):
                passed.add(rec["group_id"])
            elif "held-out" in str(rec.get("error") or ""):
                refused.add(rec["group_id"])
    return Attempts(len(groups), len(refused - passed))


#: A HumanEval-shaped problem whose prompt and test import standard-library modules the
#: verdict side may not have imported yet: where a planted module would be picked up.
PLANTED_PROBLEM = {
    "task_id": "chaos/planted",
    "prompt": "from typing import List\n\n\ndef total(nums: List[int]) -> int:\n"
    '    """The sum of nums."""\n',
    "entry_point": "total",
    "test": "import collections, json, fractions\n\n\ndef check(candidate):\n"
    "    import statistics\n    assert candidate([1, 2, 3]) == 6\n",
    "canonical_solution": "    return sum(nums)\n",
}


def planted_stdlib_module(isolation: str, folder: Path) -> Attempts:
    """Score a planted-module answer of each kind (``envs.sandbox_attacks.KINDS``) to
    ``PLANTED_PROBLEM`` (a dataset family of that one problem, written under ``folder``) with
    the ``tests`` rubric the judge role applies (``envs.judges.judge_tests``) in sandbox mode
    ``isolation``. The problem's own solution must pass first (a judge that passes nothing
    would refuse every attack and prove nothing); an attack is refused when the tests ran and
    failed it."""
    from rlstream.envs.family import FamilySpec
    from rlstream.envs.judges import JudgeConfig, judge_tests
    from rlstream.envs.sandbox import attacks as sandbox_attacks

    path = folder / "planted-problem.jsonl"
    path.write_text(json.dumps(PLANTED_PROBLEM) + "\n")
    options = {"path": str(path), "eval_fraction": 0.0}
    cfg = JudgeConfig(
        families={"planted": FamilySpec(plugin="dataset", options=options)}, isolation=isolation
    )
    task_id = f"planted-0:{PLANTED_PROBLEM['task_id']}"

    def score(completion: str) -> dict[str, Any]:
        return judge_tests({"task_id": task_id, "completion": completion}, cfg)

    control = score(PLANTED_PROBLEM["prompt"] + PLANTED_PROBLEM["canonical_solution"])
    if not control["passed"]:
        raise RuntimeError(f"the planted-module problem's own solution failed: {control}")
    refused = 0
    for kind in sandbox_attacks.KINDS:
        # rlimits shares the host's /tmp: plant in the answer's own directory only there
        entry = PLANTED_PROBLEM["entry_point"]
        answer = sandbox_attacks.planted_stdlib_answer(
            entry, kind, everywhere=isolation != "rlimits"
        )
        verdict = score(answer)
        refused += not verdict["passed"] and verdict.get("error") is None
    return Attempts(len(sandbox_attacks.KINDS), refused)
