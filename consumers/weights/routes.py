"""The weight subscriber's pure rules (``consumers.weights.subscriber`` applies them),
unit-tested without a broker: which manifests a worker applies to reach the newest version it
can (``plan_route``: the fewest chunk bytes among "deltas from the current version" and "a
keyframe plus the deltas after it"), why a version can never be applied (``refusal``), and
where a manifest's chunks lie (``fetch_windows``)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlstream.consumers.weights.manifest_log import Key


@dataclass(frozen=True)
class Link:
    """What planning needs of one manifest."""

    version: int
    kind: str  # "delta" | "keyframe"
    base_version: int | None
    nbytes: int  # chunk bytes to fetch


@dataclass(frozen=True)
class Route:
    """Manifests to apply in order to reach ``target``, and the chunk bytes they cost."""

    target: int
    steps: tuple[Key, ...]
    nbytes: int

    @property
    def from_keyframe(self) -> bool:
        return bool(self.steps) and self.steps[0][1] == "keyframe"


def plan_route(
    links: Iterable[Link], current: int | None, skip: Container[Key] = ()
) -> Route | None:
    """The cheapest route to the newest version reachable from ``current``, or None.

    Rule: targets are tried newest first, down to ``current`` (exclusive). For a target, walk
    back along delta links (version -> its base); every keyframe met on the way (the target's
    own included) is a start costing its bytes plus the deltas walked, and meeting ``current``
    is a start costing the deltas alone. The cheapest start wins; a tie prefers the route
    without a keyframe. Manifests in ``skip`` (failed before) are never used. A target no
    start reaches is passed over for an older one."""
    deltas: dict[int, Link] = {}
    keyframes: dict[int, Link] = {}
    for link in links:
        if (link.version, link.kind) in skip:
            continue
        if link.kind == "keyframe":
            keyframes[link.version] = link
        elif link.base_version is not None and link.base_version < link.version:
            deltas[link.version] = link
    floor = -1 if current is None else current
    for target in sorted({*deltas, *keyframes}, reverse=True):
        if target <= floor:
            return None
        route = _best_start(target, current, deltas, keyframes)
        if route is not None:
            return route
    return None


def _best_start(
    target: int, current: int | None, deltas: Mapping[int, Link], keyframes: Mapping[int, Link]
) -> Route | None:
    best: Route | None = None
    walked: list[Key] = []  # deltas from the target backwards
    cost, at = 0, target
    while best is None or cost <= best.nbytes:
        if at == current:  # no dearer than any keyframe route found: a tie prefers this one
            return Route(target, tuple(reversed(walked)), cost)
        kf = keyframes.get(at)
        if kf is not None and (best is None or cost + kf.nbytes < best.nbytes):
            best = Route(target, ((at, "keyframe"), *reversed(walked)), cost + kf.nbytes)
        delta = deltas.get(at)
        if delta is None or delta.base_version is None:
            break
        walked.append((at, "delta"))
        cost += delta.nbytes
        at = delta.base_version
    return best


def refusal(
    version: int,
    links: Sequence[Link],
    bad: Mapping[Key, str],
    newest: int | None,
    current: int | None,
) -> str | None:
    """Why ``version`` can never be applied from ``current``, or None while it still may be.

    Rule: refused when every manifest of ``version`` read (``links``) was refused for good
    (``bad``, with its reason); when no route avoiding the refused manifests reaches it (a
    refused delta broke the chain and no keyframe of it or after the break is there: the
    manifests of a version are committed together, so none will come); or when none of it is
    known while a newer version is (refused before decoding, or forgotten): the learner
    publishes every version before the next. A version at or below ``current`` never is."""
    if current is not None and current >= version:
        return None
    mine = [(link.version, link.kind) for link in links if link.version == version]
    if mine:
        reasons = [bad[k] for k in mine if k in bad]
        if len(reasons) == len(mine):
            return "; ".join(reasons)
        route = plan_route([link for link in links if link.version <= version], current, bad)
        if route is None or route.target != version:
            return f"no route reaches version {version} without a refused one ({sorted(bad)})"
        return None
    if newest is not None and newest > version:
        return f"no manifest of version {version} accepted, version {newest} is"
    return None


def fetch_windows(chunks: Sequence[Mapping[str, Any]], topic: str) -> dict[int, tuple[int, int]]:
    """``partition -> (first, last)`` offsets holding the chunks, from their refs.

    Rule: usable only when every chunk has a ref into ``topic`` (the topic being read);
    otherwise empty, and the caller scans."""
    windows: dict[int, tuple[int, int]] = {}
    for c in chunks:
        ref = c.get("ref")
        if ref is None or ref["topic"] != topic:
            return {}
        p, off = ref["partition"], ref["offset"]
        lo, hi = windows.get(p, (off, off))
        windows[p] = (min(lo, off), max(hi, off))
    return windows
