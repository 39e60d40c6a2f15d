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
    from rlstream.envs import fx_tasks as tasks

    rng = random.Random(0)
    texts = []
    for _ in range(n):
        task = tasks.sample_task(rng.randrange(tasks.EVAL_SEED_BASE), tasks.TaskConfig())
        texts += [task.prompt, tasks.demonstration(task, rng, tasks.TeacherConfig())]
    return texts


def bpe_tokenizer(vocab_size: int = 400, corpus=None, template: str = CHATML, added=()):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
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
    backend.train_from_iterator(corpus or _corpus(), trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = template
    return tokenizer


def bpe_checkpoint(
    path: Path,
    seed: int = 0,
    tokenizer=None,
    max_seq_len: int = 256,
    dense: bool = False,
    head_dim: int | None = None,
) -> Path:
    """The directory (see the module docstring; ``tokenizer``: another one; ``dense``: a tiny
    Llama, no router, instead of the Qwen3-MoE, with heads of ``head_dim``); returns ``path``."""
    from rlstream.rollout.hf_policy import (
        build_hf_policy,
        save_hf,
        tiny_llama_config,
        tiny_qwen3_moe_config,
    )

    tokenizer = tokenizer or bpe_tokenizer()
    if dense:
        config = tiny_llama_config(
            vocab_size=len(tokenizer), max_seq_len=max_seq_len, head_dim=head_dim
        )
    else:
        config = tiny_qwen3_moe_config(
            vocab_size=len(tokenizer), n_experts=4, max_seq_len=max_seq_len
        )
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    policy = build_hf_policy(config, seed)
    policy.hf.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.hf.generation_config.bos_token_id = None
    policy.hf.generation_config.pad_token_id = tokenizer.pad_token_id
    save_hf(policy, tokenizer, path)
    return path


# ---------------------------------------------------------------- a tool-calling checkpoint

#: Qwen3's tool-calling chat template, its thinking parts left out: the tools listed as JSON in
#: the system turn, ``<tool_call>`` JSON in assistant turns, tool results as ``<tool_response>``
#: blocks of a user turn.
QWEN3_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: What the tool checkpoint was fitted to say: a tool call, then the tool's output as the answer.
GOOD_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "python", "arguments": {code: 1}}\n</tool_call>'


def tool_tokenizer(vocab_size: int = 600):
    """A byte-level BPE (trained here on fx prompts and tool-call text) with QWEN3_TOOLS."""
    from rlstream.envs.tools import code_only

    corpus = _corpus(200) + [QWEN3_TOOLS, GOOD_CALL, BAD_CALL] * 20
    corpus += [str(code_only().schemas())] * 20
    return bpe_tokenizer(vocab_size, corpus, QWEN3_TOOLS, TOOL_TAGS)


def _episode(text, prompt: str, call: str, output: str, answer: str) -> list[int]:
    from rlstream.envs.tools import code_only

    eos = text.eos_ids[0]
    ids = text.prompt(prompt, code_only().schemas())
    ids += [*text.encode(call), eos, *text.encode(text.after_assistant([output]))]
    return [*ids, *text.encode(answer), eos]


def tool_checkpoint(path: Path, steps: int = 120, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE with ``tool_tokenizer``, fitted on a few fx prompts to answer with
    GOOD_CALL, then with the tool's output ``42`` (and, for prompts starting ``Broken:``, with
    BAD_CALL, then ``sorry``): a real model that calls a tool in its own template's format."""
    import torch

    from rlstream.envs import fx_tasks as tasks
    from rlstream.rollout.hf_policy import load_hf, save_hf

    bpe_checkpoint(path, seed, tool_tokenizer(), max_seq_len=1024)
    policy, _ = load_hf(path)  # with the protocol tags added, as every role loads it
    rng = random.Random(seed)
    prompts = [tasks.sample_task(rng.randrange(10**6), tasks.TaskConfig()).prompt for _ in range(6)]
    seqs = [_episode(policy.text, p, GOOD_CALL, "42\n", "42") for p in prompts]
    seqs += [_episode(policy.text, "Broken: " + p, BAD_CALL, "x", "sorry") for p in prompts[:2]]
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    for step in range(steps):
        ids = torch.tensor([seqs[step % len(seqs)]])
        logits, _ = policy(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_hf(policy, policy.text.tokenizer, path)
    return path
