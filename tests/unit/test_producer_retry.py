"""Retriable errors of transactional calls are retried; others are not."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from rlstream.producers.client import producer as p


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


class _TxnClient:
    """The calls ``EventProducer.transaction`` makes on the wrapped client, recorded."""

    def __init__(self, commit_error: KafkaError | None = None) -> None:
        self.calls: list[str] = []
        self.commit_error = commit_error

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def commit_transaction(self, _timeout: float) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise KafkaException(self.commit_error)

    def abort_transaction(self, _timeout: float) -> None:
        self.calls.append("abort")
        raise KafkaException(KafkaError(KafkaError._STATE, "abort failed too"))


@pytest.mark.parametrize(
    ("commit_error", "aborted"),
    [
        (KafkaError(KafkaError._FENCED, "fenced", fatal=True), False),  # the role must exit
        (KafkaError(KafkaError._MSG_TIMED_OUT, "not delivered"), True),  # never left open
    ],
)
def test_a_failed_commit_leaves_no_transaction_open_unless_fatal(
    commit_error: KafkaError, aborted: bool
) -> None:
    client = _TxnClient(commit_error)
    producer = p.EventProducer(client)  # type: ignore[arg-type]
    with pytest.raises(KafkaException) as raised, producer.transaction():
        pass
    assert raised.value.args[0].code() == commit_error.code()  # the first error, not the abort's
    assert client.calls == ["begin", "commit", *(["abort"] if aborted else [])]
