"""Follow some topics from their beginning, in a background thread, without a consumer group.

For state a role keeps in memory from a stream it does not consume as a group member: the
capacity of each region, the groups reclaimed part-way. Rules:
- each topic is read to its end when first found (``read_to_end``), then followed;
- a topic that does not exist yet (a MirrorMaker copy appears with its first record) is looked
  for again every ``RESCAN_S``;
- ``note`` sees every record once, in order per partition, on the follower's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.producers.client.settings import KafkaSettings

RESCAN_S = 2.0


class TopicFollower:
    """``note(msg)`` for every record of ``topic_names`` (see the module rules)."""

    def __init__(
        self,
        settings: KafkaSettings,
        name: str,
        topic_names: Iterable[str],
        note: Callable[[Message], None],
    ) -> None:
        self._note = note
        self._wanted = list(dict.fromkeys(topic_names))
        self._reader = reader(settings, name, **{"fetch.wait.max.ms": "100"})
        self._assigned: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._scan()
        self._thread = threading.Thread(target=self._follow, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._reader.close()

    def _scan(self) -> None:
        """Read any wanted topic not yet assigned to its end, then follow every one."""
        known = {t for t, _ in self._assigned}
        fresh = [
            TopicPartition(name, p, OFFSET_BEGINNING)
            for name in self._wanted
            if name not in known
            for p in partitions_of(self._reader, name) or []
        ]
        if not fresh:
            return
        held = list(self._assigned)
        positions = {(tp.topic, tp.partition): OFFSET_BEGINNING for tp in fresh}
        for msg in read_to_end(self._reader, fresh):
            if msg.error() is None:
                self._note(msg)
            positions[(str(msg.topic()), int(msg.partition() or 0))] = int(msg.offset() or 0) + 1
        # read_to_end assigned the fresh partitions only: the others go on from where they were
        self._assigned = {**{k: self._assigned[k] for k in held}, **positions}
        self._reader.assign([TopicPartition(t, p, o) for (t, p), o in self._assigned.items()])

    def _follow(self) -> None:
        next_scan = time.monotonic() + RESCAN_S
        while not self._stop.is_set():
            if time.monotonic() >= next_scan:
                if len({t for t, _ in self._assigned}) < len(self._wanted):
                    self._scan()
                next_scan = time.monotonic() + RESCAN_S
            if not self._assigned:
                self._stop.wait(0.2)
                continue
            for msg in self._reader.consume(100, 0.2):
                if msg.error() is None:
                    self._note(msg)
                    key = (str(msg.topic()), int(msg.partition() or 0))
                    self._assigned[key] = int(msg.offset() or 0) + 1
