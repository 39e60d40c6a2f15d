"""A policy with a tool-calling chat template rolls out through the pipeline in its own format.

The checkpoint (``tests/hf_checkpoints.py``: a tiny Qwen3-MoE with a Qwen3-style tool-calling
template on a BPE built here, fitted to call the ``python`` tool) is the run's ``policy.hf_dir``;
every role is its own process on a real broker. Checked from the topics: trajectories record a
``python`` call made in the template's ``<tool_call>`` JSON and run in the sandbox, the tools
offered through the template in the prompt, the tool's result as the template's ``tool``
message (loss mask 0) followed by a second generated turn, and the judge scores the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import decode_all, stop_procs, wait_for
from hf_checkpoints import tool_checkpoint

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import arrays, topics

pytestmark = pytest.mark.slow

SETS = [
    "policy.architecture=qwen3_moe",
    "groups_per_step=1",
    "group_size=2",
    "scheduler.max_tasks=2",
    "learner.warm_start.steps=0",
    "admission.reject_no_signal=false",
    "rollout.harness.max_new_tokens=48",
    "rollout.harness.temperature=0.05",
]


def test_a_tool_calling_template_drives_multi_turn_rollouts(kafka, unique_run, tmp_path: Path):
    run = unique_run
    ensure_run_topics(kafka, run)
    tool_checkpoint(tmp_path / "checkpoint")
    sets = [
        *SETS,
        f"policy.hf_dir={tmp_path / 'checkpoint'}",
        f"learner.state_dir={tmp_path / 'learner'}",
        f"learner.warm_start_cache={tmp_path / 'warm.pt'}",
    ]
    extra = [a for s in sets for a in ("--set", s)]
    roles = {
        "learner": ("learner",),
        "judge-tests": ("judge", "--name", "tests"),
        "rollout": ("rollout", "--member", "0"),
        "scheduler": ("scheduler",),
    }
    procs = {
        name: start_role(role, run, kafka, tmp_path, [*rest, *extra], name).proc
        for name, (role, *rest) in roles.items()
    }
    traj_topic = topics.topic_name(run, "trajectories")
    try:
        wait_for(lambda: len(decode_all(kafka, traj_topic)) >= 4, 300, procs)
        wait_for(lambda: len(decode_all(kafka, topics.topic_name(run, "rewards"))) >= 4, 120, procs)
    finally:
        stop_procs(procs)
    from rlstream.ops.run.config import load_run_config
    from rlstream.rollout.model import build_policy

    text = build_policy(load_run_config(None, sets).policy).text
    called = 0
    for d in decode_all(kafka, traj_topic):
        t = d.record
        calls = json.loads(t["outcome"]["details"].get("tool_calls", "[]"))
        tokens = arrays.unpack_tokens(t)
        prompt = text.tokenizer.decode(tokens.token_ids[: t["prompt_tokens"]].tolist())
        assert "<tools>" in prompt and '"name": "python"' in prompt  # offered via the template
        if not calls or calls[0]["tool"] != "python" or calls[0]["status"] != "ok":
            continue
        called += 1
        assert json.loads(calls[0]["input"])["name"] == "python"
        assert calls[0]["isolation"] in ("full", "userns")
        obs = text.encode(text.after_assistant([calls[0]["output"]]))
        flat = tokens.token_ids.tolist()
        at = next(i for i in range(len(flat)) if flat[i : i + len(obs)] == obs)
        mask = np.asarray(tokens.loss_mask)
        assert not mask[at : at + len(obs)].any() and mask[at + len(obs) :].any()
    assert called >= 2, "the policy called its tool in its own format"
