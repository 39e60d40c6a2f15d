"""Faults a chaos driver injects into a live run on a local cluster (``rlstream bench chaos``).

Rules:

- a process is killed only by its pid, and only one the driver started: a role's supervised
  child (found under the ``rlstream run`` supervisor the driver started), a service the driver
  started (``ops.run.services``: ``serve feedback``, ``serve policy``), or the broker of the cluster the
  driver was pointed at (restarted on its own data and ports, as a service manager would);
- traffic goes to the run's own topics and to the driver's own HTTP services on 127.0.0.1;
- every injected record names where it landed (``Injected``: topic, partition, offset), so the
  driver can look for the dead letter a role wrote for it; whether a fault was handled is read
  from what the roles wrote and logged, never assumed from what was injected;
- poison group ids start with ``POISON_PREFIX``: the ledger counts them apart.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from rlstream.ops.run.services import FeedbackProcess, _post, kill9
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

POISON_PREFIX = "chaos-poison-"
FORGED_VERSION = 10**12


@dataclass(frozen=True)
class Injected:
    """One record the driver wrote: what it is, where it landed, whether a role must dead-letter
    it (a record no role can process) or may decide it (a group of no known family)."""

    kind: str
    topic: str
    partition: int
    offset: int
    dead_letter: bool


# --- processes ----------------------------------------------------------------------------


def role_child(supervisor_pid: int) -> int | None:
    """The pid of the role process an ``rlstream run`` supervisor runs (its child started with
    ``--once``), or None while it is being restarted."""
    for children in Path(f"/proc/{supervisor_pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--once" in argv:
                return pid
    return None


def restart_broker(home: Path, region: str, heap: str, down_s: float) -> None:
    """kill -9 the broker of ``region`` in the local cluster at ``home``, leave it down for
    ``down_s``, and start it again on its data and its ports (the roles reconnect by
    themselves); raises if the ports could not be kept."""
    from rlstream.ops import cluster
    from rlstream.ops.cluster import broker

    state = cluster.load(home)
    reg = state.regions[region]
    port, pid = reg.broker_port, reg.pid
    if pid is None or not reg.running():
        raise RuntimeError(f"the broker of region {region} is not running")
    kill9(pid)
    time.sleep(down_s)
    broker.start(reg, heap=heap)
    state.save()
    if reg.broker_port != port:
        raise RuntimeError(
            f"the broker of {region} came back on port {reg.broker_port}, not {port}"
        )


# --- poison records -----------------------------------------------------------------------


def inject_poison(
    settings: KafkaSettings, run: str, tag: str, rng: random.Random
) -> list[Injected]:
    """Write one of each kind of poison into the run's trajectories and rewards streams:

    - ``garbage_trajectory`` / ``garbage_reward``: random bytes (no event framing);
    - ``wrong_event``: a well-formed ``task`` event where trajectories belong;
    - ``unknown_sample``: a well-formed reward for a group the scheduler never released;
    - ``unknown_family``: a well-formed trajectory of a task id of no known family, never
      released either.

    Admission dead-letters these two too (a group of a task never released: ``admission_rules``);
    no group of them is ever decided or trained."""
    names = topics.run_topics(run)
    group = f"{POISON_PREFIX}{tag}"
    reward = _sample_record(settings, names["rewards"], "reward")
    trajectory = _sample_record(settings, names["trajectories"], "trajectory")
    writes: list[tuple[str, str, bytes, str, bool]] = [
        ("garbage_trajectory", names["trajectories"], rng.randbytes(96), f"{group}-g", True),
        ("garbage_reward", names["rewards"], rng.randbytes(96), f"{group}-r", True),
        ("wrong_event", names["trajectories"], _task_event(run, group), f"{group}-t", True),
        (
            "unknown_sample",
            names["rewards"],
            events.encode("reward", {**reward, "group_id": f"{group}-u", "task_id": f"{group}-u"}),
            f"{group}-u",
            True,
        ),
        (
            "unknown_family",
            names["trajectories"],
            events.encode("trajectory", _foreign_trajectory(trajectory, f"{group}-f")),
            f"{group}-f",
            True,
        ),
    ]
    landed: list[Injected] = []
    producer = EventProducer.connect(settings)
    for kind, topic, value, key, must in writes:

        def done(err: KafkaError | None, msg: Message, kind: str = kind, must: bool = must) -> None:
            if err is None:
                landed.append(_injected(kind, msg, must))

        producer.produce_raw(topic, value, key, on_delivery=done)
    producer.wait(30)
    return landed


def _task_event(run: str, group: str) -> bytes:
    from rlstream.rollout.scheduler import SchedulerConfig, task_record

    rec = task_record(run, SchedulerConfig(), 0, 0)
    return events.encode("task", {**rec, "task_id": group})


def _foreign_trajectory(trajectory: dict[str, Any], group: str) -> dict[str, Any]:
    task = f"nosuchfamily-{group}"
    return {**trajectory, "group_id": group, "task_id": task, "sample_index": 0, "group_size": 1}


def _sample_record(
    settings: KafkaSettings, topic: str, event: str, timeout: float = 30.0
) -> dict[str, Any]:
    """A genuine ``event`` record of ``topic`` (the first one read), to build poison from."""
    from rlstream.consumers.read_to_end import partitions_of, reader

    consumer = reader(settings, "chaos-sample")
    try:
        parts = partitions_of(consumer, topic) or []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            try:
                decoded = events.decode(msg.value() or b"")
            except events.EventError:
                continue
            if decoded.event == event and int(decoded.record.get("segment_count") or 1) == 1:
                return decoded.record
        raise TimeoutError(f"no {event} record in {topic} within {timeout:.0f}s")
    finally:
        consumer.close()


# --- forged weight manifests -----------------------------------------------------------------


#: What ``attack_weights`` tries by default, each refused by every reader of a live signed run.
ATTACKS = (
    "unsigned_manifest",
    "wrong_key",
    "version_jump",
    "epoch_jump",
    "replayed_manifest",
    "weak_hash",
    "mirrored_trust_anchor",
)
#: The learner epoch an ``epoch_jump`` claims past the newest genuine one.
FORGED_EPOCH_JUMP = 10**9


def attack_weights(
    settings: KafkaSettings, run: str, model: str, key_file: Path, kinds: tuple[str, ...] = ATTACKS
) -> list[Injected]:
    """Try each attack of ``kinds`` once against the live run's weight manifests (from its
    newest genuine manifest of ``model``; ``key_file`` is the run's private key, as if it had
    leaked, for the attacks that need a good signature):

    - ``unsigned_manifest``: the next version, unsigned;
    - ``wrong_key``: the next version, signed with a key that is not the run's;
    - ``version_jump``: version 10^12 signed with the run's own key (a leaked key or a fenced
      learner): refused for its implausible version, not its signature;
    - ``epoch_jump``: the next version of a learner epoch 10^9 past the newest, signed with the
      run's key: one such record must not make readers refuse every later real version;
    - ``replayed_manifest``: the run's oldest manifest still in the log, written again byte for
      byte with its genuine signature;
    - ``weak_hash``: the next version naming non-cryptographic (xxh3) hashes, signed with the
      run's key;
    - ``mirrored_trust_anchor``: the run manifest in ``rl.runs`` rewritten (config kept) to name
      another key and the run insecure, as whoever may write a cluster's ``rl.runs`` (its
      MirrorMaker copy in a rollout region) could, then the next version signed with that key.

    Returns where each landed; ``attack_tally`` counts the refusals readers logged for them."""
    return _forge(settings, run, model, key_file, kinds)


def attack_tally(
    injected: list[Injected], refused_offsets: set[int] | dict[int, Any]
) -> dict[str, dict[str, int]]:
    """Per attack kind ``{"tried": N, "refused": N}``: how many of ``injected`` landed, and at
    how many of their offsets a reader refused a manifest (``refused_offsets``, e.g. the
    offsets in the roles' "refusing the record at offset" log lines)."""
    out: dict[str, dict[str, int]] = {}
    for item in injected:
        row = out.setdefault(item.kind, {"tried": 0, "refused": 0})
        row["tried"] += 1
        row["refused"] += int(item.offset in refused_offsets)
    return out


def _forge(
    settings: KafkaSettings, run: str, model: str, key_file: Path, kinds: tuple[str, ...]
) -> list[Injected]:
    """Publish one forged manifest per kind (see ``attack_weights``)."""
    from rlstream.consumers.weights.manifest_log import ManifestLog

    with ManifestLog.of_run(settings, run, model) as log:
        log.catch_up(30)
        records = log.records()
    if not records:
        raise RuntimeError(f"no manifest of {model} to forge from")
    topic = topics.topic_name(run, "weights.manifests")
    forged = [_forged(kind, records[-1], key_file, settings, topic) for kind in kinds]
    landed: list[Injected] = []
    producer = EventProducer.connect(settings)
    for kind, (value, headers) in zip(kinds, forged, strict=True):

        def done(err: KafkaError | None, msg: Message, kind: str = kind) -> None:
            if err is None:
                landed.append(_injected(kind, msg, dead_letter=False))

        producer.produce_raw(topic, value, model, headers, done)
    producer.wait(30)
    return landed


def _forged(
    kind: str, newest: dict[str, Any], key_file: Path, settings: KafkaSettings, topic: str
) -> tuple[bytes, Any]:
    """The value and headers of one forged manifest of ``kind``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from rlstream.producers.weights.signing import Signer

    if kind == "replayed_manifest":
        return _oldest_manifest(settings, topic)
    run_key, other = Signer.from_file(key_file), Signer(Ed25519PrivateKey.generate())
    nxt, epoch = int(newest["version"]) + 1, int(newest.get("learner_epoch", 0))
    if kind == "mirrored_trust_anchor":
        _forge_run_record(settings, str(newest["run"]), other.public_hex)
    table: dict[str, tuple[dict[str, Any], Signer | None]] = {
        "mirrored_trust_anchor": ({"version": nxt}, other),
        "wrong_key": ({"version": nxt}, other),
        "unsigned_manifest": ({"version": nxt}, None),
        "version_jump": ({"version": FORGED_VERSION}, run_key),
        "epoch_jump": ({"version": nxt, "learner_epoch": epoch + FORGED_EPOCH_JUMP}, run_key),
        "weak_hash": ({"version": nxt, "hash_algorithm": "xxh3_128"}, run_key),
    }
    changes, signer = table[kind]
    rec = {**newest, **changes, "created_ms": int(time.time() * 1000)}
    value = events.encode("weight_manifest", rec)
    return value, (signer.headers(value) if signer is not None else None)


def _forge_run_record(settings: KafkaSettings, run: str, public_hex: str) -> None:
    """Run ``run``'s manifest written again naming ``public_hex`` and insecure, every other
    field (its config too) as recorded: no reader may take either as its trust."""
    from rlstream.consumers.run_log import run_manifest

    record = run_manifest(settings, run)
    if record is None:
        raise RuntimeError(f"run {run} has no run manifest to forge")
    forged = {
        **record,
        "updated_ms": int(time.time() * 1000),
        "weights_public_key": public_hex,
        "weights_insecure": True,
        "description": "forged by bench chaos (mirrored_trust_anchor)",
    }
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", forged, run)


def _oldest_manifest(settings: KafkaSettings, topic: str) -> tuple[bytes, Any]:
    """The value and headers of the first record still in ``topic``, as written."""
    from rlstream.consumers.read_to_end import read_topic

    for msg in read_topic(settings, topic, name="chaos-replay", timeout=30):
        if msg.value() is not None:
            return msg.value() or b"", msg.headers()
    raise RuntimeError(f"no manifest in {topic} to replay")


def _injected(kind: str, msg: Message, dead_letter: bool) -> Injected:
    partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
    return Injected(kind, str(msg.topic()), partition, offset, dead_letter)


# --- feedback replay ------------------------------------------------------------------------


def replay_feedback(service: FeedbackProcess, tag: str) -> dict[str, Any]:
    """Send one signed feedback request, then replay it as an attacker holding a captured copy
    would: as is (at once, 4 times, and after the service was killed -9 and restarted),
    under a new Idempotency-Key, signed an hour ago, signed for another run, with its body
    altered. Returns every answer's status by attempt and the feedback id."""
    import json

    from rlstream.producers.feedback import auth as fa
    from rlstream.producers.feedback import models as fm

    fid = f"chaos-feedback-{tag}"
    body = json.dumps(_feedback_event(fid)).encode()

    def signed(ts: int, run: str = service.run, key: str = "") -> dict[str, str]:
        target = fa.Target("POST", fm.FEEDBACK_PATH, run)
        return {
            "Content-Type": "application/json",
            fa.KEY_ID_HEADER: "k1",
            fa.TIMESTAMP_HEADER: str(ts),
            fa.SIGNATURE_HEADER: fa.sign(service.key, str(ts), target, key, body),
        }

    now = int(time.time())
    captured = signed(now)
    post = lambda data, headers: _post(f"{service.url}{fm.FEEDBACK_PATH}", data, headers)  # noqa: E731
    answers: dict[str, list[int]] = {"original": [post(body, captured)]}
    answers["replayed"] = [post(body, captured) for _ in range(4)]
    answers["new_idempotency_key"] = [post(body, {**captured, fm.IDEMPOTENCY_HEADER: f"{fid}-2"})]
    answers["an_hour_old"] = [post(body, signed(now - 3600))]
    answers["another_run"] = [post(body, signed(now, run=f"{service.run}-other"))]
    answers["altered_body"] = [post(body.replace(b'"accepted"', b'"rejected"'), captured)]
    service.restart()
    answers["replayed_after_restart"] = [post(body, captured)]
    return {"feedback_id": fid, "answers": answers}


def _feedback_event(fid: str) -> dict[str, Any]:
    return {
        "feedback_id": fid,
        "request_id": f"{fid}-request",
        "policy_version": 0,
        "model": "policy",
        "action": "accepted",
        "token_ids": [1, 2, 3],
        "logprobs": [-0.1, -0.2, -0.3],
        "prompt_tokens": 1,
        "user_id": "chaos",
    }
