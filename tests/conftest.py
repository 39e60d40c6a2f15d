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
