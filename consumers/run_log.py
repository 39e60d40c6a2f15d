"""The run log: every run's manifest, from the compacted ``rl.runs`` topic.

Every reader of run records reads them here: replay (a run's resolved config and seeds),
``rlstream runs``, the report and the dashboard (which run, in what state).

Rules:

- ``rl.runs`` is read from the beginning to its end as of the call (``read_topic``, which raises
  ``TimeoutError`` rather than stop short), by a reader of its own: no consumer group, no
  commits, committed records only;
- the last record of a run's key wins, as compaction keeps it; a tombstone deletes the run;
- records are decoded with the writer schemas in ``rl.schemas`` (read first, so a manifest
  written by newer code decodes too); an undecodable record is logged and skipped: the run keeps
  the manifest before it (`rlstream dlq` is where bad records show).
"""

from __future__ import annotations

import logging
from typing import Any

from rlstream.consumers.consumer import load_schema_topic
from rlstream.consumers.read_to_end import read_topic
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

log = logging.getLogger(__name__)


def run_manifests(settings: KafkaSettings, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """The newest manifest of every run in ``rl.runs``, by run name (deleted runs left out)."""
    store = events.SchemaStore()
    load_schema_topic(settings, store, timeout)
    decode = events.deserializer(store, expect="run_manifest")
    latest: dict[str, dict[str, Any]] = {}
    for msg in read_topic(settings, topics.RUNS_TOPIC, name="run-log", timeout=timeout):
        key = (msg.key() or b"").decode(errors="replace")
        if msg.value() is None:
            latest.pop(key, None)  # a tombstone deletes the run's manifest
            continue
        try:
            latest[key] = decode(msg.value(), None).record
        except events.EventError as exc:
            log.warning("runs: skipping undecodable record of %r: %s", key, exc)
    return latest


def run_manifest(
    settings: KafkaSettings, run: str, *, topic: str = topics.RUNS_TOPIC, timeout: float = 30.0
) -> dict[str, Any] | None:
    """The newest manifest of ``run`` in ``topic`` (``rl.runs``, or a region's copy of it), or
    None (none, or deleted). Decoded with the schemas this code knows, ``rl.schemas`` read only
    when a record names another; raises what reading raises (``RuntimeError`` when this client
    may not read the topic, ``TimeoutError``)."""
    store = events.default_store()
    latest: bytes | None = None
    for msg in read_topic(settings, topic, name="run-log", timeout=timeout):
        if (msg.key() or b"").decode(errors="replace") == run:
            latest = msg.value()  # a tombstone (None) deletes the run's manifest
    if latest is None:
        return None
    try:
        decode = events.deserializer(store, expect="run_manifest")
        try:
            return decode(latest, None).record
        except events.DecodeError as exc:
            if exc.reason != "unknown_schema":
                raise
            load_schema_topic(settings, store, timeout)  # written by newer code: learn it
            return decode(latest, None).record
    except events.EventError as exc:
        log.warning("runs: the manifest of %r does not decode: %s", run, exc)
        return None


def latest_run(manifests: dict[str, dict[str, Any]]) -> str | None:
    """The run whose manifest was updated last; None when there is none."""
    if not manifests:
        return None
    return max(manifests.values(), key=lambda m: (int(m.get("updated_ms", 0)), m["run"]))["run"]
