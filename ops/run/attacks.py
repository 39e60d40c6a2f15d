"""Attacks a chaos driver tries against a live run, and how many of each the run refused.

Each helper does what an attacker in that position would, with real requests or real records
(``ops.run.faults``' rules hold: only 127.0.0.1 and the run's own topics), and the refusals are
counted from what the run answered or wrote, never assumed. ``Attempts`` is the shape of one
entry of ``bench chaos --json``'s ``attacks``: ``{"tried": N, "refused": N}``.

- ``unauthenticated_policy_push``: someone who reaches ``serve policy --weights push`` but holds
  no push token asks it to load a directory (no token, a wrong one, another scheme; any local
  directory, a version far ahead). Refused: answered 401, and the served version unchanged;
- ``forged_feedback_tokens``: an authenticated feedback client (it holds an HMAC key of the
  ingest service) sends feedback on a completion the run served, but with token ids,
  logprobs or a policy version of its own (or on a request never served). Refused: feedback-rl
  rejected it, so the rejected stream names its position and no admitted group does
  (``feedback_refusals``, after feedback-rl ran);
- ``unreleased_task``: a rollout region sends home a trajectory and a reward of a task the
  scheduler never released to it. Refused: admission dead-lettered the record
  (``dead_lettered``).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message

from rlstream.ops.run.faults import Injected, _injected, _opener, _post, _sample_record
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

UNRELEASED_PREFIX = "chaos-unreleased-"
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


# --- feedback -----------------------------------------------------------------------------------


def forged_feedback_tokens(
    settings: KafkaSettings, url: str, run: str, key: bytes, key_id: str = "k1"
) -> list[Position]:
    """Send forged feedback through the ingest service at ``url`` (signed with ``key``): on a
    served completion with altered token ids, with altered logprobs, with another policy version,
    and tokens for a request never served. Returns where each was stored."""
    import numpy as np

    from rlstream.producers.feedback import auth as fa
    from rlstream.producers.feedback.models import FEEDBACK_PATH

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
    tag = f"{time.time_ns()}"
    forged = [
        {**event, "token_ids": [(t + 1) % 1000 for t in event["token_ids"]]},
        {**event, "logprobs": [0.0] * len(tokens)},
        {**event, "policy_version": event["policy_version"] + 1},
        {**event, "request_id": f"chaos-never-served-{tag}"},
    ]
    target = fa.Target("POST", FEEDBACK_PATH, run)
    landed = []
    for i, rec in enumerate(forged):
        body = json.dumps({**rec, "feedback_id": f"chaos-forged-{tag}-{i}"}).encode()
        ts = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            fa.KEY_ID_HEADER: key_id,
            fa.TIMESTAMP_HEADER: ts,
            fa.DIGEST_HEADER: fa.body_digest(body),
            fa.SIGNATURE_HEADER: fa.sign_digest(key, ts, target, "", body),
        }
        request = _request(f"{url}{FEEDBACK_PATH}", body, headers)
        if request is not None:
            [stored] = request["results"]
            landed.append(
                (topics.topic_name(run, "feedback"), stored["partition"], stored["offset"])
            )
    return landed


def _request(url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
    import urllib.error
    import urllib.request

    try:
        with _opener().open(urllib.request.Request(url, body, headers), timeout=30) as r:
            return dict(json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def feedback_refusals(settings: KafkaSettings, run: str, landed: Iterable[Position]) -> Attempts:
    """How many of the feedback records at ``landed`` feedback-rl rejected (named by a rejected
    decision's inputs and by no admitted one)."""
    from rlstream.consumers.read_to_end import read_topic

    named: dict[str, set[Position]] = collections.defaultdict(set)
    for stream in ("admitted", "rejected"):
        for msg in read_topic(settings, topics.topic_name(run, stream), name="chaos-decisions"):
            rec = events.decode(msg.value() or b"").record
            if rec.get("source") == "online":
                named[stream] |= {(i["topic"], i["partition"], i["offset"]) for i in rec["inputs"]}
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
    landed: list[Injected] = []
    producer = EventProducer.connect(settings)
    for kind, stream, event, rec in (
        ("unreleased_trajectory", "trajectories", "trajectory", trajectory),
        ("unreleased_reward", "rewards", "reward", reward),
    ):

        def done(err: KafkaError | None, msg: Message, kind: str = kind) -> None:
            if err is None:
                landed.append(_injected(kind, msg, dead_letter=True))

        value = events.encode(event, rec)
        producer.produce_raw(where(names[stream]), value, task, on_delivery=done)
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
