"""Small helpers shared by integration tests: make topics, produce events, read a topic whole."""

from __future__ import annotations

import collections
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from rlstream.producers.client.admin import TopicWant, admin_client, apply_topics
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.signing import KEY_FILE, Signer
from rlstream.schemas import events, topics

_SIGNERS: dict[str, tuple[Signer, Path]] = {}

#: The round trip of the session's ``geo`` cluster's links: a short WAN, so every geo test
#: crosses one.
GEO_RTT_MS = 20.0


def signed_run(settings: KafkaSettings, run: str) -> Signer:
    """The signer of ``run``, created signed as its first learner start would create it
    (``consumers.weights.trust.ensure_run_key``: its key pinned on this host, so every
    reader here verifies with it), once per run: what a test's own publisher signs with."""
    import tempfile

    from rlstream.consumers.weights.trust import ensure_run_key

    if run not in _SIGNERS:
        path = Path(tempfile.mkdtemp(prefix="rlstream-test-key-")) / KEY_FILE
        signer = ensure_run_key(settings, run, path)
        assert signer is not None
        _SIGNERS[run] = (signer, path)
    return _SIGNERS[run][0]


def run_key_file(run: str) -> Path:
    """The private key file of a run made by ``signed_run`` (for tests that play a leaked key)."""
    return _SIGNERS[run][1]


def make_topics(settings: KafkaSettings, *names: str, partitions: int = 3) -> None:
    apply_topics(admin_client(settings), [TopicWant(n, partitions) for n in names])


def task(run: str, task_id: str) -> dict[str, Any]:
    return {
        "run": run,
        "task_id": task_id,
        "created_ms": int(time.time() * 1000),
        "family": "arith",
        "prompt": f"prompt {task_id}",
        "spec_json": "{}",
        "group_size": 4,
        "max_turns": 1,
        "seed": 7,
    }


def read_all(
    settings: KafkaSettings, topic: str, committed_only: bool = True, timeout: float = 15.0
) -> list[tuple[bytes | None, bytes, Any]]:
    """Every record of ``topic`` as (key, value, message), reading until each partition's end."""
    consumer = Consumer(
        {
            **settings.librdkafka(),
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": "false",
            "enable.partition.eof": "true",
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
        }
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        open_parts, out = set(parts), []
        deadline = time.monotonic() + timeout
        while open_parts and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    open_parts.discard(msg.partition())
                continue
            out.append((msg.key(), msg.value(), msg))
        assert not open_parts, f"did not reach the end of {topic} partitions {open_parts}"
        return out
    finally:
        consumer.close()


def decode_all(settings: KafkaSettings, topic: str) -> list[events.Decoded]:
    return [events.decode(v) for _, v, _ in read_all(settings, topic)]


def decisions(settings: KafkaSettings, run: str) -> dict[str, list[str]]:
    """group id -> what admission decided for it, in stream order ("admitted" or the
    rejection's reason): one entry per decision, so a group decided twice shows twice."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for stream in ("admitted", "rejected"):
        for d in decode_all(settings, topics.topic_name(run, stream)):
            if d.record["part_index"] == 0:
                out[d.record["group_id"]].append(d.record["reason"] or "admitted")
    return out


def first_record(consumer: Consumer, timeout: float = 30.0) -> Message:
    """The first record ``consumer`` polls within ``timeout`` (a MirrorMaker copy may take a
    refresh to arrive); a consumer error is raised, no record is an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error() is not None:
            raise KafkaException(msg.error())
        return msg
    raise AssertionError(f"no record within {timeout}s")


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    procs: Mapping[str, subprocess.Popen],
    may_exit: tuple[str, ...] = ("scheduler",),
    what: str = "the pipeline",
) -> None:
    """Poll ``predicate`` once a second until it holds; fail at once when a role process we
    started exited (except those in ``may_exit``: the scheduler ends when it released its
    tasks), and after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = [n for n, p in procs.items() if p.poll() is not None and n not in may_exit]
        assert not dead, f"role(s) exited: {dead}"
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


#: The roles of a whole one-region run (both judges, one rollout worker), as
#: ``start_recipe_roles`` takes them.
PIPELINE_ROLES: list[tuple[str, list[str]]] = [
    ("learner", []),
    ("admission", []),
    ("judge", ["--name", "tests"]),
    ("judge", ["--name", "format"]),
    ("rollout", ["--member", "0"]),
    ("scheduler", []),
]


def manifest_records(settings: KafkaSettings, run: str) -> list[dict[str, Any]]:
    """Every committed weight manifest of ``run``, as written."""
    return [d.record for d in decode_all(settings, topics.topic_name(run, "weights.manifests"))]


def start_recipe_roles(
    settings: KafkaSettings, run: str, tmp: Path, recipe: str, roles: list[tuple[str, list[str]]]
) -> dict[str, subprocess.Popen]:
    """Each (role, extra args) as its own process on ``recipe``, named ROLE[-NAME]."""
    from rlstream.ops.demo.demo import start_role

    procs = {}
    for role, extra in roles:
        name = "-".join([role, *[e for e in extra if not e.startswith("-")]])
        args = ["--config", recipe, *extra]
        procs[name] = start_role(role, run, settings, tmp, args, name).proc
    return procs


def stop_procs(procs: Mapping[str, subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGTERM each process we started (by pid), wait, then SIGKILL what is left."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def chunk_filter_publisher(base: type, on_chunk: Callable[[int, str, int, bytes], bytes]) -> type:
    """A ``WeightPublisher`` subclass whose chunk payloads pass through ``on_chunk(version, kind,
    index, payload)`` on their way to the broker (a slow link, a corrupt byte); the manifests
    stay truthful. Faults come from the harness, never from a switch in the publisher."""

    class Filtered(base):  # type: ignore[misc, valid-type]
        def _write_chunks(self, version: int, items: Any) -> Any:
            items = [
                (key, {**rec, "payload": on_chunk(version, *key, rec["payload"])}, where)
                for key, rec, where in items
            ]
            return super()._write_chunks(version, items)

    return Filtered
