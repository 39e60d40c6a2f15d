"""The supervised warm start belongs to the built-in model trained from scratch: a model of
``policy.hf_dir`` starts RL as loaded unless the recipe names a number of steps."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_checkpoints import bpe_checkpoint

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import build_policy
from rlstream.trainer.config import FROM_SCRATCH_STEPS, WarmStartConfig
from rlstream.trainer.warmstart import warm_start


def test_auto_steps_follow_the_model(tmp_path: Path) -> None:
    bpe_checkpoint(tmp_path / "ckpt")
    pretrained = PolicyConfig(hf_dir=str(tmp_path / "ckpt"))
    assert WarmStartConfig().resolved(PolicyConfig()).steps == FROM_SCRATCH_STEPS
    assert WarmStartConfig().resolved(pretrained).steps == 0
    assert WarmStartConfig(steps=5).resolved(pretrained).steps == 5  # the recipe's choice


def test_a_pretrained_model_starts_as_loaded_and_nothing_is_cached(tmp_path: Path) -> None:
    bpe_checkpoint(tmp_path / "ckpt")
    cfg = PolicyConfig(hf_dir=str(tmp_path / "ckpt"))
    cache = tmp_path / "warm.pt"
    model = warm_start(cfg, WarmStartConfig(), str(cache))
    loaded = build_policy(cfg)
    assert not cache.exists()
    for (name, got), (_, want) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
