"""The weight publisher's pure rules (``producers.weights.publisher`` applies them), unit-tested
without a broker.

- kinds (``publish_kinds``): a version is a *keyframe* when forced, when the publisher has no
  previous state (version 0, a fresh process, a resume without state) or when
  ``version % keyframe_every == 0``; every version that has a previous state is also published
  as a *delta* against it, so at a keyframe version both exist (delta first). Workers that
  follow live never download a keyframe; new or lost workers start from one.
- ``keyframe_version`` of a manifest is the newest keyframe at or before its version.
- partitions (``chunk_partitions``): the chunks of a publish go round-robin over the chunk
  topic's partitions, starting where the previous publish's chunks ended: an even spread (a
  one-chunk delta too), and a version of at least as many chunks as partitions touches all.
- ``learner_epoch`` of a manifest is the publisher's ``epoch``: the learner's incarnation (one
  more than the newest epoch among the run's manifests, set by the learner when it starts), so
  readers can refuse a manifest of an older incarnation (``consumers.weights.manifest_log``).

"""

from __future__ import annotations


def publish_kinds(
    version: int, keyframe_every: int, has_base: bool, force_keyframe: bool = False
) -> tuple[str, ...]:
    """What to publish for ``version``: ``("delta",)``, ``("keyframe",)`` or both, delta first.

    Rule: a keyframe when forced, without a previous state, or when ``version`` is a multiple of
    ``keyframe_every``; a delta whenever there is a previous state to diff against."""
    if keyframe_every < 1:
        raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
    keyframe = force_keyframe or not has_base or version % keyframe_every == 0
    return (("delta",) if has_base else ()) + (("keyframe",) if keyframe else ())


def chunk_partitions(start: int, count: int, partitions: int) -> list[int]:
    """Partitions of ``count`` chunks written from partition ``start`` on, round-robin.

    Rule: chunk ``i`` goes to ``(start + i) % partitions``; the next publish starts at
    ``(start + count) % partitions``."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return [(start + i) % partitions for i in range(count)]


def keyframe_of(version: int, kinds: tuple[str, ...], last_keyframe: int | None) -> int:
    """The ``keyframe_version`` of ``version`` published as ``kinds``: itself when it is a
    keyframe, else the one the last published version followed (a delta-only version always
    has a base, whose keyframe is known)."""
    if "keyframe" in kinds:
        return version
    if last_keyframe is None:
        raise AssertionError("a delta-only version needs a known keyframe before it")
    return last_keyframe
