"""The pure rules of replicated regions and broker faults: how many copies a region keeps, where
a transactional id's coordinator lives, and how a stall is measured."""

from __future__ import annotations

import pytest

from rlstream.ops.chaos.failover import (
    java_hash,
    stalls,
    transaction_partition,
    version_gap_p50,
)
from rlstream.ops.cluster.broker import Region, default_heap, replication
from rlstream.ops.run.regions import RegionsConfig


def test_replication_keeps_three_copies_and_needs_two_once_it_has_three():
    assert replication(1) == (1, 1)
    assert replication(2) == (2, 1)
    assert replication(3) == (3, 2)
    assert replication(5) == (3, 2)
    assert default_heap(1) == "1g" and default_heap(3) == "512m"


def test_java_hash_matches_javas_string_hashcode():
    # values from Java's "...".hashCode()
    assert java_hash("") == 0
    assert java_hash("hello") == 99162322
    assert java_hash("polygenelubricants") == -(2**31)  # Integer.MIN_VALUE
    assert java_hash("é€") == 233 * 31 + 8364
    assert transaction_partition("polygenelubricants") == 0  # Utils.abs(MIN_VALUE) is 0
    assert transaction_partition("hello") == 99162322 % 50


def test_a_stall_is_the_time_to_the_first_version_made_after_the_fault():
    commits = [(1, 10.0), (2, 20.0), (3, 45.0)]
    assert stalls(commits, [12.0, 20.0, 50.0]) == [8.0, 25.0, None]


def test_a_stall_is_read_against_the_median_gap_between_versions():
    assert version_gap_p50([(1, 0.0), (2, 1.0), (3, 4.0), (4, 5.0)]) == 1.0
    assert version_gap_p50([(1, 0.0)]) is None


def test_a_region_state_without_peers_is_one_broker_and_peers_round_trip():
    old = {"name": "t", "home": "/x", "broker_port": 1, "controller_port": 2, "pid": 5}
    region = Region.from_dict(old)
    assert region.brokers == 1 and region.bootstrap == "127.0.0.1:1"
    doc = {**old, "peers": [{"node_id": 2, "broker_port": 3, "controller_port": 4}]}
    two = Region.from_dict(doc)
    assert two.brokers == 2 and two.bootstrap == "127.0.0.1:1,127.0.0.1:3"
    assert Region.from_dict(two.to_dict()) == two
    two.set_pid(2, 9)
    assert two.node(2).pid == 9 and two.node(1).pid == 5
    assert not two.serving()  # no process of ours runs under these pids


def test_recipe_brokers_name_known_regions_within_bounds():
    assert RegionsConfig(rollout=["eu"], brokers={"eu": 3}).brokers == {"eu": 3}
    with pytest.raises(ValueError, match="unknown region"):
        RegionsConfig(brokers={"mars": 3})
    with pytest.raises(ValueError, match="1 to 5"):
        RegionsConfig(brokers={"trainer": 9})
