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
    """Tests that leave several brokers running until the session ends go last: those of the
    multi-region ``geo`` cluster (three brokers, two MirrorMakers) and the demo, which adds a
    region to the session's cluster. Everything else then runs beside one broker only.

    With ``pytest -n N --dist loadgroup`` every test of the ``geo`` cluster joins one xdist
    group, so one worker starts that cluster once and runs them all; without xdist the marker
    is inert."""

    def heavy(item: pytest.Item) -> int:
        fixtures = getattr(item, "fixturenames", ())
        if "geo" in fixtures:
            return 2
        return 1 if item.nodeid.startswith("tests/integration/test_learning.py") else 0

    for item in items:
        if heavy(item) == 2:
            item.add_marker(pytest.mark.xdist_group("geo"))
    items.sort(key=heavy)  # stable: the order within each class is kept
