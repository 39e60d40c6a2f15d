"""Weight chunk retention: which chunk records no worker can still need, and deleting them.

Rule (``retention_cutoffs``): keep every chunk of every version at or after the
``keep_keyframes``-th newest keyframe (default 2: a worker catching up from the older keyframe is
never cut off when a new keyframe lands); per chunk partition, delete the records before the
first kept chunk (or, where no kept chunk lies, up to the last dropped one). Manifests are never
deleted: they are small and are the run's record. Chunks whose position is unknown make the rule
delete nothing.

Orphan chunks (written by a publish whose manifest never committed: an aborted transaction, a
learner that crashed between its chunks and its manifest, a fenced one; see
``producers.weights.publisher``) are named by no manifest and never applied; they go with the
versions around them: a cut at a kept chunk's offset deletes every orphan written before it in that
partition. The publisher spreads chunks round-robin over the partitions, so the oldest kept
keyframe, when it has at least as many chunks as the topic has partitions, has a chunk in every
partition, and every orphan older than it is deleted by the prune that drops the versions before
it; an orphan newer than the oldest kept keyframe stays until a later prune cuts past it.

``prune`` applies the rule with the admin client; the learner calls it (through
``WeightPublisher.prune``) whenever a new keyframe lands. This is the only way chunks go: the
chunk topic has no time retention, so a run paused for longer than any age limit still has the
keyframes its workers start from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

log = logging.getLogger(__name__)


def retention_cutoffs(
    manifests: Iterable[Mapping[str, Any]], keep_keyframes: int = 2
) -> dict[tuple[str, int], int]:
    """``(topic, partition) -> offset`` before which chunk records may be deleted.

    Rule: kept = every manifest whose version is at or after the ``keep_keyframes``-th newest
    keyframe version; per partition the cutoff is the smallest offset of a kept chunk there, or
    one past the largest dropped chunk where no kept chunk lies. Nothing is cut when there are
    fewer keyframes than ``keep_keyframes`` or when a kept chunk's position is unknown."""
    if keep_keyframes < 1:
        raise ValueError("keep_keyframes must be >= 1")
    records = list(manifests)
    keyframes = sorted({m["version"] for m in records if m["kind"] == "keyframe"})
    if len(keyframes) < keep_keyframes:
        return {}
    oldest_kept = keyframes[-keep_keyframes]
    kept: dict[tuple[str, int], int] = {}
    dropped: dict[tuple[str, int], int] = {}
    for m in records:
        keep = m["version"] >= oldest_kept
        for chunk in m["chunks"]:
            ref = chunk.get("ref")
            if ref is None:
                if keep:
                    return {}  # a kept chunk could be anywhere: cut nothing
                continue
            tp = (ref["topic"], ref["partition"])
            if keep:
                kept[tp] = min(kept.get(tp, ref["offset"]), ref["offset"])
            else:
                dropped[tp] = max(dropped.get(tp, -1), ref["offset"])
    cut = {tp: off + 1 for tp, off in dropped.items() if tp not in kept}
    cut.update({tp: off for tp, off in kept.items() if off > 0})
    return cut


def prune(
    admin: AdminClient,
    manifests: Iterable[Mapping[str, Any]],
    *,
    keep_keyframes: int = 2,
    timeout: float = 30.0,
) -> dict[tuple[str, int], int]:
    """Delete the chunk records ``retention_cutoffs`` allows; returns the new low watermarks.

    Manifests are never deleted. ``manifests`` is the model's manifest history (for instance
    ``rlstream.consumers.weights.manifest_log.read_manifests``, or ``WeightPublisher.history``)."""
    cuts = retention_cutoffs(manifests, keep_keyframes)
    if not cuts:
        return {}
    request = [TopicPartition(t, p, off) for (t, p), off in sorted(cuts.items())]
    futures = admin.delete_records(request, request_timeout=timeout, operation_timeout=timeout)
    out: dict[tuple[str, int], int] = {}
    for tp, future in futures.items():
        out[(tp.topic, tp.partition)] = future.result().low_watermark
    log.info("pruned weight chunks up to %s", out)
    return out
