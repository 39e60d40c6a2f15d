"""The policy's own tokenizer: a checkpoint with a BPE tokenizer and a chat template
(``tests/hf_checkpoints.py``) is tokenized by that tokenizer everywhere (prompts through its chat
template, the protocol tags added as single tokens, generation stopped at its end-of-sequence
token), and loading it is deterministic; the demo's character tokenizer keeps its ids."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_checkpoints import bpe_checkpoint, bpe_tokenizer

from rlstream.envs import fx_tasks as tasks
from rlstream.envs import protocol
from rlstream.rollout.config import HarnessConfig, PolicyConfig
from rlstream.rollout.harness import Rollout
from rlstream.rollout.hf_policy import load_hf
from rlstream.rollout.model import build_policy
from rlstream.rollout.text import PolicyText, with_protocol_tags
from rlstream.schemas import deltacodec
from rlstream.trainer.warmstart import demo_batch


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_checkpoint(tmp_path_factory.mktemp("bpe") / "model")


def test_the_character_tokenizer_keeps_the_task_family_ids() -> None:
    text = PolicyText.chars()
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(protocol.VOCAB_SIZE) for _ in range(rng.randrange(40))]
        assert text.decode(ids) == protocol.decode(ids)
        assert text.encode(protocol.decode(ids)) == protocol.encode(protocol.decode(ids))
    assert text.prompt("f(x): add 3") == [protocol.BOS, *protocol.encode("f(x): add 3")]
    assert text.stop_ids == (protocol.EOS, protocol.RUN_END)


def test_a_checkpoint_is_tokenized_by_its_own_tokenizer(bpe_dir: Path) -> None:
    policy = build_policy(PolicyConfig(hf_dir=str(bpe_dir)))
    text, own = policy.text, with_protocol_tags(bpe_tokenizer())
    prompt = "f(x): add 3, double\nf(2)=10"
    want = own.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert text.prompt(prompt) == list(want)
    assert text.prompt(prompt) != [protocol.BOS, *protocol.encode(prompt)]
    assert text.bos is None and text.eos_ids == (own.convert_tokens_to_ids("<|im_end|>"),)
    for tag in protocol.TAGS:  # each tag one token, decoded as itself
        ids = text.encode(f"x{tag}y")
        assert len([i for i in ids if own.convert_ids_to_tokens(i) == tag]) == 1
        assert text.decode(ids) == f"x{tag}y"
    # the tags lay past the checkpoint's vocabulary: the embeddings grew to hold them
    assert policy.cfg.vocab_size == len(own) > len(bpe_tokenizer())


def test_loading_a_checkpoint_twice_builds_the_same_model(bpe_dir: Path) -> None:
    states = [
        deltacodec.state_hash(deltacodec.from_torch(load_hf(bpe_dir)[0].state_dict()))
        for _ in range(2)
    ]
    assert states[0] == states[1]


def test_rollouts_and_demonstrations_use_the_checkpoints_tokens(bpe_dir: Path) -> None:
    policy = build_policy(PolicyConfig(hf_dir=str(bpe_dir)))
    text = policy.text
    task = tasks.sample_task(3, tasks.TaskConfig())
    samples = Rollout(policy, HarnessConfig(max_new_tokens=12)).group(
        task.prompt, 3, torch.Generator().manual_seed(0)
    )
    prompt = text.prompt(task.prompt)
    for s in samples:
        assert s.token_ids[: len(prompt)].tolist() == prompt
        generated = s.token_ids[s.loss_mask == 1]
        assert int(generated.max()) < policy.cfg.vocab_size
        stopped = [i for i in generated.tolist() if i in text.stop_ids]
        assert stopped in ([], [generated[-1]])  # a stop id ends the turn, nothing after it
        assert s.completion == text.decode(s.token_ids[len(prompt) : s.segments[-1].end])
    tokens, mask = demo_batch(random.Random(0), 4, tasks.TeacherConfig(), tasks.TaskConfig(), text)
    first = tokens[0][mask[0] > 0].tolist()
    assert first[-1] == text.eos_ids[0] and np.all(tokens[:, 0].numpy() == prompt[0])


def test_a_tag_held_as_a_special_token_is_refused() -> None:
    from transformers import AddedToken

    tokenizer = bpe_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken("<run>", special=True, normalized=False)]}
    )
    with pytest.raises(ValueError, match="special tokens"):
        PolicyText(tokenizer)
