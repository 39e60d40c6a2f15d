"""Pure rules of ``consumers.read_to_end``: which metadata failures are asked again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from rlstream.consumers.read_to_end import partitions_of


class _Consumer:
    """Answers ``list_topics`` with the given failures first, then with two partitions."""

    def __init__(self, *failures: int) -> None:
        self.failures = list(failures)
        self.calls = 0

    def list_topics(self, topic: str, timeout: float) -> Any:
        self.calls += 1
        if self.failures:
            raise KafkaException(KafkaError(self.failures.pop(0)))
        meta = SimpleNamespace(error=None, partitions={1: None, 0: None})
        return SimpleNamespace(topics={topic: meta})


def test_a_metadata_request_timed_out_during_a_failover_is_asked_again() -> None:
    consumer = _Consumer(KafkaError._TIMED_OUT, KafkaError._TRANSPORT)
    assert partitions_of(consumer, "t") == [0, 1]  # type: ignore[arg-type]
    assert consumer.calls == 3


class _NewTopic:
    """Answers ``list_topics`` with the topic carrying ``errors`` first (as a broker does for a
    topic created a moment ago), then with one partition."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.calls = 0

    def list_topics(self, topic: str, timeout: float) -> Any:
        self.calls += 1
        error = KafkaError(self.errors.pop(0)) if self.errors else None
        meta = SimpleNamespace(error=error, partitions={0: None})
        return SimpleNamespace(topics={topic: meta})


def test_a_topic_whose_leaders_are_not_known_yet_is_asked_again() -> None:
    consumer = _NewTopic(KafkaError.LEADER_NOT_AVAILABLE, KafkaError.LEADER_NOT_AVAILABLE)
    assert partitions_of(consumer, "t") == [0]  # type: ignore[arg-type]
    assert consumer.calls == 3


def test_an_unknown_topic_is_none_at_once() -> None:
    consumer = _NewTopic(KafkaError.UNKNOWN_TOPIC_OR_PART)
    assert partitions_of(consumer, "t") is None  # type: ignore[arg-type]
    assert consumer.calls == 1


def test_a_lasting_error_is_raised_at_once() -> None:
    consumer = _Consumer(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        partitions_of(consumer, "t")  # type: ignore[arg-type]
    assert consumer.calls == 1


def test_a_new_leader_still_catching_up_is_waited_for() -> None:
    """OFFSET_NOT_AVAILABLE (a leader whose high watermark has not caught up, just after a
    failover) is retried like a leader election, not raised at once."""
    from rlstream.consumers.read_to_end import retrying

    answers = [KafkaException(KafkaError(KafkaError.OFFSET_NOT_AVAILABLE)), (0, 5)]

    def call() -> tuple[int, int]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retrying(call, timeout=5) == (0, 5)
    with pytest.raises(KafkaException):
        retrying(
            lambda: (_ for _ in ()).throw(KafkaException(KafkaError(KafkaError.INVALID_CONFIG)))
        )
