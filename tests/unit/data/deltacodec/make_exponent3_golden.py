"""How ``exponent2-delta.rlwd`` and ``exponent3-delta.rlwd`` were made: this script, run from
the repository root with the encoder of commit 8f23577 (``exponent2`` pieces, before
``exponent3``) for the first (``python make_exponent3_golden.py exponent2``, that commit's
package first on the path) and with the encoder that added ``exponent3`` for the second. Kept
so the golden bytes can be explained, not to be rerun."""

import sys
from pathlib import Path

import numpy as np

from rlstream.schemas import deltacodec as dc
from rlstream.schemas import deltacodec_file as dfile
from rlstream.schemas.deltacodec import TensorBits

stem = sys.argv[1] + "-delta"
rng = np.random.default_rng(9876)


def bf16(w):
    u = w.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


tags = {"c.f16": "float16", "d.f32": "float32", "e.f64": "float64"}
old, new = {}, {}
w = rng.standard_normal(200_000).astype(np.float32) * np.float32(0.02)
old["a.sparse"] = bf16(w)
new["a.sparse"] = bf16(w + rng.standard_normal(w.size).astype(np.float32) * np.float32(6e-6))
old["b.mid"] = bf16(w[:30_000])
new["b.mid"] = bf16(w[:30_000] + rng.standard_normal(30_000).astype(np.float32) * np.float32(2e-4))
h = (rng.standard_normal(20_000) * 0.1).astype(np.float16)
old["c.f16"] = h.view(np.uint16)
new["c.f16"] = (h + (rng.standard_normal(h.size) * 1e-3).astype(np.float16)).view(np.uint16)
f = (rng.standard_normal(10_000) * 0.05).astype(np.float32)
old["d.f32"] = f.view(np.uint32)
g = f + (rng.standard_normal(f.size) * 1e-7).astype(np.float32)
g[::97] = -g[::97]  # sign flips: the longest differences
new["d.f32"] = g.view(np.uint32)
d64 = rng.standard_normal(4_000)
old["e.f64"] = d64.view(np.uint64)
new["e.f64"] = (d64 * (1 + rng.standard_normal(d64.size) * 1e-13)).view(np.uint64)
so = {k: TensorBits.from_numpy(v, tags.get(k, "bfloat16")) for k, v in old.items()}
sn = {k: TensorBits.from_numpy(v, tags.get(k, "bfloat16")) for k, v in new.items()}
enc = dc.encode_delta(so, sn, version=9, base_version=8, max_chunk_bytes=12_000)
print(len(enc.chunks), sorted({p[3] for t in enc.manifest["tensors"] for p in t["pieces"]}))
print([t["encoding"] for t in enc.manifest["tensors"]], enc.manifest["encoded_bytes"])
d = "tests/unit/data/deltacodec/"
Path(d + stem + ".rlwd").write_bytes(dfile.pack(enc))
np.savez_compressed(  # the same states for both: the test reads exponent3-delta-states.npz
    d + stem + "-states.npz",
    **{"old." + k: v for k, v in old.items()},
    **{"new." + k: v for k, v in new.items()},
)
assert dc.same_state(dc.decode(enc.manifest, enc.chunks, so), sn)
