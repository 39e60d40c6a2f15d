"""Supervised warm start ("mid-training") on a weak teacher's demonstrations.

Rules and guarantees:

- Each step draws fresh training tasks (seeds below ``EVAL_SEED_BASE``, never the evaluation
  set) and one demonstration each, through the task-family interface (``envs.family``:
  ``sample`` and ``demonstration`` of the ``fx`` family, whose weak teacher it imitates); the loss
  is next-token cross-entropy on the answer and its EOS only (the prompt is context), plus a small
  Switch-style load-balancing term so every expert gets used.
- The result depends only on the policy config and this config: same seeds, same data order,
  single-threaded CPU math -> the same weights.
- Because the teacher is unreliable (``TeacherConfig``), the warm-started policy knows the format
  and the vocabulary but succeeds only sometimes: RL has room to improve.
- With ``cache_path`` the state dict is stored there under a key of both configs; a later call
  with the same configs loads it instead of training.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlstream.envs import fx_tasks as tasks
from rlstream.envs.family import EVAL_SEED_BASE, FamilySpec, families
from rlstream.rollout.config import LoraConfig, PolicyConfig
from rlstream.rollout.model import PolicyModel, build_policy
from rlstream.rollout.text import PolicyText
from rlstream.schemas.derive import derive
from rlstream.trainer.config import WarmStartConfig

#: The family whose teacher the warm start imitates (its ``demonstration``).
TEACHING = "fx"


def demo_batch(
    rng: random.Random,
    n: int,
    teacher: tasks.TeacherConfig,
    task_cfg: tasks.TaskConfig,
    text: PolicyText | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` demonstrations of the ``fx`` family of difficulty ``task_cfg`` as (tokens ``[n, T]``
    right-padded, target mask ``[n, T]``) in the policy's ``text`` (default: the demo's
    character tokenizer).

    Rule: a row is ``prompt answer EOS`` (``text.prompt``: BOS, or the chat template); the mask
    is 1 on answer and EOS tokens only.
    """
    text = text or PolicyText.chars()
    spec = FamilySpec(plugin=TEACHING, options=task_cfg.model_dump())
    teaching = families({TEACHING: spec})[TEACHING]
    rows, masks = [], []
    for _ in range(n):
        task = teaching.sample(rng.randrange(EVAL_SEED_BASE), "train")
        prompt = text.prompt(task.prompt)
        answer = [*text.encode(teaching.demonstration(task, rng, teacher)), text.eos_ids[0]]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, rows))
    tokens = torch.full((n, width), text.pad_id, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, (row, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return tokens, mask


def cache_key(policy_cfg: PolicyConfig, cfg: WarmStartConfig) -> str:
    """Hash of both configs: a cached state dict is reused only for the same ones (LoRA is no
    part of it: the warm start trains the full weights, adapters come after it)."""
    text = policy_cfg.model_dump_json(exclude={"lora"}) + cfg.model_dump_json()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def warm_start(
    policy_cfg: PolicyConfig,
    cfg: WarmStartConfig | None = None,
    cache_path: str | None = None,
    log: Callable[[str], None] | None = None,
) -> PolicyModel:
    """A policy trained on demonstrations (or loaded from ``cache_path`` when the key matches),
    without LoRA adapters whatever ``policy_cfg.lora`` says (the learner adds them after). With
    0 steps (a pretrained ``hf_dir`` model, by default) the policy as built, nothing cached."""
    cfg = (cfg or WarmStartConfig()).resolved(policy_cfg)
    model = build_policy(derive(policy_cfg, lora=LoraConfig()))
    if cfg.steps == 0:
        if log:
            log("warm start: off (0 steps): version 0 is the model as loaded")
        return model
    key = cache_key(policy_cfg, cfg)
    if cache_path and os.path.exists(cache_path):
        stored = torch.load(cache_path, map_location="cpu", weights_only=True)
        if stored.get("key") == key:
            model.load_state_dict(stored["state_dict"])
            return model
    _train(model, cfg, log)
    if cache_path:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        tmp = f"{cache_path}.tmp{os.getpid()}"
        torch.save({"key": key, "state_dict": model.state_dict()}, tmp)
        os.replace(tmp, cache_path)  # readers never see a half-written file
    return model


def _train(model: PolicyModel, cfg: WarmStartConfig, log: Callable[[str], None] | None) -> None:
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98))
    started = time.perf_counter()
    model.train()
    steps = int(cfg.steps or 0)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / 20)
        tokens, mask = demo_batch(rng, cfg.batch_size, cfg.teacher, cfg.task, model.text)
        logits, _ = model(tokens[:, :-1])
        nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        total = loss + cfg.balance_coef * model.load_balance_loss()
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log and (step % 50 == 0 or step == steps - 1):
            elapsed = time.perf_counter() - started
            log(f"warm-start step {step:4d}  loss {float(loss.detach()):.3f}  {elapsed:5.1f}s")
    model.eval()
