"""A short multi-region run for fault tests: roles as processes in their regions, and the ledger.

``GeoRun`` starts learner, admission, the ``tests`` judge and the scheduler in the trainer
region and one rollout worker per rollout region, each ``rlstream run ... --region R`` against
the session's local multi-region cluster (``geo``). ``ledger`` reads back, from the trainer
region's streams (``rlstream.ops.observe.ledger``), what was released (with each task's attempts and
regions), decided (admitted or rejected) and trained; ``reconcile`` asserts nothing was lost and
nothing trained twice.
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import read_all

from rlstream.ops import cluster
from rlstream.ops.demo.demo import start_role
from rlstream.ops.observe.ledger import Ledger, read_ledger
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

SETTINGS = [
    "groups_per_step=2",
    "group_size=4",
    "max_staleness=2",
    "learner.warm_start.steps=30",
    "learner.keyframe_every=3",
    "admission.reject_no_signal=false",
    'admission.judges={"tests": 1.0}',
    "rollout.harness.max_new_tokens=16",
]


def settings_of(home: Path, region: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=cluster.load(home).bootstrap(region))


@dataclass
class GeoRun:
    home: Path
    run: str
    tmp: Path
    rollout: list[str]
    tasks: int
    extra_sets: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # every role's: the run's public key
    learner_env: dict[str, str] = field(default_factory=dict)

    @property
    def regions(self) -> topics.Regions:
        return topics.Regions("trainer", tuple(self.rollout))

    def sets(self) -> list[str]:
        sets = [
            *SETTINGS,
            f"scheduler.max_tasks={self.tasks}",
            f"regions.rollout={json.dumps(self.rollout)}",
            f"learner.state_dir={self.tmp / self.run / 'learner'}",
            f"learner.warm_start_cache={self.tmp / 'warm.pt'}",
            *self.extra_sets,
        ]
        return [arg for item in sets for arg in ("--set", item)]

    def start(self) -> GeoRun:
        from rlstream.consumers.weights.trust import ensure_run_key
        from rlstream.producers.weights.signing import KEY_FILE, SIGNING_KEY_ENV, VERIFY_KEY_ENV

        (self.tmp / self.run).mkdir(parents=True, exist_ok=True)
        for name in self.regions.names:
            ensure_run_topics(
                settings_of(self.home, name), self.run, regions=self.regions, here=name
            )
        # the run's key before any role, given to every role (a rollout region trusts only the
        # key it is given) and its file to the learner alone, as `rlstream demo` does
        key_file = self.tmp / self.run / "learner-key" / KEY_FILE
        signer = ensure_run_key(settings_of(self.home, "trainer"), self.run, key_file)
        assert signer is not None
        self.env = {VERIFY_KEY_ENV: signer.public_hex}
        self.learner_env = {**self.env, SIGNING_KEY_ENV: str(key_file)}
        self._start("learner", "learner", "trainer")
        self._start("admission", "admission", "trainer")
        self._start("judge-tests", "judge", "trainer", "--name", "tests")
        for i, region in enumerate(self.rollout):
            self._start(f"rollout-{region}", "rollout", region, "--member", str(i))
        self._start("scheduler", "scheduler", "trainer")
        return self

    def _start(self, name: str, role: str, region: str, *extra: str) -> None:
        settings = settings_of(self.home, region)
        logs = self.tmp / self.run
        env = self.learner_env if role == "learner" else self.env
        proc = start_role(
            role, self.run, settings, logs, [*self.sets(), *extra], name, region, env=env
        )
        self.procs[name] = proc.proc

    def log(self, name: str) -> Path:
        return self.tmp / self.run / f"{name}.log"

    def wait(self, predicate: Any, timeout: float, what: str) -> None:
        """Wait for ``predicate()``; fails at once if a role process exited (the scheduler may
        exit when every task is decided)."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if predicate():
                print(f"{self.run}: {what} after {time.monotonic() - started:.0f}s", flush=True)
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None and n != "scheduler"]
            assert not dead, f"role(s) exited: {dead}; see {[str(self.log(n)) for n in dead]}"
            time.sleep(1)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

    def home_settings(self) -> KafkaSettings:
        return settings_of(self.home, "trainer")

    def ledger(self) -> Ledger:
        return read_ledger(self.home_settings(), self.run)

    def decided_count(self) -> int:
        """Groups decided so far (cheaper than ``ledger``)."""
        kafka, keys = self.home_settings(), set()
        for stream in ("admitted", "rejected"):
            keys |= {k for k, _, _ in read_all(kafka, topics.topic_name(self.run, stream))}
        return len(keys)

    def arrived(self, region: str) -> int:
        """Records of ``region``'s trajectories copy in the trainer region (its end offsets)."""
        topic = topics.remote_topic(region, topics.topic_name(self.run, "trajectories"))
        return end_offsets(self.home_settings(), topic)

    def weights_crossed(self, region: str) -> bool:
        """Whether ``region`` holds a copy of every weight manifest the trainer region holds
        (committed records counted: offsets differ, each side has its own transaction markers)."""
        local = topics.topic_name(self.run, "weights.manifests")
        there = settings_of(self.home, region)
        copied = len(read_all(there, topics.remote_topic("trainer", local)))
        return copied >= len(read_all(self.home_settings(), local))

    def reconcile(self) -> Ledger:
        """Every released group decided exactly once; trained at most once, admitted ones only."""
        ledger = self.ledger()
        assert len(ledger.released) == self.tasks, f"released {len(ledger.released)}"
        assert set(ledger.decided) == set(ledger.released), (
            f"lost: {sorted(set(ledger.released) - set(ledger.decided))}, "
            f"unknown: {sorted(set(ledger.decided) - set(ledger.released))}"
        )
        twice = {g: v for g, v in ledger.decided.items() if len(v) > 1}
        assert not twice, f"decided twice: {twice}"
        counts = collections.Counter(ledger.trained)
        assert not counts or max(counts.values()) == 1, (
            f"trained twice: {[g for g, c in counts.items() if c > 1]}"
        )
        admitted = {g for g, v in ledger.decided.items() if v == ["admitted"]}
        assert set(counts) <= admitted, f"trained but not admitted: {set(counts) - admitted}"
        return ledger

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def end_offsets(settings: KafkaSettings, topic: str) -> int:
    """Sum of the high watermarks of ``topic`` (0 when it does not exist yet or has no leader
    yet)."""
    from confluent_kafka import KafkaException, TopicPartition

    from rlstream.consumers.read_to_end import partitions_of, reader

    consumer = reader(settings, "geo-test-ends")
    try:
        parts = partitions_of(consumer, topic) or []
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts
        )
    except KafkaException:
        return 0
    finally:
        consumer.close()
