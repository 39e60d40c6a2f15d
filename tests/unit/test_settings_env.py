"""Kafka settings from the environment: names in any case, and a misspelt or invalid variable
said at once instead of a setting left out silently."""

from __future__ import annotations

import pytest

from rlstream.ops.run.regions import RegionCluster
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import SetupError


def test_protocol_and_mechanism_names_in_any_case() -> None:
    settings = KafkaSettings(
        bootstrap_servers="h:1", security_protocol="sasl_ssl", sasl_mechanism="scram-sha-512"
    )
    assert (settings.security_protocol, settings.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert RegionCluster(bootstrap="h:1", security_protocol=" ssl ").security_protocol == "SSL"


def test_a_misspelt_variable_is_refused_naming_the_known_ones(monkeypatch) -> None:
    monkeypatch.setenv("RLSTREAM_BOOTSTRAP", "h:1")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_USERNAM", "me")
    with pytest.raises(SetupError, match=r"unknown RLSTREAM_KAFKA_SASL_USERNAM: .*SASL_USERNAME"):
        KafkaSettings.from_env()


def test_an_invalid_value_names_its_variable(monkeypatch) -> None:
    monkeypatch.setenv("RLSTREAM_BOOTSTRAP", "h:1")
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "tls")
    with pytest.raises(SetupError, match="RLSTREAM_KAFKA_SECURITY_PROTOCOL: Input should be"):
        KafkaSettings.from_env()
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "sasl_plaintext")
    settings = KafkaSettings.from_env()
    assert settings is not None and settings.security_protocol == "SASL_PLAINTEXT"
