"""Compiling the codec's numba kernels ahead of the roles that use them."""

from __future__ import annotations

import numpy as np

from .bits import TensorBits, same_state
from .codec import apply_in_place, decode, encode_delta


def compile_kernels() -> list[str]:
    """Compile the numba kernels that encoding, applying and decoding bf16 deltas use, or
    load them from numba's on-disk cache (next to their modules): 40-50 s of one core the
    first time, under a second after. Every process that meets a kernel missing from the
    cache compiles it, so a set-up step that runs this first spares the roles that start
    together (a learner and its rollout workers) doing it each at once. Encodes, applies in
    place and decodes two small deltas, one coded as ``exponent2`` pieces and one as
    ``exponent3``, and the second again as ``direct`` pieces; returns their tensors'
    encodings."""
    rng = np.random.default_rng(0)
    encodings: list[str] = []
    # an optimizer-like step of i.i.d. weights: few changes (exponent2), then ~2% (exponent3)
    for n, step in ((4096, 1e-5), (400_000, 1e-6)):
        weights = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
        moved = weights + rng.standard_normal(n, dtype=np.float32) * np.float32(step)
        old, new = ((w.view(np.uint32) >> 16).astype(np.uint16) for w in (weights, moved))
        base, want = ({"w": TensorBits("bfloat16", (n,), b)} for b in (old, new))
        for fast in (False, True) if n > 4096 else (False,):
            enc = encode_delta(base, want, version=1, base_version=0, fast_apply=fast)
            held = {"w": TensorBits("bfloat16", (n,), old.copy())}
            check = "changes" if fast else "full"
            applied = apply_in_place(enc.manifest, enc.chunks, held, check=check)  # writable
            decoded = decode(enc.manifest, enc.chunks, base)  # read-only: other kernel types
            if not (same_state(applied, want) and same_state(decoded, want)):
                raise AssertionError("the codec's warm-up delta did not decode bit-exactly")
            encodings += [e["encoding"] for e in enc.manifest["tensors"]]
    return encodings
