"""The workloads of ``rlstream bench deltas`` (see that module's docstring): each yields, per
learning rate, the consecutive (old, new) bf16 states of one case and a line that says what
they are."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlstream.ops.bench.common import bf16_bits, progress

WEIGHT_STD = 0.01
ADAM_M_STD = 0.229  # sqrt((1 - beta1) / (1 + beta1)) for beta1 = 0.9
ADAM_V_STD = 0.045  # relative spread of v for beta2 = 0.999
ADAM_EPS = 1e-8
WORKLOADS = ("synthetic", "adam-real", "finetune", "learner", "pretrained")
#: Whether a workload's versions come from an optimizer in its steady state (warm moments on a
#: trained model), as a real run's do after its first steps.
STEADY_STATE = {
    "synthetic": False,  # i.i.d. weights, a simulated step
    "adam-real": False,  # 26 steps from initialisation
    "finetune": False,  # a fresh Adam: its first step moves every weight by lr·sign(g)
    "learner": True,
    "pretrained": True,
}
CONTEXT = 128  # bytes of context of the adam-real language model

#: One state: tensor name -> (dtype tag, flat bit patterns).
Arrays = dict[str, tuple[str, Any]]
Pair = tuple[Arrays, Arrays]


def synthetic(
    args: argparse.Namespace, lrs: list[float]
) -> Iterator[tuple[float, list[Pair], str]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    sizes = _split(args.params, args.tensors)
    progress(f"deltas: synthetic: {args.params:,} bf16 params in {len(sizes)} tensors")
    master = [rng.standard_normal(n, dtype=np.float32) * np.float32(WEIGHT_STD) for n in sizes]
    old = {f"layer{i}.weight": ("bfloat16", bf16_bits(w)) for i, w in enumerate(master)}
    what = f"{args.params:,} i.i.d. N(0, 0.01^2) weights, simulated steady-state Adam step"
    for lr in lrs:
        progress(f"deltas: synthetic: lr {lr:g}: simulating one Adam step")
        new = {
            f"layer{i}.weight": ("bfloat16", bf16_bits(_adam_step(w, lr, rng)))
            for i, w in enumerate(master)
        }
        yield lr, [(old, new)], what


def _split(params: int, tensors: int) -> list[int]:
    tensors = max(1, min(tensors, params))
    return [params // tensors + (i < params % tensors) for i in range(tensors)]


def _adam_step(w: Any, lr: float, rng: Any) -> Any:
    import numpy as np

    m = rng.standard_normal(w.size, dtype=np.float32) * np.float32(ADAM_M_STD)
    v = np.float32(1.0) + rng.standard_normal(w.size, dtype=np.float32) * np.float32(ADAM_V_STD)
    m *= np.float32(lr) / (np.sqrt(v) + np.float32(ADAM_EPS))
    return w + m


def _torch_bf16(module: Any) -> Arrays:
    """The bf16 casts (round to nearest even) of a module's parameters and float buffers, a
    tensor tied to one already taken (a tied LM head) once."""
    import torch

    out: Arrays = {}
    seen: set[int] = set()
    for name, t in module.state_dict().items():
        if t.is_floating_point() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            bits = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
            out[name] = ("bfloat16", bits.view("<u2").reshape(-1).copy())
    return out


def _corpus(pattern: str = "*.py") -> Any:
    """The bytes of this package's files named by ``pattern`` (its Python sources: the language
    model's pretraining text; its Markdown: the fine-tuning text), in path order."""
    import numpy as np

    root = Path(__file__).resolve().parents[2]
    files = sorted(
        p
        for p in root.rglob(pattern)
        if not any(part.startswith(".") or part == "build" for part in p.relative_to(root).parts)
    )
    return np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8)


def _byte_lm(width: int, layers: int) -> Any:
    import torch
    from torch import nn

    class ByteLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.pos = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
            block = nn.TransformerEncoderLayer(
                width,
                4,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, 256, bias=False)

        def forward(self, x: Any) -> Any:
            n = x.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(n)
            h = self.blocks(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return ByteLM()


def _lm_loss(model: Any, text: Any, gen: Any, batch: int = 16) -> Any:
    import torch
    from torch.nn import functional as F

    at = torch.randint(0, len(text) - CONTEXT - 1, (batch,), generator=gen)
    rows = torch.stack(
        [torch.from_numpy(text[i : i + CONTEXT + 1].astype("int64")) for i in at.tolist()]
    )
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))


