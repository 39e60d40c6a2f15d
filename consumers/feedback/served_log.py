"""The served stream looked up by request id: how feedback-rl finds the completion a feedback
names. ``serve policy`` records every completion it answers in ``rl.RUN.served`` (one Trajectory
record per choice, keyed by the request id; see ``rollout.serve``) before it answers, so an
editor can send feedback that carries nothing but the request id.

Rules:

- bounded: one index per served partition holds the newest ``max_ids`` request ids seen in it
  (request id -> offsets of its records); the records stay in Kafka and are read back by
  position when a feedback names them. Memory is O(``max_ids``) per partition, never O(log);
- Kafka-backed: an index is filled from the log, on first use from at most ``max_ids`` records
  before the partition's end, afterwards from where it stopped to the end as of the lookup.
  Since a completion is recorded (acknowledged by all in-sync replicas) before it is answered,
  every completion a feedback can name is below that end;
- which partition: served and feedback share the request-id key and partition count
  (``topics.REQUEST_STREAMS``), so feedback read from feedback partition p is looked up in served
  partition p; if the counts differ (a topic altered by hand) every served partition is searched;
- a request id outside the indexed window (older than the newest ``max_ids`` of its partition),
  or never served in this run, is not found, with the reason: never a guess;
- the choice is the feedback's ``metadata["choice"]`` (default 0: the only choice when n = 1);
  a completion split into segments is joined (``arrays.join_segments``);
- a ``trajectory_ref`` may name only a served completion: the run's served stream, the record of
  the feedback's request id and choice (``named``); any other topic or record is refused
  (``BadReference``) before anything is read from it;
- what was served decides (``served_mismatch``): a feedback that states its own policy
  version, model or token arrays must state the served ones exactly, else it is refused with
  the first difference; the trained tokens, logprobs, routes and version are always the served
  record's (``with_served``), never the client's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from confluent_kafka import TopicPartition

from rlstream.consumers.read_to_end import (
    lookup_reader,
    partitions_of,
    read_at,
    read_to_end,
    retrying,
)
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import arrays, topics
from rlstream.schemas.errors import RlstreamError


class NotServed(RlstreamError, LookupError):
    """The request id (or its choice) is not in the served stream's indexed window."""


class BadReference(NotServed):
    """A ``trajectory_ref`` that does not name the served completion of its feedback."""


@dataclass(frozen=True, slots=True)
class ServedCompletion:
    """One served choice, joined, and where its (first) record lies."""

    record: dict[str, Any]
    ref: dict[str, Any]
    """RecordRef of its first record: topic, partition, offset."""


@dataclass
class _Index:
    next_offset: int
    ids: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)


def remember(ids: OrderedDict[str, list[int]], key: str, offset: int, max_ids: int) -> None:
    """Index the record at ``offset`` under its request id; keep the newest ``max_ids`` ids.

    Rule: the records of one request (its choices, their segments) share one entry; adding to
    an entry makes it the newest; past ``max_ids`` entries the oldest is forgotten.
    """
    ids.setdefault(key, []).append(offset)
    ids.move_to_end(key)
    while len(ids) > max_ids:
        ids.popitem(last=False)


def feedback_choice(feedback: dict[str, Any]) -> int:
    """The choice a feedback is about: ``metadata["choice"]``, default 0 (see the module rules)."""
    raw = (feedback.get("metadata") or {}).get("choice", "0")
    if not (raw.isascii() and raw.isdigit()):
        raise NotServed(f"metadata.choice must be a choice index (0, 1, ...), got {raw!r}")
    return int(raw)


SERVED_FIELDS = (*arrays.ARRAY_FIELDS, "prompt_tokens", "temperature")
"""What a served completion gives the feedback that names it (with its version and model)."""


def served_mismatch(feedback: dict[str, Any], served: dict[str, Any]) -> str | None:
    """Why ``feedback`` disagrees with the completion it names (``served``), or None (see the
    module rules): its policy version and model, and its token arrays when it carries them."""
    for name in ("policy_version", "model"):
        if feedback.get(name) != served[name]:
            return f"it states {name} {feedback.get(name)!r}, the completion was served with {served[name]!r}"
    if feedback.get("token_ids") is None:
        return None
    try:
        given, truth = arrays.unpack_tokens(feedback), arrays.unpack_tokens(served)
    except arrays.ArrayError as exc:
        return f"its token arrays cannot be compared with the served ones: {exc}"
    for name in arrays.TOKEN_FIELDS:
        mine, theirs = getattr(given, name), getattr(truth, name)
        if name == "routed_experts" and mine.size == 0:
            continue  # routes left out: the served ones are used
        if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
            return f"its {name} differ from the served completion's"
    return None


def with_served(feedback: dict[str, Any], found: ServedCompletion) -> dict[str, Any]:
    """``feedback`` with the served completion's tokens, logprobs, routes and temperature.

    Rule: the policy version, the model and the task class are the served record's (what
    served it and what it was asked as, not what a client says: a feedback cannot move another
    class's baseline), and ``trajectory_ref`` is the served record's position.
    """
    served = found.record
    details = (served.get("outcome") or {}).get("details") or {}
    return {
        **feedback,
        **{k: served[k] for k in SERVED_FIELDS},
        "policy_version": served["policy_version"],
        "model": served["model"],
        "task_class": details.get("task_class") or None,
        "trajectory_ref": found.ref,
    }


