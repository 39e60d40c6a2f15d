"""How ``exponent-delta.rlwd`` was made: the encoder of commit 624bc15 (``exponent`` pieces,
encoding 6, before ``exponent2``), run from the repository root. Kept so the golden bytes can
be explained, not to be rerun."""

from pathlib import Path

import numpy as np

from rlstream.schemas import deltacodec as dc
from rlstream.schemas import deltacodec_file as dfile
from rlstream.schemas.deltacodec import TensorBits

rng = np.random.default_rng(4321)


def bf16(w):
    u = w.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


tags = {"c.f16": "float16", "d.f32": "float32", "e.f64": "float64"}
old, new = {}, {}
w = rng.standard_normal(20000).astype(np.float32) * np.float32(0.02)
old["a.sparse"] = bf16(w)
new["a.sparse"] = bf16(w + rng.standard_normal(20000).astype(np.float32) * np.float32(1e-5))
old["b.mid"] = bf16(w[:9000])
new["b.mid"] = bf16(w[:9000] + rng.standard_normal(9000).astype(np.float32) * np.float32(2e-4))
h = (rng.standard_normal(5000) * 0.1).astype(np.float16)
old["c.f16"] = h.view(np.uint16)
new["c.f16"] = (h + (rng.standard_normal(5000) * 1e-3).astype(np.float16)).view(np.uint16)
f = (rng.standard_normal(3000) * 0.05).astype(np.float32)
old["d.f32"] = f.view(np.uint32)
g = f.copy()
g[::7] += np.float32(1e-6)
new["d.f32"] = g.view(np.uint32)
d64 = rng.standard_normal(600)
old["e.f64"] = d64.view(np.uint64)
e = d64.copy()
e[::3] *= 1 + 1e-12
new["e.f64"] = e.view(np.uint64)
so = {k: TensorBits.from_numpy(v, tags.get(k, "bfloat16")) for k, v in old.items()}
sn = {k: TensorBits.from_numpy(v, tags.get(k, "bfloat16")) for k, v in new.items()}
enc = dc.encode_delta(so, sn, version=9, base_version=8, max_chunk_bytes=6000)
print(len(enc.chunks), sorted({t["encoding"] for t in enc.manifest["tensors"]}))
d = "tests/unit/data/deltacodec/"
Path(d + "exponent-delta.rlwd").write_bytes(dfile.pack(enc))
np.savez(
    d + "exponent-delta-states.npz",
    **{"old." + k: v for k, v in old.items()},
    **{"new." + k: v for k, v in new.items()},
)
out = dc.decode(enc.manifest, enc.chunks, so)
assert dc.same_state(out, sn)
