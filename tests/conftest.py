"""The suite's tiers, by directory, and what every tier shares.

- ``tests/unit``: no broker, no subprocess of a role; the fast tier with ``integration``.
- ``tests/integration``: tests on one real broker per xdist worker (``brokers.py``).
- ``tests/system``: whole pipelines, several regions, vLLM, benchmark smoke runs, chaos, clusters
  of their own. ``tests/system/serial`` holds the longest whole-pipeline runs with deadlines:
  under pytest-xdist they share one worker with the tests of the three-region ``geo`` cluster
  (whichever tier those are in), one after the other, so none competes with another for the
  cores.

Each test gets its tier's marker (``-m unit``, ``-m "not system"``) and the serial ones the
xdist group ``serial``, from its path alone: moving a file moves it between tiers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytest_plugins = ["brokers"]

TIERS = ("unit", "integration", "system")
HERE = Path(__file__).resolve().parent

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


@pytest.fixture(scope="session", autouse=True)
def _pins_elsewhere(tmp_path_factory: pytest.TempPathFactory):
    """The runs tests create pin their weight keys in a temporary folder (and the roles they
    start read them there), never in the user's ``~/.config/rlstream/trust``; set before any
    session fixture starts a role."""
    with pytest.MonkeyPatch.context() as patch:
        if "RLSTREAM_TRUST_DIR" not in os.environ:
            patch.setenv("RLSTREAM_TRUST_DIR", str(tmp_path_factory.getbasetemp() / "trust"))
        yield


def tier_of(path: Path) -> tuple[str, bool]:
    """A test file's tier, and whether it runs in the serial group (module doc)."""
    parts = Path(path).resolve().relative_to(HERE).parts
    return parts[0], parts[:2] == ("system", "serial")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tiers and the serial group by path (module doc); the ``geo`` tests, which leave several
    brokers running until their last test, go last, so everything else runs beside one broker.
    xdist hands out the largest group first, so the serial queue starts at once. Without xdist
    the group marker is inert."""

    def uses_geo(item: pytest.Item) -> bool:
        return "geo" in getattr(item, "fixturenames", ())

    for item in items:
        tier, serial = tier_of(item.path)
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tiers {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))
        if serial or uses_geo(item):
            item.add_marker(pytest.mark.xdist_group("serial"))
    items.sort(key=uses_geo)  # stable: the order within each class is kept


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Clients talk to 127.0.0.1 only; a proxy variable must never reroute them.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
