"""How rlstream reaches Kafka: one frozen settings model turned into librdkafka configuration.

Fields are snake_case and map to librdkafka's dotted keys (``bootstrap_servers`` ->
``bootstrap.servers``); secrets are ``SecretStr`` so they never print; rare keys pass through
``extra`` unchanged. Nothing connects at import time: a role builds clients from these settings
when it starts. ``from_env`` reads ``RLSTREAM_BOOTSTRAP`` and ``RLSTREAM_KAFKA_*`` variables, so an
existing cluster (Confluent Cloud, MSK, Redpanda, on-prem) is used with configuration only.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

_ENV_PREFIX = "RLSTREAM_KAFKA_"


class KafkaSettings(BaseModel):
    """Connection settings shared by every producer, consumer and admin client of a process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str = Field(description="Comma-separated host:port list of brokers.")
    client_id: str = Field("rlstream", description="Client id prefix seen in broker logs.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = Field(
        None, description="librdkafka security.protocol; None keeps the librdkafka default."
    )
    sasl_mechanism: str | None = Field(None, description="e.g. PLAIN, SCRAM-SHA-512, OAUTHBEARER.")
    sasl_username: str | None = Field(None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(None, description="SASL password (never printed).")
    ssl_ca_location: str | None = Field(None, description="CA bundle for SSL listeners.")
    extra: dict[str, str] = Field(
        default_factory=dict, description="Other librdkafka keys, passed through verbatim."
    )

    def librdkafka(self) -> dict[str, str]:
        """The librdkafka configuration dict for these settings."""
        conf: dict[str, str] = {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": self.client_id,
        }
        for field in ("security_protocol", "sasl_mechanism", "sasl_username", "ssl_ca_location"):
            value = getattr(self, field)
            if value is not None:
                conf[field.replace("_", ".")] = str(value)
        if self.sasl_password is not None:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        conf.update(self.extra)
        return conf

    @classmethod
    def from_env(cls, bootstrap: str | None = None) -> KafkaSettings | None:
        """Settings from ``RLSTREAM_BOOTSTRAP`` and ``RLSTREAM_KAFKA_<FIELD>``; None if unset.

        ``RLSTREAM_KAFKA_EXTRA`` holds ``key=value,key=value`` librdkafka pairs.
        """
        bootstrap = bootstrap or os.environ.get("RLSTREAM_BOOTSTRAP")
        if not bootstrap:
            return None
        fields: dict[str, object] = {"bootstrap_servers": bootstrap}
        for name in cls.model_fields:
            value = os.environ.get(_ENV_PREFIX + name.upper())
            if value is None or name in ("bootstrap_servers", "extra"):
                continue
            fields[name] = value
        extra = os.environ.get(_ENV_PREFIX + "EXTRA", "")
        pairs = [kv.split("=", 1) for kv in extra.split(",") if "=" in kv]
        fields["extra"] = {k.strip(): v.strip() for k, v in pairs}
        return cls.model_validate(fields)
