"""Follow the learner's policy version from the weights.manifests stream.

The version watcher reads the manifests through a ``ManifestLog`` (the one reader of weight
manifests: its own reader, no consumer group, no commits), from the beginning, then follows it in
a background thread, and exposes the newest version it has seen. Roles that only need *which*
version is current (scheduler, admission, feedback-rl) use it; rollout workers, which need the
weights, use the weight subscriber instead. It keeps the newest version's manifests only.

Guarantee: the constructor returns only after the watcher has read the topic up to its end as of
that moment (or ``catch_up_s`` passed), so a role that (re)starts never judges staleness against
an unknown learner version: a restarted admission would otherwise admit stale groups as fresh.
"""

from __future__ import annotations

import logging
import threading

from rlstream.consumers.weights.manifest_log import ManifestLog
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.signing import Verifier

log = logging.getLogger(__name__)


class VersionWatcher:
    """Newest policy version of ``model`` announced on ``topic`` (-1 before the first)."""

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        model: str | None = None,
        catch_up_s: float = 30.0,
        verifier: Verifier | None = None,
    ) -> None:
        self.topic, self.model = topic, model
        self._manifests = ManifestLog(
            settings, topic, model, name="version-watch", verifier=verifier
        )
        self._stop = threading.Event()
        try:
            self._manifests.catch_up(catch_up_s)
        except TimeoutError:
            log.warning("version watcher: %s not read to its end in %.0fs", topic, catch_up_s)
        self._forget()
        self._thread = threading.Thread(target=self._follow, name="version-watch", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        newest = self._manifests.newest
        return -1 if newest is None else newest

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                if self._manifests.wait(0.5):
                    self._forget()
            except Exception:  # the learner's own stream: not ours to dead-letter; retry
                log.exception("version watcher: reading %s failed", self.topic)
                self._stop.wait(1.0)

    def _forget(self) -> None:
        """Only the newest version matters here: a long run's history stays out of memory."""
        if self._manifests.newest is not None:
            self._manifests.forget_before(self._manifests.newest)

    def wait_for(self, version: int, timeout: float) -> bool:
        waited = 0.0
        while self.version < version and waited < timeout:
            self._stop.wait(0.1)
            waited += 0.1
        return self.version >= version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # never close the reader under a thread still in it
            self._manifests.close()
