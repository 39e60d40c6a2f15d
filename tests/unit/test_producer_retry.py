"""Retriable errors of transactional calls are retried; others are not."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from rlstream.producers import producer as p


def _failing(errors: list[KafkaError]):
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise KafkaException(errors[len(calls) - 1])
        return "committed"

    return call, calls


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p.time, "sleep", lambda _s: None)


def test_a_retriable_commit_timeout_is_retried() -> None:
    timeout = KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)
    call, calls = _failing([timeout, timeout])
    assert p.retry_retriable(call, "commit") == "committed" and len(calls) == 3


def test_retries_are_bounded() -> None:
    timeout = KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)
    call, calls = _failing([timeout] * 10)
    with pytest.raises(KafkaException):
        p.retry_retriable(call, "commit")
    assert len(calls) == p.RETRIES


@pytest.mark.parametrize(
    "error",
    [
        KafkaError(KafkaError._FENCED, "fenced", fatal=True),
        KafkaError(KafkaError._TIMED_OUT, "must abort", retriable=True, txn_requires_abort=True),
    ],
)
def test_fatal_and_abortable_errors_are_not_retried(error: KafkaError) -> None:
    call, calls = _failing([error])
    with pytest.raises(KafkaException):
        p.retry_retriable(call, "commit")
    assert len(calls) == 1
