"""Shared fixtures: unique names per test, so tests never see each other's topics or groups."""

from __future__ import annotations

import os
import uuid

import pytest


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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order and group the tests for ``pytest -n N --dist loadgroup`` (what ``make test`` runs).

    Every test of the multi-region ``geo`` cluster (three brokers, two MirrorMakers) joins one
    xdist group, so one worker starts that cluster once and runs them all; each other test is
    its own unit of work. Longest first: the geo group, the demo, the other ``slow`` tests,
    then the rest, so the long ones start at once and short ones fill the gaps. Without xdist
    the same order holds and the markers are inert."""

    def rank(item: pytest.Item) -> int:
        if "geo" in getattr(item, "fixturenames", ()):
            return 0
        if item.nodeid.startswith("tests/integration/test_learning.py"):
            return 1
        return 2 if item.get_closest_marker("slow") is not None else 3

    for item in items:
        if rank(item) == 0:
            item.add_marker(pytest.mark.xdist_group("geo"))
    items.sort(key=rank)  # stable: the order within each class is kept
