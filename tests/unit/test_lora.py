"""LoRA (``policy.lora.rank``): only the adapters train, a version's delta carries adapter bytes
only, a worker's policy built from the same config takes the published state and computes the
learner's logits, a saved HF directory holds the merged model, and steps stay bit-exact."""

from __future__ import annotations

import numpy as np
import torch
from test_grpo import _rollout_batch
from transformers import AutoModelForCausalLM

from rlstream.envs import protocol
from rlstream.rollout.config import LoraConfig, PolicyConfig
from rlstream.rollout.hf_policy import save_hf
from rlstream.rollout.model import build_policy
from rlstream.rollout.text import char_tokenizer
from rlstream.schemas.deltacodec import encode_delta, to_torch
from rlstream.trainer import grpo
from rlstream.trainer.config import LearnerConfig, WarmStartConfig
from rlstream.trainer.learner_step import init_model, published_state
from rlstream.trainer.warmstart import cache_key

SHAPE = {
    "vocab_size": protocol.VOCAB_SIZE,
    "max_seq_len": 48,
    "d_model": 32,
    "n_heads": 4,
    "n_layers": 2,
}
CFG = PolicyConfig(**SHAPE, d_expert=32, lora=LoraConfig(rank=4))  # type: ignore[arg-type]


def _learner() -> LearnerConfig:
    return LearnerConfig(
        policy=CFG, warm_start=WarmStartConfig(steps=2, batch_size=4), publish_dtype="float32"
    )


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    grpo.grpo_step(model, opt, _rollout_batch(model), grpo.GrpoConfig())  # type: ignore[arg-type]


def test_only_the_adapters_train_and_a_delta_carries_only_them() -> None:
    torch.set_num_threads(1)
    model, opt = init_model(_learner(), lambda _: None)
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in trained}
    assert names and all("lora_" in n for n in names)
    assert opt.param_groups[0]["lr"] == _learner().lr * 10  # lora.lr_scale
    before = published_state(model, "float32")
    _step(model, opt)
    after = published_state(model, "float32")
    changed = {k for k in after if not np.array_equal(before[k].bits, after[k].bits)}
    assert changed and all(".lora_" in k for k in changed), changed
    assert any(".lora_B." in k for k in changed), "B starts at zero and moves"
    delta = encode_delta(before, after, version=1, base_version=0)
    adapter_bytes = sum(after[k].bits.nbytes for k in after if ".lora_" in k)
    assert delta.manifest["encoded_bytes"] <= adapter_bytes, "base tensors carry no data"
    assert delta.manifest["raw_bytes"] > 8 * adapter_bytes


def test_a_worker_policy_takes_the_state_and_the_saved_directory_is_merged(tmp_path) -> None:
    torch.set_num_threads(1)
    model, opt = init_model(_learner(), lambda _: None)
    _step(model, opt)
    worker = build_policy(CFG)  # what a rollout worker builds from the run's policy config
    state = to_torch(published_state(model, "float32"))
    with torch.no_grad():
        worker.load_state_dict(state)  # strict: the same keys, base and adapters
    tokens = torch.randint(3, 32, (2, 10), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        want = model(tokens)[0]
        assert torch.equal(worker(tokens)[0], want)
        save_hf(worker, char_tokenizer(), tmp_path)
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
        assert not any("lora" in k for k in plain.state_dict())
        assert torch.allclose(plain(tokens).logits.float(), want, atol=1e-4)


def test_the_warm_start_is_shared_with_and_without_adapters() -> None:
    plain = CFG.model_copy(update={"lora": LoraConfig()})
    assert cache_key(CFG, WarmStartConfig()) == cache_key(plain, WarmStartConfig())


def test_adapted_steps_are_bit_exact() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        states = []
        for _ in range(2):
            model, opt = init_model(_learner(), lambda _: None)
            for _ in range(2):
                _step(model, opt)
            states.append(model.state_dict())
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_published_state_of_an_hf_dir_model_with_adapters_saves(tmp_path) -> None:
    """``save_state_hf`` of a model of ``policy.hf_dir`` with LoRA (what ``rlstream export``
    and the demo's final model write): the state's adapter keys load, the folder is merged."""
    from hf_checkpoints import bpe_checkpoint

    from rlstream.rollout.hf_policy import save_state_hf

    cfg = PolicyConfig(
        hf_dir=str(bpe_checkpoint(tmp_path / "ckpt")), lora=LoraConfig(rank=2, seed=1)
    )
    model = build_policy(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    state = to_torch(published_state(model, "float32"))
    assert any("lora_A" in k for k in state)
    save_state_hf(cfg, state, tmp_path / "out")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert not any("lora" in k for k in plain.state_dict())
