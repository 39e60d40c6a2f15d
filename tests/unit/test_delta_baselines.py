"""The generic codings ``bench deltas`` measures the codec against are lossless given the base:
the two byte-shuffled and bucketed ones decode back to the new bits, and every coding counts
fewer bytes for a sparser change."""

from __future__ import annotations

import numpy as np

from rlstream.ops.bench import delta_baselines as db
from rlstream.ops.bench.common import bf16_bits


def _versions(n: int, changed: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    step = np.where(rng.random(n) < changed, rng.standard_normal(n) * 1e-3, 0).astype(np.float32)
    return bf16_bits(w), bf16_bits(w + step)


def test_the_new_codings_decode_back_to_the_new_bits() -> None:
    for changed in (0.0, 0.02, 0.5):
        old, new = _versions(50_000, changed, seed=int(changed * 100))
        streams = db.encode_bucket_bitmap(old, new)
        assert np.array_equal(db.decode_bucket_bitmap(old, streams), new)
        streams = db.encode_sparse_shuffled(old, new)
        assert np.array_equal(db.decode_sparse_shuffled(old, streams), new)


def test_every_coding_is_counted_and_a_sparser_change_costs_less() -> None:
    old, dense = _versions(50_000, 0.3)
    _, sparse = _versions(50_000, 0.01)
    many, few = db.coded_bytes(old, dense), db.coded_bytes(old, sparse)
    assert set(many) == set(db.NAMES) == set(few)
    assert all(few[k] < many[k] for k in db.NAMES), (few, many)
    ratios = db.generic_ratios([({"w": ("bfloat16", old)}, {"w": ("bfloat16", sparse)})])
    assert all(r > 1 for r in ratios.values()), ratios


def test_the_pretrained_workload_yields_warm_adamw_versions_of_an_hf_model(tmp_path) -> None:
    """``pretrained`` on a tiny dense HF checkpoint (the real one is SmolLM2): per learning
    rate, the consecutive bf16 versions after the warm-up, a tied tensor taken once."""
    import argparse

    from hf_checkpoints import bpe_checkpoint

    from rlstream.ops.bench.delta_workloads import STEADY_STATE, pretrained

    folder = bpe_checkpoint(tmp_path / "ckpt", dense=True)
    args = argparse.Namespace(
        pretrained_model=str(folder), pretrained_warm_steps=2, pretrained_steps=2, seed=0
    )
    (lr, pairs, what), *more = list(pretrained(args, [1e-3]))
    assert not more and lr == 1e-3 and len(pairs) == 2 and "AdamW warmed 2 steps" in what
    for old, new in pairs:
        assert set(old) == set(new) and all(o[0] == "bfloat16" for o in old.values())
        assert any((old[k][1] != new[k][1]).any() for k in old)  # each step moved weights
    assert STEADY_STATE["pretrained"] and not STEADY_STATE["finetune"]
