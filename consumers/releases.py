"""Which regions each task of a run was released to, read back from the tasks stream.

The scheduler writes every release of a task to the run's tasks stream, keyed by the task id,
with the region it is meant for in ``tags["region"]`` (``REGION_TAG``) and its attempt; a
re-issue to another region is one more record of the same task id (``rollout.reissue``).
Admission reads it back here so that a region can only send home the groups of tasks released
to it (``admission_rules.release_refusal``).

Rules:

- ``released_to(task_id)`` is the set of regions the task was released to over all its
  releases, ``None`` when the stream holds no release of it; a release without a region tag
  (written before regions existed) counts for every region (``ANY_REGION``);
- read on demand: a task id not known yet makes the reader read the stream from where it
  stopped to its end as of that moment (``read_to_end``) before it answers. A genuine trajectory
  or reward is written after its task was in the stream (a rollout worker read the task there;
  MirrorMaker copies it out only after the scheduler wrote it home), so its release is below
  that end: a task still unknown afterwards was never released;
- ``release_ref(task_id, region)`` is the position of the task's newest release to ``region``
  (else to any region, else its newest release): admission records it in its decision, so lineage
  joins a group to its task record without a search;
- bounded: the newest ``max_tasks`` task ids are kept (the least recently released forgotten
  first); a group of a forgotten task is far past any staleness budget and is refused as
  unreleased, never admitted by mistake.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events, topics

REGION_TAG = "region"
"""The task tag naming the region whose rollout workers take the task."""
ANY_REGION = "*"
"""What an untagged release counts for: every region."""


def target_of(task: Mapping[str, Any]) -> str | None:
    """The region a task is meant for (None: any region that reads it)."""
    return (task.get("tags") or {}).get(REGION_TAG)


class TaskReleases:
    """The regions each task was released to (see the module rules)."""

    def __init__(self, settings: KafkaSettings, run: str, max_tasks: int) -> None:
        self.topic = topics.topic_name(run, "tasks")
        self.max_tasks = max_tasks
        self._reader = reader(settings, f"{run}.releases")
        self._next: dict[int, int] = {}  # partition -> next offset to read
        # task id -> region -> position of its newest release there
        self._regions: OrderedDict[str, dict[str, dict[str, Any]]] = OrderedDict()
        self._decode = events.deserializer(expect="task")
        self.refreshes = 0

    def released_to(self, task_id: str, region: str | None = None) -> frozenset[str] | None:
        """The regions ``task_id`` was released to; None if it never was (read on demand: also
        when ``region`` is not among them yet, since a re-issue there may not have been read)."""
        found = self._regions.get(task_id)
        if found is None or (region is not None and not {region, ANY_REGION} & set(found)):
            self.refresh()
            found = self._regions.get(task_id)
        return None if found is None else frozenset(found)

    def release_ref(self, task_id: str, region: str) -> dict[str, Any] | None:
        """Where the task's release to ``region`` lies (see the module rules); None if the
        task was never released (or is forgotten)."""
        found = self._regions.get(task_id) or {}
        ref = found.get(region) or found.get(ANY_REGION)
        return ref if ref is not None else next(reversed(found.values()), None)

    def refresh(self) -> None:
        """Read the stream from where the last read stopped to its end as of now."""
        self.refreshes += 1
        parts = partitions_of(self._reader, self.topic) or []
        starts = [TopicPartition(self.topic, p, self._next.get(p, OFFSET_BEGINNING)) for p in parts]
        for msg in read_to_end(self._reader, starts):
            partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
            self._next[partition] = offset + 1
            try:
                task = self._decode(msg.value(), None).record
            except events.EventError:
                continue  # not a task: nothing was released by it
            ref = {"topic": self.topic, "partition": partition, "offset": offset}
            self._note(str(task["task_id"]), target_of(task) or ANY_REGION, ref)
        self._reader.unassign()  # read on demand: no fetch ahead, none in flight at the next read

    def _note(self, task_id: str, region: str, ref: dict[str, Any]) -> None:
        regions = self._regions.pop(task_id, {})
        regions.pop(region, None)  # the newest release last
        regions[region] = ref
        self._regions[task_id] = regions
        while len(self._regions) > self.max_tasks:
            self._regions.popitem(last=False)

    def close(self) -> None:
        self._reader.close()
