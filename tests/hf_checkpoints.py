"""Hugging Face checkpoints for tests, built here (nothing is downloaded).

``bpe_checkpoint`` writes a tiny Qwen3-MoE whose tokenizer is not the demo's character
tokenizer: a byte-level BPE trained on the fx task family's prompts and demonstrations, with a
ChatML chat template, no BOS token, ``<|im_end|>`` as its end-of-sequence token and none of the
harness's protocol tags (``rlstream.rollout.text`` adds them when the directory is loaded,
which grows the embeddings). So a test that points rlstream at it shows the policy's own
tokenizer is used end to end.
"""

from __future__ import annotations

import random
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(n: int = 600) -> list[str]:
    from rlstream.envs import tasks

    rng = random.Random(0)
    texts = []
    for _ in range(n):
        task = tasks.sample_task(rng.randrange(tasks.EVAL_SEED_BASE), tasks.TaskConfig())
        texts += [task.prompt, tasks.demonstration(task, rng, tasks.TeacherConfig())]
    return texts


def bpe_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def bpe_checkpoint(path: Path, seed: int = 0) -> Path:
    """The directory (see the module docstring); returns ``path``."""
    from rlstream.rollout.hf_policy import build_hf_policy, save_hf, tiny_qwen3_moe_config

    tokenizer = bpe_tokenizer()
    config = tiny_qwen3_moe_config(vocab_size=len(tokenizer), n_experts=4)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    policy = build_hf_policy(config, seed)
    policy.hf.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.hf.generation_config.bos_token_id = None
    policy.hf.generation_config.pad_token_id = tokenizer.pad_token_id
    save_hf(policy, tokenizer, path)
    return path
