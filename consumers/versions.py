"""Follow the learner's policy version from the weights.manifests stream.

The version watcher reads the manifests topic on its own (no consumer group, no commits), from
the beginning, in a background thread, and exposes the newest version it has seen. Roles that
only need *which* version is current (scheduler, admission, feedback-rl) use it; rollout
workers, which need the weights, use the weight subscriber instead.
"""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import events


class VersionWatcher:
    """Newest policy version of ``model`` announced on ``topic`` (-1 before the first)."""

    def __init__(self, settings: KafkaSettings, topic: str, model: str | None = None) -> None:
        self.topic, self.model = topic, model
        self._version = -1
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **settings.librdkafka(),
                "group.id": "rlstream.version-watch",
                "enable.auto.commit": "false",
                "isolation.level": "read_committed",
                "topic.metadata.refresh.interval.ms": "2000",
            }
        )
        self._thread = threading.Thread(target=self._follow, name="version-watch", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def _follow(self) -> None:
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        decode = events.deserializer(expect="weight_manifest")
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            try:
                rec: dict[str, Any] = decode(msg.value(), None).record
            except events.EventError:
                continue  # not ours to dead-letter: the learner's own stream
            if self.model is None or rec["model"] == self.model:
                self._version = max(self._version, int(rec["version"]))

    def wait_for(self, version: int, timeout: float) -> bool:
        deadline = threading.Event()
        waited = 0.0
        while self._version < version and waited < timeout:
            deadline.wait(0.1)
            waited += 0.1
        return self._version >= version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()
