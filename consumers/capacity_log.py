"""The latest capacity signal of each region (``rl.RUN.capacity`` and its mirrored copies).

Rollout workers read their own region's signal (``lent``: which capacity slots roll out); the
scheduler reads every region's, home through MirrorMaker, to release tasks where capacity is
lent. Rules:
- on start each topic is read to its end, then followed (``consumers.follow``);
- per region the newest record by ``published_ms`` wins (copies arrive in any order);
- a region whose newest signal is older than ``stale_s`` lends nothing (``lent``): capacity is
  lent on a live signal only, so a capacity role that died or a cut link reclaims everything.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import Message

from rlstream.consumers.follow import TopicFollower
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics


class CapacityView:
    """The newest ``Capacity`` record per region, followed (see the module rules)."""

    def __init__(
        self, settings: KafkaSettings, topic_names: list[str], stale_s: float = 10.0
    ) -> None:
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._latest: dict[str, dict[str, Any]] = {}
        self._follower = TopicFollower(settings, "capacity-view", topic_names, self._note)

    @classmethod
    def for_role(
        cls, settings: KafkaSettings, run: str, regions: topics.Regions, here: str, **kw: Any
    ) -> CapacityView:
        """Every copy of the run's capacity stream a role in ``here`` reads."""
        local = topics.topic_name(run, "capacity")
        names = [topics.remote_topic(s, local) for s in regions.sources("capacity", here)]
        return cls(settings, names, **kw)

    def latest(self, region: str) -> dict[str, Any] | None:
        with self._lock:
            return self._latest.get(region)

    def regions(self) -> list[str]:
        with self._lock:
            return sorted(self._latest)

    def live(self, region: str, now_ms: int | None = None) -> dict[str, Any] | None:
        """The region's newest signal if younger than ``stale_s``, else None."""
        rec = self.latest(region)
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if rec is None or now_ms - int(rec["published_ms"]) > self.stale_s * 1000:
            return None
        return rec

    def lent(self, region: str, now_ms: int | None = None) -> int:
        """Engines the region lends now (0 without a live signal)."""
        rec = self.live(region, now_ms)
        return 0 if rec is None else int(rec["lent"])

    def close(self) -> None:
        self._follower.close()

    def _note(self, msg: Message) -> None:
        try:
            rec = events.decode(msg.value() or b"", expect="capacity").record
        except events.EventError:
            return  # not a capacity record: nothing a follower can lend on
        with self._lock:
            old = self._latest.get(rec["region"])
            if old is None or int(rec["published_ms"]) >= int(old["published_ms"]):
                self._latest[rec["region"]] = rec
