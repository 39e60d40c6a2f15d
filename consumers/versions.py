"""Follow the learner's policy version from the weights.manifests stream.

The version watcher reads the manifests topic on its own (no consumer group, no commits), from
the beginning, in a background thread, and exposes the newest version it has seen. Roles that
only need *which* version is current (scheduler, admission, feedback-rl) use it; rollout
workers, which need the weights, use the weight subscriber instead.

Guarantee: the constructor returns only after the watcher has read the topic up to its end as of
that moment (or ``catch_up_s`` passed), so a role that (re)starts never judges staleness against
an unknown learner version: a restarted admission would otherwise admit stale groups as fresh.
"""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import events


class VersionWatcher:
    """Newest policy version of ``model`` announced on ``topic`` (-1 before the first)."""

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        model: str | None = None,
        catch_up_s: float = 30.0,
    ) -> None:
        self.topic, self.model = topic, model
        self._version = -1
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._consumer = Consumer(
            {
                **settings.librdkafka(),
                "group.id": "rlstream.version-watch",
                "enable.auto.commit": "false",
                "enable.partition.eof": "true",
                "isolation.level": "read_committed",
                "topic.metadata.refresh.interval.ms": "2000",
            }
        )
        self._end = self._end_offset()
        if self._end <= 0:
            self._caught_up.set()  # nothing published yet
        self._thread = threading.Thread(target=self._follow, name="version-watch", daemon=True)
        self._thread.start()
        self._caught_up.wait(catch_up_s)

    @property
    def version(self) -> int:
        return self._version

    def _end_offset(self) -> int:
        try:
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.topic, 0), timeout=10
            )
        except KafkaException:
            return 0  # no such topic yet
        return int(high)

    def _follow(self) -> None:
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        decode = events.deserializer(expect="weight_manifest")
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._caught_up.set()
                continue
            self._take(msg.value(), decode)
            if (msg.offset() or 0) + 1 >= self._end:
                self._caught_up.set()

    def _take(self, value: bytes | None, decode: Any) -> None:
        try:
            rec: dict[str, Any] = decode(value, None).record
        except events.EventError:
            return  # not ours to dead-letter: the learner's own stream
        if self.model is None or rec["model"] == self.model:
            self._version = max(self._version, int(rec["version"]))

    def wait_for(self, version: int, timeout: float) -> bool:
        waited = 0.0
        while self._version < version and waited < timeout:
            self._stop.wait(0.1)
            waited += 0.1
        return self._version >= version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()
