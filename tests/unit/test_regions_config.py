"""Regions in the run recipe and the MirrorMaker 2 configuration derived from the catalog.

Properties asserted: a link's flows are the catalog's directions (nothing typed by hand); the
MirrorMaker config reads ``read_committed`` from every cluster and writes with exactly-once
support; the recipe's regions validate, reach external clusters with their own credentials and
keep secrets out of the recipe.
"""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from rlstream.ops.cluster.broker import Region
from rlstream.ops.cluster.mirror import link_flows, mm2_properties
from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.regions import RegionsConfig
from rlstream.schemas import topics


def _props(text: str) -> dict[str, str]:
    pairs = (line.split(" = ", 1) for line in text.splitlines() if " = " in line)
    return {k.strip(): v.strip() for k, v in pairs}


def test_a_link_mirrors_what_the_catalog_says_and_only_committed_data() -> None:
    flows = link_flows("trainer", "eu")
    regions = {n: Region(n, "/tmp/x", p, p + 1) for n, p in (("trainer", 9000), ("eu", 9100))}
    props = _props(mm2_properties(flows, regions))
    assert props["clusters"] == "eu, trainer"
    assert props["trainer->eu.enabled"] == props["eu->trainer.enabled"] == "true"
    out = re.compile(props["trainer->eu.topics"]).fullmatch
    home = re.compile(props["eu->trainer.topics"]).fullmatch
    for stream, spec in topics.STREAMS.items():
        name = topics.topic_name("r1", stream)
        assert bool(out(name)) == (spec.mirror == "outward"), stream
        assert bool(home(name)) == (spec.mirror == "inward"), stream
    for cluster in ("trainer", "eu"):
        assert props[f"{cluster}.consumer.isolation.level"] == "read_committed"
        assert props[f"{cluster}.exactly.once.source.support"] == "enabled"
    assert props["eu.bootstrap.servers"] == "127.0.0.1:9100"


def test_regions_in_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config(None, ['regions.rollout=["eu", "us"]'])
    assert cfg.regions.topology() == topics.Regions("trainer", ("eu", "us"))
    assert load_run_config(None).regions.topology() == topics.Regions("trainer", ())
    with pytest.raises(ValidationError, match="distinct"):
        RegionsConfig(trainer="eu", rollout=["eu"])
    with pytest.raises(ValidationError, match="invalid region name"):
        RegionsConfig(rollout=["e.u"])
    with pytest.raises(ValidationError, match="unknown region"):
        RegionsConfig(rollout=["eu"], clusters={"us": {"bootstrap": "h:1"}})
    with pytest.raises(ValidationError, match="extra"):
        RegionsConfig.model_validate({"rollout": ["eu"], "mirror": "x"})


def test_an_external_region_uses_its_own_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RegionsConfig.model_validate(
        {
            "rollout": ["us"],
            "clusters": {
                "us": {
                    "bootstrap": "broker.us:9092",
                    "security_protocol": "SASL_SSL",
                    "sasl_mechanism": "SCRAM-SHA-512",
                    "sasl_username": "rl-us",
                    "sasl_password_env": "RL_TEST_US_PASSWORD",
                }
            },
        }
    )
    monkeypatch.delenv("RL_TEST_US_PASSWORD", raising=False)
    with pytest.raises(SystemExit, match="RL_TEST_US_PASSWORD"):
        cfg.settings("us")
    monkeypatch.setenv("RL_TEST_US_PASSWORD", "s3cret")
    conf = cfg.settings("us").librdkafka()
    assert conf["bootstrap.servers"] == "broker.us:9092" and conf["sasl.password"] == "s3cret"
    assert conf["sasl.username"] == "rl-us" and conf["security.protocol"] == "SASL_SSL"
    assert "s3cret" not in cfg.model_dump_json()  # the run manifest never holds the secret
    with pytest.raises(ValueError, match="not one of the run's regions"):
        cfg.settings("asia")
