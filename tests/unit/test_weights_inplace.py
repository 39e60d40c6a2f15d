"""The subscriber's staging step (``consumers.weights.subscriber.stage_step``) without a broker.

Properties asserted: with the spare buffers of the version before the base and the delta that
made the base, a delta is applied in place into the spare's memory (the result is bit-exact
and lives where the spare was; the base is never written); without them, or when they do not
fit, the step is decoded as before; a damaged delta is refused and leaves the base whole.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlstream.consumers.weights.subscriber import stage_step
from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import TensorBits


def _versions(n: int = 3, size: int = 200_000) -> list[dict[str, TensorBits]]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(size).astype(np.float32) * np.float32(0.02)
    out = []
    for _ in range(n):
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        out.append(
            {
                "w": TensorBits.from_numpy(bits, "bfloat16"),
                "b": TensorBits.from_numpy(bits[:300].copy(), "bfloat16"),
            }
        )
        w = w + rng.standard_normal(size).astype(np.float32) * np.float32(3e-5)
    return out


def _copy(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    out = {k: TensorBits(t.dtype, t.shape, t.bits.copy()) for k, t in state.items()}
    for k, t in out.items():
        t.remember_hash(state[k].hash)
    return out


def _address(state: dict[str, TensorBits]) -> dict[str, int]:
    return {k: t.bits.__array_interface__["data"][0] for k, t in state.items()}


def test_a_delta_after_a_delta_is_applied_in_the_spare() -> None:
    v0, v1, v2 = _versions()
    d01 = dc.encode_delta(v0, v1, version=1, base_version=0)
    d12 = dc.encode_delta(v1, v2, version=2, base_version=1)
    base, spare = _copy(v1), _copy(v0)
    where = _address(spare)
    out = stage_step(d12.manifest, d12.chunks, base, spare, (d01.manifest, d01.chunks))
    assert dc.same_state(out, v2) and _address(out) == where
    assert dc.same_state(base, v1)


def test_without_a_fitting_kept_delta_the_step_is_decoded() -> None:
    v0, v1, v2 = _versions()
    d12 = dc.encode_delta(v1, v2, version=2, base_version=1)
    base = _copy(v1)
    out = stage_step(d12.manifest, d12.chunks, base, _copy(v0), (d12.manifest, d12.chunks))
    assert dc.same_state(out, v2) and dc.same_state(base, v1)
    assert dc.same_state(stage_step(d12.manifest, d12.chunks, base), v2)


def test_a_damaged_delta_is_refused_and_the_base_kept() -> None:
    v0, v1, v2 = _versions()
    d01 = dc.encode_delta(v0, v1, version=1, base_version=0)
    d12 = dc.encode_delta(v1, v2, version=2, base_version=1)
    bad = [bytes(c[:-1]) + bytes([c[-1] ^ 1]) for c in d12.chunks]
    base = _copy(v1)
    with pytest.raises(dc.ChunkCorrupt):
        stage_step(d12.manifest, bad, base, _copy(v0), (d01.manifest, d01.chunks))
    assert dc.same_state(base, v1)


def test_a_spare_sharing_memory_with_the_base_is_never_written() -> None:
    v0, v1, v2 = _versions()
    d01 = dc.encode_delta(v0, v1, version=1, base_version=0)
    d12 = dc.encode_delta(v1, v2, version=2, base_version=1)
    base = _copy(v1)
    alias = {k: TensorBits(t.dtype, t.shape, t.bits) for k, t in base.items()}  # same memory
    for k, t in alias.items():
        t.remember_hash(v0[k].hash)  # claims to be v0: only memory can tell
    out = stage_step(d12.manifest, d12.chunks, base, alias, (d01.manifest, d01.chunks))
    assert dc.same_state(out, v2) and dc.same_state(base, v1)


def test_between_full_checks_fast_apply_deltas_are_checked_by_their_changes() -> None:
    """``full_check_every`` 4: versions 2 and 3 are applied in place with ``check="changes"``
    (no tensor hashed, so none known after); a spare whose hashes are unknown is matched to
    the kept delta by the version the caller served from it."""
    v0, v1, v2, v3 = _versions(4)
    d01, d12, d23 = (
        dc.encode_delta(a, b, version=i + 1, base_version=i, fast_apply=True)
        for i, (a, b) in enumerate([(v0, v1), (v1, v2), (v2, v3)])
    )
    base, spare = _copy(v1), _copy(v0)
    where = _address(spare)
    out2 = stage_step(
        d12.manifest, d12.chunks, base, spare, (d01.manifest, d01.chunks), 4, spare_version=0
    )
    assert dc.same_state(out2, v2) and _address(out2) == where
    assert not out2["w"].knows(dc.DEFAULT_HASH)
    # the next version goes into the buffers of v1 (hashes known), then into those of v2
    out3 = stage_step(d23.manifest, d23.chunks, out2, base, (d12.manifest, d12.chunks), 4)
    assert dc.same_state(out3, v3) and dc.same_state(out2, v2)
    # a spare without hashes that the caller did not serve at the kept delta's base: decoded
    stale = _copy(v3)
    for t in stale.values():
        t.forget_hash()
    out = stage_step(
        d23.manifest, d23.chunks, _copy(v2), stale, (d12.manifest, d12.chunks), 4, spare_version=3
    )
    assert dc.same_state(out, v3)
