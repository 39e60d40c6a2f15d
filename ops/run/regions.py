"""A run's regions in its recipe: which region trains, which roll out, and how each is reached.

```toml
[regions]
trainer = "trainer"          # hosts scheduler, admission, judges, learner
rollout = ["eu", "us"]       # host rollout workers; tasks and weights flow out, trajectories home

[regions.clusters.us]        # an existing cluster; a region without an entry is the local one
bootstrap = "broker.us.example:9092"
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "rl-us"
sasl_password_env = "RL_US_PASSWORD"   # the secret stays in the environment, out of the manifest
```

Rules:
- a role runs in one region (``--region``, default the trainer region) and talks to that region's
  cluster only: ``--bootstrap`` / ``RLSTREAM_BOOTSTRAP`` when given, else the recipe's entry for
  the region, else the local cluster's region of that name (``rlstream cluster up``);
- the topology (``topics.Regions``) is derived from the recipe, so every role of a run agrees on
  which copies of a stream it reads and where the scheduler sends tasks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from rlstream.producers.client.settings import KafkaSettings, capitals
from rlstream.schemas import topics
from rlstream.schemas.derive import LOCAL


class RegionCluster(BaseModel):
    """How to reach one region's existing Kafka cluster, with its own credentials."""

    model_config = ConfigDict(extra="forbid")

    bootstrap: str = Field(min_length=1, description="Bootstrap servers (host:port,...).")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = Field(
        None, description="librdkafka security.protocol; None keeps the librdkafka default."
    )
    sasl_mechanism: str | None = Field(None, description="e.g. PLAIN, SCRAM-SHA-512.")
    sasl_username: str | None = Field(
        None,
        description="SASL user name; `{role}` in it is replaced by the connecting role's name "
        "(`admin` for the operator's tools), so each role can be its own principal.",
    )
    sasl_password_env: str | None = Field(
        None,
        description="Environment variable holding the SASL password (never in the recipe); "
        "`{ROLE}` in it is replaced by the role's name in capitals, `-` as `_`.",
    )
    ssl_ca_location: str | None = Field(None, description="CA bundle for SSL listeners.")
    extra: dict[str, str] = Field(
        default_factory=dict, description="Other librdkafka keys, passed through verbatim."
    )

    _capitals = field_validator("security_protocol", "sasl_mechanism", mode="before")(capitals)

    def settings(self, user: str = "admin") -> KafkaSettings:
        """How ``user`` (a role's name, or ``admin``) connects: the entry's credentials, with
        ``{role}`` / ``{ROLE}`` filled in."""
        password = None
        if self.sasl_password_env:
            variable = self.sasl_password_env.replace("{ROLE}", user.upper().replace("-", "_"))
            value = os.environ.get(variable)
            if value is None:
                raise SystemExit(f"error: ${variable} (SASL password of {user}) is not set")
            password = SecretStr(value)
        username = self.sasl_username.replace("{role}", user) if self.sasl_username else None
        return KafkaSettings(
            bootstrap_servers=self.bootstrap,
            security_protocol=self.security_protocol,
            sasl_mechanism=self.sasl_mechanism,
            sasl_username=username,
            sasl_password=password,
            ssl_ca_location=self.ssl_ca_location,
            extra=self.extra,
        )


class RegionsConfig(BaseModel):
    """The run's regions (see the module docstring); one region, ``trainer``, by default."""

    model_config = ConfigDict(extra="forbid")

    trainer: str = Field(
        "trainer", description="Region of scheduler, admission, judges and learner."
    )
    rollout: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Rollout regions: the scheduler sends tasks there (to the trainer region "
        "when empty); each is linked to the trainer region by MirrorMaker 2.",
    )
    clusters: dict[str, RegionCluster] = Field(
        default_factory=dict,
        description="Existing clusters by region; a region without one is the local cluster's.",
        json_schema_extra=LOCAL,
    )
    brokers: dict[str, int] = Field(
        default_factory=dict,
        description="Brokers of a local region when it is first started (1 when not named); 3 "
        "keeps 3 copies of every topic with min.insync.replicas=2, surviving one broker's loss.",
    )

    @model_validator(mode="after")
    def _check(self) -> RegionsConfig:
        topology = self.topology()  # validates names and distinctness
        for field in ("clusters", "brokers"):
            unknown = sorted(set(getattr(self, field)) - set(topology.names))
            if unknown:
                raise ValueError(f"regions.{field} names unknown region(s) {unknown}")
        bad = {r: n for r, n in self.brokers.items() if not 1 <= n <= 5}
        if bad:
            raise ValueError(f"regions.brokers must be 1 to 5 per region, not {bad}")
        return self

    def topology(self) -> topics.Regions:
        return topics.Regions(self.trainer, tuple(self.rollout))

    def settings(self, region: str, home: str | None = None, user: str = "admin") -> KafkaSettings:
        """How a role in ``region`` reaches its cluster: the recipe's entry, else the local
        cluster's region (as ``user`` when it is secured)."""
        self.topology().check(region)
        if region in self.clusters:
            return self.clusters[region].settings(user)
        return local_settings(region, home, user)


def local_settings(region: str, home: str | None = None, user: str = "admin") -> KafkaSettings:
    """Settings for the local cluster's ``region`` (as ``user`` when it is secured: a role's
    user, or ``admin`` for the operator's tools); exits with a hint when it is not running."""
    from rlstream.ops import cluster

    state = cluster.load(None if home is None else Path(home))
    if region not in state.running_regions():
        raise SystemExit(
            f"error: no Kafka to talk to: region {region!r} of the local cluster at {state.home} "
            f"is not running. Start it with `rlstream cluster up --regions {region}`, or give "
            f"--bootstrap / RLSTREAM_BOOTSTRAP for an existing cluster."
        )
    try:
        return state.settings(region, user)
    except KeyError as exc:  # a secured cluster without this user's credentials
        raise SystemExit(f"error: {exc.args[0]}") from None