def adam_real(
    args: argparse.Namespace, lrs: list[float]
) -> Iterator[tuple[float, list[Pair], str]]:
    import copy

    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    text = _corpus()
    model = _byte_lm(args.real_width, args.real_layers)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(args.seed)
    progress(
        f"deltas: adam-real: pretraining a {params:,}-parameter byte LM for {args.real_seconds:g}s"
    )
    start, steps, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - start < args.real_seconds or steps == 0:
        opt.zero_grad(set_to_none=True)
        out = _lm_loss(model, text, gen)
        out.backward()
        opt.step()
        steps, loss = steps + 1, out.item()
    progress(f"deltas: adam-real: {steps} steps, loss {loss:.3f} nats/byte")
    what = (
        f"byte-level causal transformer LM, {params:,} params ({args.real_layers} blocks, width"
        f" {args.real_width}), Adam-pretrained {steps} steps ({args.real_seconds:g}s, loss"
        f" {loss:.2f} nats/byte) on this package's sources, then one real Adam step"
    )
    old = _torch_bf16(model)
    for lr in lrs:
        stepped = copy.deepcopy(model)
        step_opt = torch.optim.Adam(stepped.parameters(), lr=lr, betas=(0.9, 0.999))
        step_opt.load_state_dict(opt.state_dict())
        for group in step_opt.param_groups:
            group["lr"] = lr
        _lm_loss(stepped, text, torch.Generator().manual_seed(args.seed + 1)).backward()
        step_opt.step()
        yield lr, [(old, _torch_bf16(stepped))], what


def finetune(args: argparse.Namespace, lrs: list[float]) -> Iterator[tuple[float, list[Pair], str]]:
    """The byte LM pretrained for ``--pretrain-minutes`` on the Python sources (once per machine:
    the weights are cached under ``~/.cache/rlstream/bench``), then per learning rate
    ``--finetune-steps`` Adam steps (a fresh optimizer, betas 0.9/0.999) on the project's
    Markdown, a text it never saw: the consecutive bf16 versions of that fine-tuning."""
    import copy

    import torch

    torch.manual_seed(args.seed)
    model, steps, loss = _pretrained(args)
    text = _corpus("*.md")
    params = sum(p.numel() for p in model.parameters())
    what = (
        f"byte-level causal transformer LM, {params:,} params ({args.finetune_layers} blocks, "
        f"width {args.finetune_width}), Adam-pretrained {steps} steps ({args.pretrain_minutes:g}"
        f" min, loss {loss:.2f} nats/byte) on this package's Python sources, then fine-tuned on"
        f" its Markdown: {args.finetune_steps} consecutive Adam steps"
    )
    for lr in lrs:
        tuned = copy.deepcopy(model)
        opt = torch.optim.Adam(tuned.parameters(), lr=lr, betas=(0.9, 0.999))
        gen = torch.Generator().manual_seed(args.seed + 2)
        versions = [_torch_bf16(tuned)]
        for _ in range(args.finetune_steps):
            opt.zero_grad(set_to_none=True)
            _lm_loss(tuned, text, gen).backward()
            opt.step()
            versions.append(_torch_bf16(tuned))
        progress(f"deltas: finetune: lr {lr:g}: {args.finetune_steps} steps")
        yield lr, list(itertools.pairwise(versions)), what


def _pretrained(args: argparse.Namespace) -> tuple[Any, int, float]:
    """The pretrained byte LM of ``finetune``, its steps and last loss: from the cache when a
    run with the same shape, seed and minutes stored it, else trained now (every core) and
    stored."""
    import os

    import torch

    shape = f"{args.finetune_width}x{args.finetune_layers}"
    cache = Path(os.path.expanduser("~/.cache/rlstream/bench"))
    path = cache / f"byte-lm-{shape}-{args.pretrain_minutes:g}min-seed{args.seed}.pt"
    model = _byte_lm(args.finetune_width, args.finetune_layers)
    if path.exists():
        stored = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(stored["model"])
        progress(f"deltas: finetune: the pretrained LM from {path}")
        return model, int(stored["steps"]), float(stored["loss"])
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    text = _corpus("*.py")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(args.seed)
    progress(f"deltas: finetune: pretraining the byte LM for {args.pretrain_minutes:g} min")
    start, steps, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - start < args.pretrain_minutes * 60 or steps == 0:
        opt.zero_grad(set_to_none=True)
        out = _lm_loss(model, text, gen)
        out.backward()
        opt.step()
        steps, loss = steps + 1, out.item()
        if steps % 100 == 0:
            progress(f"deltas: finetune: pretraining step {steps}, loss {loss:.3f} nats/byte")
    torch.set_num_threads(threads)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"model": model.state_dict(), "steps": steps, "loss": loss}, tmp)
    tmp.replace(path)  # readers never see a half-written file
    return model, steps, loss


