"""How ``v1-delta.rlwd`` was made: the encoder of commit 43769c6 (before exponent pieces), run
from the repository root. Kept so the golden bytes can be explained, not to be rerun."""

from pathlib import Path

import numpy as np

from rlstream.schemas import deltacodec as dc
from rlstream.schemas import deltacodec_file as dfile
from rlstream.schemas.deltacodec import TensorBits

rng = np.random.default_rng(1234)


def bf16(w):
    u = w.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


w = rng.standard_normal(6000).astype(np.float32) * np.float32(0.02)
old, new = {}, {}
old["a.sparse"] = bf16(w)
new["a.sparse"] = bf16(w + rng.standard_normal(6000).astype(np.float32) * np.float32(2e-5))
x = rng.integers(0, 1 << 16, 3000, dtype=np.uint16)
y = x.copy()
y[::1] ^= rng.integers(1, 4, 3000, dtype=np.uint16)
old["b.dense"], new["b.dense"] = x, y
old["c.same"] = rng.integers(0, 1 << 16, 700, dtype=np.uint16)
new["c.same"] = old["c.same"].copy()
new["d.new"] = rng.integers(0, 1 << 16, 500, dtype=np.uint16)
s = np.array(
    [0x7E01, 0x7F81, 0xFFC3, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7C01, 0xFE00] * 4, dtype=np.uint16
)
old["e.special"] = s
new["e.special"] = s[::-1].copy()
f = rng.integers(0, 1 << 32, 257, dtype=np.uint32)
g = f.copy()
g[::5] += 1
old["f.f32"], new["f.f32"] = f, g
so = {
    k: TensorBits.from_numpy(v, "float32" if k == "f.f32" else "bfloat16") for k, v in old.items()
}
sn = {
    k: TensorBits.from_numpy(v, "float32" if k == "f.f32" else "bfloat16") for k, v in new.items()
}
enc = dc.encode_delta(so, sn, version=7, base_version=6, max_chunk_bytes=1500)
print(len(enc.chunks), sorted({t["encoding"] for t in enc.manifest["tensors"]}))
d = "tests/unit/data/deltacodec/"
Path(d + "v1-delta.rlwd").write_bytes(dfile.pack(enc))
np.savez(
    d + "v1-delta-states.npz",
    **{"old." + k: v for k, v in old.items()},
    **{"new." + k: v for k, v in new.items()},
)
out = dc.decode(enc.manifest, enc.chunks, so)
assert dc.same_state(out, sn)
