"""feedback-rl: real-time RL from editor feedback. Windows of the feedback stream become online
groups (``source=online``) in the admitted stream, next to the rollout groups; the rules that
decide a window are in ``consumers.feedback.rules``.

Rules a maintainer must keep:
- feedback is trained at most once per served completion: a repeated feedback id (compared in
  its client's namespace) or a second feedback on the same served completion is a duplicate,
  and feedback that matches nothing served claims nothing;
- exactly once without a state store: outputs, dead letters and offsets commit in one
  transaction (``TransactionalLoop``), a partition's committed offset is the first record of its
  open window, and baselines and remembered ids change only with a committed transaction;
- feedback trains only what was served: tokens, logprobs, routes, version and model come from
  the served record the feedback names; feedback that disagrees is rejected, never trained.

``mix_online_groups``/``mix_rollout_groups`` are read by the learner (see ``online_quota``).
Details: docs/feedback.md (feedback-rl).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TopicPartition

from rlstream.consumers.consumer import Record, RoleContext, Stopper
from rlstream.consumers.feedback.rules import FeedbackRLConfig, Item, RunningMean, window_decisions
from rlstream.consumers.feedback.served_log import (
    BadReference,
    NotServed,
    ServedLookup,
    served_mismatch,
    with_served,
)
from rlstream.consumers.read_to_end import read_to_end, reader
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.consumers.weights.versions import VersionWatcher
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback.dedupe import client_of_headers, dedupe_key
from rlstream.producers.weights.signing import Verifier
from rlstream.schemas import arrays, events, topics

__all__ = ["FeedbackRL", "FeedbackRLConfig", "decided", "run_role"]

# --- the role -------------------------------------------------------------------------------


@dataclass
class _Window:
    first_offset: int
    opened: float
    items: list[Item] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)


class FeedbackRL:
    """One feedback-rl member: windows per input partition, decided in transactions."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        cfg: FeedbackRLConfig,
        member: str = "0",
        version: Callable[[], int] | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.run_name, self.cfg = run, cfg
        self.names = topics.run_topics(run)
        self.watcher = None
        if version is None:
            # The watcher has caught up with the manifests when it returns (see versions.py).
            topic = self.names["weights.manifests"]
            watcher = VersionWatcher(settings, topic, cfg.model, verifier=verifier)
            self.watcher, version = watcher, lambda: watcher.version
        self.version = version
        self.windows: dict[tuple[str, int], _Window] = {}
        self.position: dict[tuple[str, int], int] = {}  # next offset to read, per partition
        self.baselines: dict[str, RunningMean] = {}
        self._committed_baselines: dict[str, RunningMean] = {}
        self.seen: OrderedDict[str, None] = OrderedDict()
        self._staged: list[str] = []
        self.counts: Counter[str] = Counter()
        self.settings = settings
        self.served = ServedLookup(settings, run, cfg.served_lookup_ids)
        group = topics.group_id(run, "feedback-rl")
        self.loop = TransactionalLoop(
            settings,
            group_id=group,
            topics=[topics.topic_pattern(run, "feedback")],
            transactional_id=f"{group}.{member}",
            instance_id=f"feedback-rl-{member}",
            dlq_topic=self.names["dlq"],
            process=self.process,
            offsets=self.offsets,
            on_abort=self._reset,
            on_assign=self._assigned,
            on_revoke=self._revoked,
            batch_size=cfg.batch_size,
        )

    def process(self, records: list[Record]) -> list[Output]:
        """Add a batch to the windows; decide every window that is full or due."""
        self._settle()
        outputs: list[Output] = []
        for rec in records:
            outputs += self._add(rec)
        return outputs + self._close_due(time.monotonic())

    def _add(self, rec: Record) -> list[Output]:
        tp, offset = rec.topic_partition, rec.offset
        self.position[tp] = max(self.position.get(tp, 0), offset + 1)
        if rec.event is None or rec.event.event != "feedback":
            self.counts["not_feedback"] += 1
            return []
        window = self.windows.get(tp)
        fid = dedupe_key(client_of_headers(rec.message.headers()), rec.value["feedback_id"])
        if self._decided(fid, window):
            self.counts["duplicate"] += 1
            return []
        value, outcome = self._served(rec.value, tp[1])
        claim = served_key(value) if outcome == "served_found" else None
        if claim is not None and self._decided(claim, window):
            self.counts["duplicate"] += 1  # this completion is trained already
            return []
        self.counts[outcome] += 1
        if window is None:
            window = self.windows[tp] = _Window(offset, time.monotonic())
        window.items.append(Item(value, {"topic": tp[0], "partition": tp[1], "offset": offset}))
        window.ids.update(k for k in (fid, claim) if k is not None)
        return self._close(tp) if len(window.items) >= self.cfg.window_size else []

    def _decided(self, key: str, window: _Window | None) -> bool:
        return key in self.seen or key in self._staged or (window is not None and key in window.ids)

    def _served(self, value: dict[str, Any], partition: int) -> tuple[dict[str, Any], str]:
        """The feedback with the served completion it names copied in (see the module), or as
        it is with the reason under ``lookup_error`` (not found) or ``served_refusal`` (a bad
        reference, a disagreement): then it is rejected as untrainable. With the outcome's
        count name (``served_found`` only for the first)."""
        try:
            found = self.served.named(value, partition)
        except BadReference as exc:
            return {**value, "served_refusal": str(exc)}, "trajectory_ref_unreadable"
        except NotServed as exc:
            return {**value, "lookup_error": str(exc)}, "served_not_found"
        why = served_mismatch(value, found.record)
        if why is not None:
            why = f"it disagrees with its served completion: {why}"
            return {**value, "served_refusal": why}, "served_mismatch"
        return with_served(value, found), "served_found"

    def _close_due(self, now: float) -> list[Output]:
        due = [tp for tp, w in self.windows.items() if now - w.opened >= self.cfg.window_seconds]
        return [out for tp in due for out in self._close(tp)]

    def _close(self, tp: tuple[str, int]) -> list[Output]:
        window = self.windows.pop(tp)
        window_id = f"{tp[0]}/{tp[1]}/{window.first_offset}"
        decisions, self.baselines = window_decisions(
            window.items,
            window_id,
            self.version(),
            self.baselines,
            self.cfg,
            self.run_name,
            int(time.time() * 1000),
        )
        self._staged += list(window.ids)
        outputs = []
        for decision in decisions:
            stream = "admitted" if decision["decision"] == "admitted" else "rejected"
            self.counts[decision["reason"] or "admitted"] += 1
            self.counts["samples_admitted"] += len(decision["samples"])
            for part in arrays.split_group(decision, topics.STREAMS[stream].max_value_bytes):
                outputs.append(Output(self.names[stream], "admission", part, decision["group_id"]))
        return outputs

    def offsets(self, records: list[Record]) -> list[TopicPartition]:
        """Per partition: the first record of its open window, else one past the last read."""
        for rec in records:  # undecodable records count as read: they were dead-lettered
            tp = rec.topic_partition
            self.position[tp] = max(self.position.get(tp, 0), rec.offset + 1)
        out = []
        for tp, nxt in sorted(self.position.items()):
            window = self.windows.get(tp)
            out.append(TopicPartition(tp[0], tp[1], window.first_offset if window else nxt))
        return out

    # --- transactions outside the loop's batches, state that follows commits ------------------

    def _settle(self) -> None:
        """The last transaction committed: make its remembered ids and baselines permanent."""
        for fid in self._staged:
            self.seen[fid] = None
        self._staged.clear()
        while len(self.seen) > self.cfg.dedup_ids:
            self.seen.popitem(last=False)
        self._committed_baselines = dict(self.baselines)

    def _reset(self) -> None:
        """A transaction aborted: forget uncommitted state; records are re-read from commits."""
        self.windows.clear()
        self.position.clear()
        self._staged.clear()
        self.baselines = dict(self._committed_baselines)

    def _assigned(self, partitions: list[TopicPartition]) -> None:
        """Remember the ids decided before the committed offsets of newly assigned partitions."""
        if not partitions or not self.cfg.dedup_lookback:
            return
        committed = self.loop.consumer.committed(partitions)
        for tp in committed:
            if tp.offset > 0:
                for fid, value in decided(self.settings, tp, self.cfg.dedup_lookback):
                    self.seen[fid] = None
                    value, outcome = self._served(value, tp.partition)
                    if outcome == "served_found":  # it claimed its completion
                        self.seen[served_key(value)] = None
        while len(self.seen) > self.cfg.dedup_ids:
            self.seen.popitem(last=False)

    def _revoked(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.windows.pop((tp.topic, tp.partition), None)
            self.position.pop((tp.topic, tp.partition), None)
            self.served.forget(tp.partition)

    def flush_due(self) -> int:
        """When idle, decide windows that are due in a transaction of their own, offsets included.

        (The loop's idle tick commits no offsets, which would let a crash re-decide them.)
        """
        now = time.monotonic()
        if not any(now - w.opened >= self.cfg.window_seconds for w in self.windows.values()):
            return 0
        self._settle()
        outputs = self._close_due(now)
        if not self.loop.commit(lambda: self.loop.produce(outputs), records=[]):
            return 0  # aborted: the loop rewound and reset the windows (``_reset``)
        self.loop.stats.outputs += len(outputs)
        self._settle()
        return len(outputs)

    def run(self, stopper: Stopper, idle_exit_s: float | None = None) -> Counter[str]:
        """Decide feedback until stopped (or idle for ``idle_exit_s``); returns the counts."""
        idle_since = time.monotonic()
        try:
            while not stopper.stopped:
                if self.loop.run_once() or self.flush_due():
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
        finally:
            self.close()
        return self.counts

    def close(self) -> None:
        try:
            self.loop.close()
        finally:
            if self.watcher is not None:
                self.watcher.close()
            self.served.close()


def served_key(value: dict[str, Any]) -> str:
    """The served completion a feedback names (request id and choice): what it claims once
    it matched that completion, so the completion is trained at most once."""
    choice = str((value.get("metadata") or {}).get("choice", "0"))
    return f"served {value['request_id']} {choice}"


def decided(
    settings: KafkaSettings, committed: TopicPartition, lookback: int
) -> list[tuple[str, dict[str, Any]]]:
    """(feedback id as a dedupe key, in its client's namespace; the record) of the (at most
    ``lookback``) records before a committed offset, in order.

    Every record before the committed offset of a feedback partition is decided (windows close
    in offset order), so these ids are the ones a retry must not bring back.
    """
    start, stop, found = max(0, committed.offset - lookback), committed.offset, []
    decode = events.deserializer(expect="feedback")
    consumer = reader(settings, "feedback-rl-restore")
    try:
        since = [TopicPartition(committed.topic, committed.partition, start)]
        for msg in read_to_end(consumer, since):
            if (msg.offset() or 0) >= stop:
                break
            with contextlib.suppress(events.EventError):
                value = decode(msg.value(), None).record
                found.append(
                    (dedupe_key(client_of_headers(msg.headers()), value["feedback_id"]), value)
                )
        return found
    finally:
        consumer.close()


def run_role(ctx: RoleContext[FeedbackRLConfig]) -> dict[str, int]:
    """The feedback-rl role until stopped; returns its decision counts."""
    role = FeedbackRL(ctx.settings, ctx.run, ctx.cfg, ctx.member, verifier=Verifier.given(ctx.keys))
    return dict(role.run(ctx.stopper))
