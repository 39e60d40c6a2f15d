"""The brokers of the integration and system tiers: one real Kafka per test session (per xdist
worker), and the three-region ``geo`` cluster for the tests that ask for it.

``RLSTREAM_BOOTSTRAP`` points the suite at an existing cluster; ``RLSTREAM_TESTCONTAINERS=1``
runs testcontainers' Kafka (needs a Docker engine); otherwise the project's own launcher starts
a broker in a temporary state directory and stops exactly that broker, by pid, when the session
ends. Every test makes its own uniquely named topics and groups.

``RLSTREAM_SECURE=1`` starts that broker secured (``cluster up --secure``: SASL/SCRAM over TLS,
ACLs enforced) and ``kafka`` is then ``admin``'s settings, so tests that talk to the broker as
admin run unchanged. Tests marked ``unsecured_only(reason)`` are skipped then: they need a
plaintext address (kcat, a worker given a bare bootstrap). The ``geo`` fixture's regions are
unsecured; secured regions and links have their own tests (``test_secure_geo``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import GEO_RTT_MS

from rlstream.producers.client.settings import KafkaSettings

SECURE = os.environ.get("RLSTREAM_SECURE") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "unsecured_only(reason): skipped when RLSTREAM_SECURE=1 secures the broker"
    )


@pytest.fixture(scope="session")
def cluster_home() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rlstream-it-") as tmp:
        yield Path(tmp) / "cluster"


@pytest.fixture(scope="session")
def kafka(cluster_home: Path) -> Iterator[KafkaSettings]:
    """Settings for the session's broker (region ``trainer``)."""
    from rlstream.producers.client.admin import ensure_cluster_topics

    external = KafkaSettings.from_env()
    if external is not None:
        ensure_cluster_topics(external)
        yield external
        return
    if os.environ.get("RLSTREAM_TESTCONTAINERS") == "1":
        yield from _testcontainers_kafka(ensure_cluster_topics)
        return
    from rlstream.ops import cluster

    try:
        state = cluster.up(
            ["trainer"],
            home=cluster_home,
            heap="768m",
            log=lambda *_: None,
            secure=True if SECURE else None,
        )
        settings = state.settings("trainer")  # admin's SASL/TLS settings when secured
        ensure_cluster_topics(settings)
        yield settings
    finally:
        cluster.down(home=cluster_home, purge=True, log=lambda *_: None)


@pytest.fixture(scope="session")
def geo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local multi-region cluster for the session: ``trainer``, ``eu`` and ``us``, one KRaft
    node each, and one MirrorMaker 2 per rollout region's link, each link a WAN of
    ``GEO_RTT_MS`` round trip (``ops.cluster.wan``). Tests that kill a broker or a
    MirrorMaker bring it back with ``cluster.up`` before they end; everything is stopped by pid
    when the session ends."""
    if KafkaSettings.from_env() is not None:
        pytest.skip("needs the local launcher to start several regions")
    if SECURE:
        pytest.skip(
            "RLSTREAM_SECURE: the geo tests reach their regions with bare bootstraps; secured "
            "regions and MirrorMaker 2 links are covered by test_secure_geo"
        )
    from rlstream.ops import cluster

    home = tmp_path_factory.mktemp("geo") / "cluster"
    _GEO_HOMES.append(home)
    try:  # a region that fails to start must not leave the others running
        yield cluster.up(
            ["trainer", "eu", "us"],
            home=home,
            heap="384m",
            log=lambda *_: None,
            link=cluster.LinkSpec(rtt_ms=GEO_RTT_MS),
        )
    finally:
        cluster.down(home=home, purge=True, log=lambda *_: None)


#: The ``geo`` cluster's home once started, and the session's last test that uses it.
_GEO_HOMES: list[Path] = []
_LAST_GEO: list[str] = []


def _uses_geo(item: pytest.Item | None) -> bool:
    return item is not None and "geo" in getattr(item, "fixturenames", ())


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the ``geo`` cluster's brokers and MirrorMakers right after the session's last test
    that uses it (the geo tests run last and together: see tests/conftest.py) instead of at the
    session's end: idle, its five JVMs took most of a core on 2 cores from the tests still
    running. The fixture's own teardown then only purges the data."""
    if _GEO_HOMES and [item.nodeid] == _LAST_GEO and not _uses_geo(nextitem):
        from rlstream.ops import cluster

        cluster.down(home=_GEO_HOMES[-1], log=lambda *_: None)


def _testcontainers_kafka(ensure_cluster_topics) -> Iterator[KafkaSettings]:
    from testcontainers.kafka import KafkaContainer

    with KafkaContainer().with_kraft() as container:
        settings = KafkaSettings(bootstrap_servers=container.get_bootstrap_server())
        ensure_cluster_topics(settings)
        yield settings


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # runs after tests/conftest.py's hook (tryfirst) has put the geo tests last
    _LAST_GEO[:] = [i.nodeid for i in items if _uses_geo(i)][-1:]
    for item in items:
        unsecured = item.get_closest_marker("unsecured_only")
        if SECURE and unsecured is not None:
            reason = unsecured.args[0] if unsecured.args else "needs an unsecured broker"
            item.add_marker(pytest.mark.skip(reason=f"RLSTREAM_SECURE: {reason}"))


@pytest.fixture
def bootstrap(kafka: KafkaSettings) -> str:
    return kafka.bootstrap_servers
