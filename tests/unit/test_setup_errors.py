"""Kafka set-up failures are one line with the cause and the fix, and a local region asked for a
broker count it was not created with is refused, naming both, instead of reused silently."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from rlstream.ops import cluster
from rlstream.ops.cluster import broker
from rlstream.producers.client.admin import admin_client, apply_topics, setup_error
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import SetupError


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (KafkaError._TRANSPORT, "no Kafka answers at h:1"),
        (KafkaError._ALL_BROKERS_DOWN, "is the cluster up"),
        (KafkaError.SASL_AUTHENTICATION_FAILED, "refused this client's login"),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, "may not create or describe"),
        (KafkaError.POLICY_VIOLATION, "the cluster's limits refuse"),
    ],
)
def test_a_cluster_that_cannot_be_used_says_why_and_what_to_do(code: int, says: str) -> None:
    made = setup_error(KafkaException(KafkaError(code, "said by the broker")), "h:1", "doing it")
    assert isinstance(made, SetupError) and says in str(made)
    assert "said by the broker" in str(made)


def test_other_kafka_errors_are_left_as_they_are() -> None:
    exc = KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
    assert setup_error(exc, "h:1", "x") is exc


def test_making_topics_on_an_unreachable_cluster_is_a_setup_error() -> None:
    settings = KafkaSettings(bootstrap_servers="127.0.0.1:1")
    with pytest.raises(SetupError, match=r"no Kafka answers at 127\.0\.0\.1:1 \(making the run"):
        apply_topics(admin_client(settings), [], timeout=2, where="127.0.0.1:1")


def test_a_region_keeps_its_brokers_and_another_count_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    state = cluster.load(home)
    state.regions["trainer"] = broker.new_region("trainer", home, False, 1)
    state.trainer = "trainer"
    state.save()
    with pytest.raises(SetupError, match=r"created with 1 broker\(s\), not the 3 asked"):
        cluster.up(["trainer"], home=home, brokers=3, log=lambda *_: None)
    with pytest.raises(SetupError, match="not the 3 asked"):
        cluster.up(["trainer"], home=home, brokers={"trainer": 3}, log=lambda *_: None)
