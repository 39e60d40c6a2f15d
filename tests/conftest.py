"""Shared fixtures: unique names per test, so tests never see each other's topics or groups."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def unique_run(request: pytest.FixtureRequest) -> str:
    """A Kafka-legal run name unique to this test."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:24].strip("-")
    return f"t-{base}-{uuid.uuid4().hex[:8]}"
