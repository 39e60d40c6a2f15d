"""Shared fixtures: unique names per test, so tests never see each other's topics or groups."""

from __future__ import annotations

import os
import uuid

import pytest

#: The suite's brokers and MirrorMakers live minutes and carry little traffic: the serial
#: collector and the client compiler alone (``ops.cluster.artifacts.jvm_performance_options``)
#: spend about a quarter less CPU than the launcher's defaults, at start and under the suite's
#: traffic, on 2 cores that every test shares. Roles and benchmarks the tests start inherit it.
os.environ.setdefault(
    "KAFKA_JVM_PERFORMANCE_OPTS",
    "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:MaxDirectMemorySize=256m",
)


@pytest.fixture
def unique_run(request: pytest.FixtureRequest) -> str:
    """A Kafka-legal run name unique to this test."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:24].strip("-")
    return f"t-{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _results_elsewhere(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Benchmarks run by tests keep their results in a temporary folder, never in the
    repository's ``results/`` (which holds measured runs only)."""
    if "RLSTREAM_RESULTS" not in os.environ:
        monkeypatch.setenv("RLSTREAM_RESULTS", str(tmp_path_factory.getbasetemp() / "results"))


#: Besides the ``geo`` tests, the longest whole-pipeline runs with deadlines (the demo must reach
#: its versions in time; chaos and the pipeline kill roles and a broker): under pytest-xdist they
#: share the ``geo`` tests' worker, one after the other, so none of them competes with another
#: for the cores. The other workers take everything else (about as long in all, on 2 cores).
HEAVY = (
    "tests/integration/test_learning.py",
    "tests/integration/test_bench_chaos.py",
    "tests/integration/test_pipeline.py",
    "tests/integration/test_replicated.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that leave several brokers running until the session ends go last: those of the
    multi-region ``geo`` cluster (three brokers, two MirrorMakers) and the demo, which adds a
    region to the session's cluster. Everything else then runs beside one broker only.

    Under ``pytest -n N --dist loadgroup`` (``make test``) the ``geo`` tests and the other
    whole-pipeline tests (``HEAVY``) form one xdist group: one worker runs them in that order
    (it starts the ``geo`` cluster once), the others share the rest. xdist hands out the
    largest group first, so the longest queue starts at once. Without xdist the marker is
    inert."""

    def heavy(item: pytest.Item) -> int:
        fixtures = getattr(item, "fixturenames", ())
        if "geo" in fixtures:
            return 2
        return 1 if item.nodeid.startswith("tests/integration/test_learning.py") else 0

    for item in items:
        if heavy(item) == 2 or item.nodeid.startswith(HEAVY):
            item.add_marker(pytest.mark.xdist_group("heavy"))
    items.sort(key=heavy)  # stable: the order within each class is kept