class ServedLookup:
    """Finds served completions by request id (see the module rules)."""

    def __init__(self, settings: KafkaSettings, run: str, max_ids: int) -> None:
        self.topic = topics.topic_name(run, "served")
        self.feedback_topic = topics.topic_name(run, "feedback")
        self.max_ids = max_ids
        self.consumer = lookup_reader(settings, "feedback-rl.served-lookup")
        self.indexes: dict[int, _Index] = {}
        self._served: list[int] | None = None
        self._same_count = False

    def find(self, request_id: str, choice: int, feedback_partition: int) -> ServedCompletion:
        """The served ``choice`` of ``request_id``; ``NotServed`` with the reason if absent."""
        for p in self._partitions(feedback_partition):
            offsets = self._index(p).ids.get(request_id)
            if offsets is None:
                self._catch_up(p)
                offsets = self._index(p).ids.get(request_id)
            if offsets is not None:
                return self._choice(request_id, choice, p, offsets)
        raise NotServed(
            f"request {request_id!r} is not among the last {self.max_ids} completions served "
            f"per partition of {self.topic}"
        )

    def named(self, feedback: dict[str, Any], feedback_partition: int) -> ServedCompletion:
        """The served completion ``feedback`` names: at its ``trajectory_ref`` when it has one
        (which must be that completion's record: ``BadReference``), else found by its request id
        and choice; ``NotServed`` with the reason otherwise."""
        request_id, choice = feedback["request_id"], feedback_choice(feedback)
        ref = feedback.get("trajectory_ref")
        if ref is None:
            return self.find(request_id, choice, feedback_partition)
        where = f"{ref['topic']}[{ref['partition']}]@{ref['offset']}"
        if ref["topic"] != self.topic:
            raise BadReference(
                f"its trajectory_ref {where} is not in the served stream {self.topic}"
            )
        rec = read_at(self.consumer, self.topic, ref["partition"], ref["offset"])
        if rec is None or rec.get("group_id") != request_id or rec.get("sample_index") != choice:
            raise BadReference(
                f"its trajectory_ref {where} is not the served completion of request "
                f"{request_id!r}, choice {choice}"
            )
        if int(rec.get("segment_count") or 1) == 1:
            return ServedCompletion(rec, {k: ref[k] for k in ("topic", "partition", "offset")})
        found = self.find(request_id, choice, ref["partition"])  # its segments, joined
        if found.ref != {k: ref[k] for k in ("topic", "partition", "offset")}:
            raise BadReference(f"its trajectory_ref {where} is not its completion's first record")
        return found

    def _partitions(self, feedback_partition: int) -> list[int]:
        if self._served is None:
            served = partitions_of(self.consumer, self.topic) or []
            feedback = partitions_of(self.consumer, self.feedback_topic) or []
            if not served:
                return []  # not created yet: asked again next time
            self._served, self._same_count = served, len(served) == len(feedback)
        if self._same_count and feedback_partition in self._served:
            return [feedback_partition]
        return list(self._served)

    def _index(self, partition: int) -> _Index:
        if partition not in self.indexes:
            where = TopicPartition(self.topic, partition)
            low, high = retrying(
                lambda: self.consumer.get_watermark_offsets(where, timeout=10, cached=False)
            )
            self.indexes[partition] = _Index(max(low, high - self.max_ids))
            self._catch_up(partition)
        return self.indexes[partition]

    def _catch_up(self, partition: int) -> None:
        """Index the partition's records from where the index stopped to its end now."""
        index = self.indexes[partition]
        start = [TopicPartition(self.topic, partition, index.next_offset)]
        for msg in read_to_end(self.consumer, start, timeout=30):
            offset, key = int(msg.offset() or 0), (msg.key() or b"").decode("utf-8", "replace")
            remember(index.ids, key, offset, self.max_ids)
            index.next_offset = offset + 1

    def _choice(
        self, request_id: str, choice: int, partition: int, offsets: list[int]
    ) -> ServedCompletion:
        pieces, first = [], None
        for offset in offsets:
            rec = read_at(self.consumer, self.topic, partition, offset)
            if rec is None or rec.get("group_id") != request_id:
                raise NotServed(f"served record {self.topic}[{partition}]@{offset} is unreadable")
            if rec["sample_index"] == choice:
                pieces.append(rec)
                first = offset if first is None else first
        if first is None:
            raise NotServed(f"request {request_id!r} has no choice {choice}")
        try:
            record = arrays.join_segments(pieces) if len(pieces) > 1 else pieces[0]
        except arrays.ArrayError as exc:
            raise NotServed(f"request {request_id!r}: its segments do not join: {exc}") from exc
        return ServedCompletion(
            record, {"topic": self.topic, "partition": partition, "offset": first}
        )

    def forget(self, partition: int) -> None:
        """Drop a partition's index (its feedback partition was revoked)."""
        self.indexes.pop(partition, None)

    def close(self) -> None:
        self.consumer.close()
