"""How rlstream reaches Kafka: one frozen settings model turned into librdkafka configuration.

Fields are snake_case and map to librdkafka's dotted keys (``bootstrap_servers`` ->
``bootstrap.servers``); secrets are ``SecretStr`` so they never print; rare keys pass through
``extra`` unchanged. Nothing connects at import time: a role builds clients from these settings
when it starts. ``from_env`` reads ``RLSTREAM_BOOTSTRAP`` and ``RLSTREAM_KAFKA_*`` variables, so an
existing cluster (Confluent Cloud, MSK, Redpanda, on-prem) is used with configuration only.

librdkafka's own log lines (a refused connection, ``BGQUEUE``, ``GETPID`` ...) never go to the
process's stderr on their own: every client made from these settings hands them to the Python
logger ``LIBRDKAFKA_LOGGER`` (confluent-kafka's ``logger`` setting; they are delivered while
the client polls). A role sends that logger to its log (``ops.run.roles``), ``rlstream demo`` to
a file beside the role logs (``log_librdkafka_to``); with no handler, only warnings and errors
reach stderr, through Python's last-resort handler.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from rlstream.schemas.errors import SetupError

_ENV_PREFIX = "RLSTREAM_KAFKA_"
#: The Python logger librdkafka's log lines go to (from every client made from ``KafkaSettings``).
LIBRDKAFKA_LOGGER: Final = "rlstream.librdkafka"


def log_librdkafka_to(handler: logging.Handler, level: int = logging.INFO) -> None:
    """Send librdkafka's log lines at ``level`` and above to ``handler`` only (not to the
    process's other handlers: a command's progress lines stay its own)."""
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s librdkafka %(message)s"))
    log = logging.getLogger(LIBRDKAFKA_LOGGER)
    for old in log.handlers[:]:
        log.removeHandler(old)
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def capitals(value: Any) -> Any:
    """librdkafka's protocol and mechanism names are capitals: ``sasl_ssl`` is ``SASL_SSL``."""
    return value.strip().upper() if isinstance(value, str) else value


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
    hung_call_exit_s: float | None = Field(
        None,
        description="A supervised role's transactional call that blocks longer than this is left "
        "behind and its producer replaced in the process (the stuck one fenced, its "
        "transaction aborted); None: never (see producers.client.producer).",
    )

    _capitals = field_validator("security_protocol", "sasl_mechanism", mode="before")(capitals)

    def librdkafka(self) -> dict[str, Any]:
        """The configuration of a confluent-kafka client for these settings: librdkafka's keys,
        and ``logger`` (``LIBRDKAFKA_LOGGER``: see the module docstring)."""
        conf: dict[str, Any] = {
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
        conf["logger"] = logging.getLogger(LIBRDKAFKA_LOGGER)
        return conf

    @classmethod
    def from_env(cls, bootstrap: str | None = None) -> KafkaSettings | None:
        """Settings from ``RLSTREAM_BOOTSTRAP`` and ``RLSTREAM_KAFKA_<FIELD>``; None if unset.

        ``RLSTREAM_KAFKA_EXTRA`` holds ``key=value,key=value`` librdkafka pairs.
        """
        bootstrap = bootstrap or os.environ.get("RLSTREAM_BOOTSTRAP")
        if not bootstrap:
            return None
        known = {_ENV_PREFIX + n.upper() for n in cls.model_fields if n != "bootstrap_servers"}
        unknown = sorted(k for k in os.environ if k.startswith(_ENV_PREFIX) and k not in known)
        if unknown:  # a misspelt variable would leave its setting out, silently
            raise SetupError(
                f"unknown {', '.join(unknown)}: the Kafka settings from the environment are "
                f"{', '.join(sorted(known))}"
            )
        fields: dict[str, object] = {"bootstrap_servers": bootstrap}
        for name in cls.model_fields:
            value = os.environ.get(_ENV_PREFIX + name.upper())
            if value is None or name in ("bootstrap_servers", "extra"):
                continue
            fields[name] = value
        extra = os.environ.get(_ENV_PREFIX + "EXTRA", "")
        pairs = [kv.split("=", 1) for kv in extra.split(",") if "=" in kv]
        fields["extra"] = {k.strip(): v.strip() for k, v in pairs}
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            why = "; ".join(
                f"{_ENV_PREFIX}{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
                for e in exc.errors()
            )
            raise SetupError(f"the Kafka settings from the environment: {why}") from None
