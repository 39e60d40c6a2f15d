"""The feedback ids a run's feedback stream already holds: deduplication that survives restarts
and is shared by every replica of feedback-ingest.

Rules:
- on start, the stream (``rl.RUN.feedback``, every partition) is read from the first record
  younger than the idempotency window to its end (``read_to_end``); each record's feedback id
  in its client's namespace (its ``feedback_id`` and ``feedback_client`` headers, so nothing is
  decoded: ``producers.feedback.dedupe.key_of_headers``) is remembered with its age;
- a background thread then follows the stream, so ids stored by other replicas become
  duplicates here too, within the follower's lag (at most ``FOLLOW_WAIT_MS`` plus a poll on a
  live cluster, well under a second). The broker holds each fetch until ``FOLLOW_MIN_BYTES``
  arrived or ``FOLLOW_WAIT_MS`` passed: answering a fetch per produce request instead (the
  client default) cost the broker more CPU than the writes themselves, on the same machine as
  the service under load;
- what is remembered is bounded exactly as in ``IdempotencyLRU``: ids younger than the window
  and at most ``max_ids`` of them (the oldest forgotten first); the count and the bound are
  exported as ``rlstream_buffer_items`` / ``rlstream_buffer_bound`` (``feedback.seen``).

A retry that reaches another replica inside that lag can still be stored twice; the record
carries the same feedback id, and feedback-rl decides each feedback id once.
"""

from __future__ import annotations

import threading
import time

from confluent_kafka import Message, TopicPartition

from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader, retrying
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback.dedupe import IdempotencyLRU, key_of_headers
from rlstream.producers.feedback.models import FeedbackServiceConfig
from rlstream.producers.runtime.metrics import track_buffer
from rlstream.schemas import topics

#: How long the broker may hold a follower fetch for more data: the bound on the follower's lag.
FOLLOW_WAIT_MS = 100
#: A follower fetch is answered early once this much data is there.
FOLLOW_MIN_BYTES = 1024 * 1024
#: Records taken from the client per call while following.
_BATCH = 1000


class FeedbackIdLog:
    """``Dedupe`` backed by the feedback stream (see the module rules). Thread-safe."""

    def __init__(
        self, settings: KafkaSettings, run: str, window_s: float, max_ids: int, member: str = "0"
    ) -> None:
        self.topic = topics.topic_name(run, "feedback")
        self._ids = IdempotencyLRU(window_s, max_ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = reader(
            settings,
            f"{run}.feedback-ingest.{member}.dedupe",
            **{"fetch.wait.max.ms": str(FOLLOW_WAIT_MS), "fetch.min.bytes": str(FOLLOW_MIN_BYTES)},
        )
        self.loaded = self._catch_up(window_s)
        self._thread = threading.Thread(target=self._follow, name="feedback-dedupe", daemon=True)
        self._thread.start()

    def __contains__(self, feedback_id: object) -> bool:
        with self._lock:
            return feedback_id in self._ids

    def add(self, feedback_id: str, age_s: float = 0.0) -> None:
        self.add_many([(feedback_id, age_s)])

    def add_many(self, ids: list[tuple[str, float]]) -> None:
        """Remember each (feedback id, age in seconds), in order, under one lock."""
        with self._lock:
            for feedback_id, age_s in ids:
                self._ids.add(feedback_id, age_s)
            size = len(self._ids)
        track_buffer("feedback.seen", size, self._ids.max_ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._reader.close()

    def __enter__(self) -> FeedbackIdLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _catch_up(self, window_s: float) -> int:
        """Remember the ids of the window, then stay assigned to every partition right after
        what was read (no record written meanwhile is skipped); returns the records read."""
        starts = self._window_starts(window_s)
        count = 0
        for msg in read_to_end(self._reader, starts):
            self.add_many(_ids_of([msg]))
            count += 1
        read = {tp.partition: tp for tp in self._reader.position(self._reader.assignment())}
        self._reader.assign([read.get(tp.partition, tp) for tp in starts])
        return count

    def _window_starts(self, window_s: float) -> list[TopicPartition]:
        """Per partition, the first offset younger than the window (its end if none is)."""
        parts = partitions_of(self._reader, self.topic) or []
        since_ms = int((time.time() - window_s) * 1000)
        query = [TopicPartition(self.topic, p, since_ms) for p in parts]
        reader = self._reader
        found = retrying(lambda: reader.offsets_for_times(query, timeout=10)) if query else []
        starts = []
        for tp in found:
            if tp.offset < 0:  # nothing that young: start at the end as of now
                tp = TopicPartition(self.topic, tp.partition, self._end(tp))
            starts.append(tp)
        return starts

    def _end(self, tp: TopicPartition) -> int:
        reader = self._reader
        _, high = retrying(lambda: reader.get_watermark_offsets(tp, 10, cached=False))
        return int(high)

    def _follow(self) -> None:
        while not self._stop.is_set():
            ids = _ids_of(self._reader.consume(_BATCH, 0.2))
            if ids:
                self.add_many(ids)


def durable_dedupe(cfg: FeedbackServiceConfig, settings: KafkaSettings) -> FeedbackIdLog | None:
    """The stream-backed dedupe of a feedback service, read back from the run's feedback
    stream (None when ``cfg`` turns it off)."""
    if not cfg.durable_dedupe:
        return None
    return FeedbackIdLog(settings, cfg.run, cfg.idempotency_window_s, cfg.idempotency_max_ids)


def _ids_of(msgs: list[Message]) -> list[tuple[str, float]]:
    """(dedupe key, age in seconds) of each record that has a ``feedback_id`` header."""
    now, out = time.time(), []
    for msg in msgs:
        if msg.error() is not None:
            continue
        key = key_of_headers(msg.headers())
        if key is None:
            continue
        _, ts_ms = msg.timestamp()
        age_s = max(0.0, now - ts_ms / 1000) if ts_ms > 0 else 0.0
        out.append((key, age_s))
    return out
