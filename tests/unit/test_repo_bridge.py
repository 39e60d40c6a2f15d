"""The repo family's bridge, both ends in one process over real pipes (the package's end in a
thread): what crosses, what comes back as what, and what the verdict side refuses."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlstream.envs import repo_bridge as rb

PACKAGE = """
import datetime, warnings
class Error(ValueError):
    pass
class Version:
    def __init__(self, major, minor=0):
        self.major, self.minor = major, minor
    def __eq__(self, other):
        return isinstance(other, Version) and (self.major, self.minor) == (other.major, other.minor)
    def __lt__(self, other):
        return (self.major, self.minor) < (other.major, other.minor)
    def __hash__(self):
        return hash((self.major, self.minor))
    def __getitem__(self, i):
        return (self.major, self.minor)[i]
    def bump(self):
        return type(self)(self.major + 1)
def parse(text):
    if not text[:1].isdigit():
        raise Error(f"not a version: {text!r}")
    return Version(*map(int, text.split(".")))
def old():
    warnings.warn("old is deprecated", DeprecationWarning)
    return 1
def leaks():
    raise StopIteration
class Zone(datetime.tzinfo):
    def utcoffset(self, dt):
        return datetime.timedelta(hours=2)
ZONE = Zone()
NAMES = ["a"]
def same(a, b):
    return a == b
"""


@pytest.fixture
def pkg(tmp_path: Path) -> Iterator[rb.RemoteModule]:
    (tmp_path / "bridgepkg.py").write_text(PACKAGE)
    sys.path.insert(0, str(tmp_path))
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    server = threading.Thread(target=rb.serve, args=(req_r, rep_w), daemon=True)
    server.start()
    finder = rb.RemoteFinder(rb.Bridge(req_w, rep_r), ["bridgepkg"])
    module = finder.create_module(type("Spec", (), {"name": "bridgepkg"})())
    yield module
    os.close(req_w)
    server.join(5)
    for fd in (req_r, rep_r, rep_w):
        os.close(fd)
    sys.path.remove(str(tmp_path))
    sys.modules.pop("bridgepkg", None)


def test_objects_stay_in_the_package_and_plain_data_comes_back_fresh(pkg) -> None:
    v = pkg.parse("1.2")
    assert isinstance(v, rb.Remote) and isinstance(v, pkg.Version)
    assert v == pkg.Version(1, 2) and v < v.bump() and v[1] == 2 and hash(v) == hash((1, 2))
    assert type(pkg.Version(3)[0]) is int
    pkg.NAMES.append("b")  # a list by attribute is the package's own
    assert list(pkg.NAMES) == ["a", "b"]


def test_exceptions_come_back_as_local_classes_of_builtin_bases(pkg) -> None:
    with pytest.raises(pkg.Error, match="not a version") as caught:
        pkg.parse("x")
    assert isinstance(caught.value, ValueError) and pkg.Error is pkg.Error
    with pytest.raises(RuntimeError, match="PEP 479"):
        pkg.leaks()
    with pytest.warns(DeprecationWarning, match="deprecated"):
        assert pkg.old() == 1


def test_the_tests_own_objects_and_classes_reach_the_package(pkg) -> None:
    import datetime

    class Index:
        def __index__(self) -> int:
            return 1

    assert pkg.Version(4, 5)[Index()] == 5

    class Mine(pkg.Version):
        def twice(self):
            return self.major * 2

    m = Mine(3)
    assert isinstance(m, rb.Remote) and m.twice() == 6 and isinstance(m.bump(), Mine)
    at = datetime.datetime(2020, 1, 1, tzinfo=pkg.ZONE)
    assert at.utcoffset() == datetime.timedelta(hours=2) and at.tzinfo is pkg.ZONE


def test_comparisons_across_the_bridge_end_as_they_would_in_one_process(pkg) -> None:
    """typing compares a proxy class with its own objects, which defer both ways (this once
    ping-ponged for ever); a test's object may ask the package while the package waits on it."""
    import typing

    assert typing.Tuple[pkg.Version, int].__args__[1] is int  # noqa: UP006  (typing checks it)

    class Asks:
        def __eq__(self, other):
            return pkg.parse("1.0") == other  # a request while the package waits for us

    assert pkg.same(Asks(), pkg.Version(1, 0)) is True
    assert pkg.same(Asks(), 2) is False and pkg.same(object(), pkg.Version(1)) is False


def test_the_wire_yields_only_plain_data_proxies_and_mirrors() -> None:
    bridge = rb.Bridge(-1, -1)
    with pytest.raises(ValueError, match="not a builtin"):
        rb.decode({"builtin": "__build_class__x"}, bridge.proxy)
    for bad in ({"ref": "1"}, {"pickle": "x"}, {"a": 1, "b": 2}):
        with pytest.raises(ValueError):
            rb.decode(bad, bridge.proxy)
    mirror = rb.decode({"exc_class": [7, "Boom", [{"builtin": "KeyError"}]]}, bridge.proxy)
    assert issubclass(mirror, KeyError) and mirror.__name__ == "Boom"
    # an exception that is not an Exception (SystemExit) is never raised as itself
    err = bridge.exception([{"builtin": "SystemExit"}, [0], "0"])
    assert type(err) is RuntimeError


def test_a_package_process_that_ends_fails_the_call_not_the_runner() -> None:
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    os.close(rep_w)  # the package's end is gone
    bridge = rb.Bridge(req_w, rep_r)
    for _ in range(2):
        with pytest.raises(rb.BridgeError, match="gone"):
            bridge.ask("import", name="x")
    for fd in (req_r, req_w, rep_r):
        os.close(fd)


def test_a_frame_over_the_limit_is_refused() -> None:
    r, w = os.pipe()
    os.write(w, (rb.MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(rb.BridgeError, match="over the limit"):
        rb.read_frame(r)
    os.close(r)
    os.close(w)


def test_warnings_filters_of_the_tests_apply(pkg) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning):
            pkg.old()