def learner_versions(args: argparse.Namespace) -> Iterator[tuple[float, list[Pair], str]]:
    import random

    import torch

    from rlstream.trainer import grpo
    from rlstream.trainer import local_loop as ll
    from rlstream.trainer.config import LearnerConfig, WarmStartConfig
    from rlstream.trainer.learner_step import published_state
    from rlstream.trainer.warmstart import warm_start

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    learner = LearnerConfig()
    warm = WarmStartConfig(steps=args.learner_warm_steps)
    cfg = ll.LocalLoopConfig(seed=args.seed, warm_start=warm, lr=learner.lr)
    progress(f"deltas: learner: warm start ({args.learner_warm_steps} steps)")
    model = warm_start(learner.policy, warm, None, lambda *_: None)
    opt = torch.optim.Adam(model.parameters(), lr=learner.lr, betas=(0.9, 0.98))
    rng, gen, scorer = (
        random.Random(args.seed),
        torch.Generator().manual_seed(args.seed),
        ll.Scorer(1),
    )

    def publish() -> Arrays:
        return {k: (t.dtype, t.bits) for k, t in published_state(model, "bfloat16").items()}

    versions = [publish()]
    try:
        for step in range(args.learner_steps):
            seqs, advs, rewards = ll.collect(model, cfg, rng, gen, scorer)
            grpo.grpo_step(model, opt, grpo.make_batch(seqs, advs), learner.grpo)
            versions.append(publish())
            progress(f"deltas: learner: step {step + 1}, success {sum(rewards) / len(rewards):.2f}")
    finally:
        scorer.close()
    params = sum(p.numel() for p in model.parameters())
    what = (
        f"the project's Qwen3-MoE policy ({params:,} params), warm start {args.learner_warm_steps}"
        f" steps then {args.learner_steps} GRPO steps of the learner's Adam; consecutive"
        " published bf16 versions"
    )
    yield learner.lr, list(itertools.pairwise(versions)), what


def pretrained(
    args: argparse.Namespace, lrs: list[float]
) -> Iterator[tuple[float, list[Pair], str]]:
    """A real pretrained instruct model (SmolLM2-135M-Instruct, ``make smollm2``; or
    ``--pretrained-model``) mid-fine-tune: per learning rate, AdamW (betas 0.9/0.999, weight
    decay 0.01) warmed for ``--pretrained-warm-steps`` steps on the project's Markdown, then
    ``--pretrained-steps`` more: the consecutive bf16 versions of those."""
    import copy

    import torch

    model, tokens, folder = _pretrained_model(args)
    params = sum(p.numel() for p in model.parameters())
    what = (
        f"{Path(folder).name} ({params:,} params), fine-tuned on this package's Markdown with "
        f"AdamW warmed {args.pretrained_warm_steps} steps: {args.pretrained_steps} consecutive "
        "steps after that"
    )
    for lr in lrs:
        tuned = copy.deepcopy(model)
        opt = torch.optim.AdamW(tuned.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
        gen = torch.Generator().manual_seed(args.seed + 3)
        versions = []
        for step in range(args.pretrained_warm_steps + args.pretrained_steps):
            if step >= args.pretrained_warm_steps:
                versions.append(_torch_bf16(tuned))
            opt.zero_grad(set_to_none=True)
            loss = _token_loss(tuned, tokens, gen)
            loss.backward()
            opt.step()
            if step % 10 == 0:
                progress(f"deltas: pretrained: lr {lr:g}: step {step}, loss {loss.item():.3f}")
        versions.append(_torch_bf16(tuned))
        yield lr, list(itertools.pairwise(versions)), what


def _pretrained_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The pretrained model in float32, the Markdown as its token ids, and its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.rollout.model_import import default_home

    folder = args.pretrained_model
    if folder is None:
        found = sorted(default_home().glob("SmolLM2-135M-Instruct-*"))
        if not found:
            raise SystemExit(
                "bench deltas --workloads pretrained: no imported SmolLM2 (run `make smollm2`) "
                "and no --pretrained-model given"
            )
        folder = str(found[-1])
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.train()
    text = _corpus("*.md").tobytes().decode("utf-8", errors="replace")
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    progress(f"deltas: pretrained: {folder}, {len(ids):,} tokens of Markdown")
    return model, torch.tensor(ids), folder


def _token_loss(model: Any, tokens: Any, gen: Any, batch: int = 4, length: int = 128) -> Any:
    """The causal LM loss of ``batch`` random windows of ``length`` tokens."""
    import torch

    starts = torch.randint(0, len(tokens) - length - 1, (batch,), generator=gen)
    rows = torch.stack([tokens[s : s + length] for s in starts.tolist()])
    return model(input_ids=rows, labels=rows).loss
