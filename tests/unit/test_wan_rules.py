"""The WAN link's rules (ops.cluster.wan): what a trainer broker advertises to a linked region,
how the link's MirrorMakers reach the other region (each flow runs where it writes), and the
toxics a link spec becomes."""

from __future__ import annotations

import pytest

from rlstream.ops.cluster import broker, wan
from rlstream.ops.cluster.broker import Node, Region
from rlstream.ops.cluster.mirror import link_flows, mm2_properties
from rlstream.schemas.errors import SetupError


def _props(text: str, sep: str) -> dict[str, str]:
    pairs = (line.split(sep, 1) for line in text.splitlines() if sep in line)
    return {k.strip(): v.strip() for k, v in pairs}


def _trainer() -> Region:
    region = Region("trainer", "/tmp/x", 9000, 9001, peers=[Node(2, 9010, 9011)])
    region.links["eu-west"] = [[9100, 9200], [9110, 9210]]
    return region


def test_a_trainer_broker_advertises_the_link_address_on_the_link_listener_only() -> None:
    region = _trainer()
    for index, node in enumerate(region.nodes()):
        props = _props(broker._properties(region, node), "=")
        listen, proxy = region.links["eu-west"][index]
        assert f"LINK_EU_WEST://127.0.0.1:{listen}" in props["listeners"].split(",")
        advertised = props["advertised.listeners"].split(",")
        assert f"LINK_EU_WEST://127.0.0.1:{proxy}" in advertised
        assert f"PLAINTEXT://127.0.0.1:{node.broker_port}" in advertised  # local clients direct
        assert "LINK_EU_WEST:PLAINTEXT" in props["listener.security.protocol.map"].split(",")
        assert props["inter.broker.listener.name"] == "PLAINTEXT"  # replication stays local


def test_the_links_mirrormaker_reaches_the_trainer_region_through_the_link() -> None:
    trainer = _trainer()
    regions = {"trainer": trainer, "eu-west": Region("eu-west", "/tmp/x", 9300, 9301)}
    via = {"trainer": trainer.link_bootstrap("eu-west")}
    props = _props(mm2_properties(link_flows("trainer", "eu-west"), regions, via=via), " = ")
    assert props["trainer.bootstrap.servers"] == "127.0.0.1:9200,127.0.0.1:9210"
    assert props["eu-west.bootstrap.servers"] == "127.0.0.1:9300"


def test_across_a_wan_each_flow_runs_in_the_region_it_writes_to(tmp_path) -> None:
    from rlstream.ops import cluster

    trainer = _trainer()
    eu = Region("eu-west", "/tmp/x", 9300, 9301)
    eu.links["trainer"] = [[9400, 9500]]
    state = cluster.Cluster(home=tmp_path, regions={"trainer": trainer, "eu-west": eu})
    (out_name, out_flows, out_via, out_targets), (home_name, home_flows, home_via, home_targets) = (
        cluster._link_processes(state, "eu-west")
    )
    assert (out_name, [f.dst for f in out_flows], out_targets) == (
        "eu-west",
        ["eu-west"],
        ["eu-west"],
    )
    assert out_via == {"trainer": "127.0.0.1:9200,127.0.0.1:9210"}  # fetches the trainer's remotely
    assert (home_name, [f.dst for f in home_flows]) == ("eu-west-home", ["trainer"])
    assert home_targets == ["trainer"] and home_via == {"eu-west": "127.0.0.1:9500"}
    eu.links.clear()  # a region that predates the way back: one process, both flows, as before
    ((name, flows, via, targets),) = cluster._link_processes(state, "eu-west")
    assert (name, len(flows), targets) == ("eu-west", 2, []) and via == out_via
    trainer.links.clear()  # no WAN: one process, both flows, each region reached directly
    ((name, flows, via, targets),) = cluster._link_processes(state, "eu-west")
    assert (name, len(flows), via, targets) == ("eu-west", 2, {}, [])


def test_a_spec_becomes_half_the_round_trip_each_way_and_a_rate_in_kilobytes() -> None:
    toxics = wan._toxics(wan.LinkSpec(rtt_ms=150, mbit=100))
    assert {t["stream"] for t in toxics.values()} == {"upstream", "downstream"}
    latency = [t for t in toxics.values() if t["type"] == "latency"]
    assert [t["attributes"]["latency"] for t in latency] == [75, 75]
    rates = [t["attributes"]["rate"] for t in toxics.values() if t["type"] == "bandwidth"]
    assert rates == [12_500, 12_500]  # 100 Mbit/s = 12,500 KB/s
    assert all(t["type"] == "latency" for t in wan._toxics(wan.LinkSpec(40)).values())


def test_bad_specs_and_secured_links_are_refused() -> None:
    with pytest.raises(ValueError, match="round trip"):
        wan.LinkSpec(rtt_ms=-1)
    with pytest.raises(ValueError, match="rate"):
        wan.LinkSpec(rtt_ms=40, mbit=0)
    secured = Region("trainer", "/tmp/x", 9000, 9001, secure=True)
    with pytest.raises(SetupError, match="secured"):
        secured.add_link("eu")


def test_listener_names_are_what_kafka_accepts() -> None:
    assert wan.listener_name("eu") == "LINK_EU"
    assert wan.listener_name("us-east_1") == "LINK_US_EAST_1"
