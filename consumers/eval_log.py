"""The one reader of a run's eval events (``rl.RUN.evals``, written by the eval role).

``read_evals`` reads the stream to its end (``read_committed``: an evaluation whose transaction
never committed is never seen); ``ReleaseFollower`` keeps following it in a background thread and
knows the newest *released* version of a model, which is what serving that follows released
versions only (``rlstream serve policy --released-only``) may serve. Undecodable records are
skipped here (a tap or ``rlstream dlq`` shows them); nothing in this module writes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from rlstream.consumers.read_to_end import partitions_of, read_topic, reader
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

log = logging.getLogger(__name__)


def _decode(value: bytes | None) -> dict[str, Any] | None:
    try:
        return events.decode(value or b"", expect="eval").record
    except events.DecodeError:
        return None


def read_evals(
    settings: KafkaSettings, run: str, *, topic: str | None = None, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Every committed eval event of ``run`` so far, in log order."""
    name = topic or topics.topic_name(run, "evals")
    out = []
    for msg in read_topic(settings, name, name=f"{run}.eval-log", timeout=timeout):
        rec = _decode(msg.value())
        if rec is not None:
            out.append(rec)
    return out


class ReleaseFollower:
    """The released versions of ``model`` in ``run``: read to the end at construction, then
    followed in a background thread. ``newest`` is the newest released version (None before
    the first release); ``released(v)`` says whether ``v`` was released."""

    def __init__(
        self, settings: KafkaSettings, run: str, model: str, *, topic: str | None = None
    ) -> None:
        self.model = model
        self.topic = topic or topics.topic_name(run, "evals")
        self._lock = threading.Lock()
        self._released: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._consumer = reader(settings, f"{run}.release-follower")
        parts = partitions_of(self._consumer, self.topic) or [0]
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
        for rec in read_evals(settings, run, topic=self.topic):
            self._take(rec)
        self._thread = threading.Thread(target=self._follow, name="release-follower", daemon=True)
        self._thread.start()

    def _take(self, rec: dict[str, Any]) -> None:
        if rec["model"] == self.model and rec["released"]:
            with self._lock:
                self._released[int(rec["version"])] = rec

    @property
    def newest(self) -> int | None:
        with self._lock:
            return max(self._released) if self._released else None

    def released(self, version: int) -> bool:
        with self._lock:
            return version in self._released

    def record(self, version: int) -> dict[str, Any] | None:
        """The eval event that released ``version``."""
        with self._lock:
            return self._released.get(version)

    def _follow(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            rec = _decode(msg.value())
            if rec is not None:
                self._take(rec)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()
