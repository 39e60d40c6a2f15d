"""A supervised role's transactional call that blocks past its limit raises ``HungCall`` at the
limit (the call is left in its thread), so the producer can be replaced
(``KafkaSettings.hung_call_exit_s``, ``producers.client.producer.retry_retriable``); without the
limit nothing is cut. The replacement itself, on a real broker: tests/integration/test_hung_producer.py."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import time
from rlstream.producers.client import producer as p
def blocked():
    time.sleep({block})
    return "returned"
started = time.monotonic()
try:
    print(p.retry_retriable(blocked, "send offsets", {limit}))
except p.HungCall as exc:
    print(f"hung: {{exc}} after {{time.monotonic() - started:.1f}}")
"""


def _run(limit: str, block: float) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(limit=limit, block=block)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_hung_call_raises_at_its_limit() -> None:
    hung = _run("0.2", 30)
    assert hung.returncode == 0, hung
    words = hung.stdout.split()
    assert hung.stdout.startswith("hung: send offsets blocked for 0.2s") and float(words[-1]) < 5


def test_a_call_that_returns_in_time_or_no_limit_changes_nothing() -> None:
    assert _run("5", 0.1).stdout.strip() == "returned"
    assert _run("None", 0.5).stdout.strip() == "returned"


RETRIED = """
import time
from confluent_kafka import KafkaError, KafkaException
from rlstream.producers.client import producer as p
calls = []
def slow_then_done():
    calls.append(1)
    time.sleep(0.4)  # each attempt returns within the limit; all of them together do not
    if len(calls) < 3:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True))
    return "done"
print(p.retry_retriable(slow_then_done, "send offsets", 0.6), len(calls))
"""


def test_the_limit_is_per_call_so_a_retried_timeout_is_not_a_hang() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RETRIED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done
    assert done.stdout.split() == ["done", "3"]


def test_the_limit_travels_with_the_settings() -> None:
    from rlstream.producers.client.producer import EventProducer
    from rlstream.producers.client.settings import KafkaSettings

    settings = KafkaSettings(bootstrap_servers="127.0.0.1:1", hung_call_exit_s=30)
    assert "hung_call_exit_s" not in str(settings.librdkafka())
    with_limit = EventProducer.connect(settings)
    assert with_limit._hung_after == 30
    assert EventProducer.connect(KafkaSettings(bootstrap_servers="127.0.0.1:1"))._hung_after is None
