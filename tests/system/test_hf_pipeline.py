"""The pipeline pointed at a Hugging Face checkpoint directory (``policy.hf_dir``: a tiny
Qwen3-MoE, and a tiny dense Llama, whose tokenizer is a BPE with a chat template,
``tests/hf_checkpoints.py``), every role its own process, on a real broker. A short run checks:
- every trajectory's prompt is the checkpoint's own tokenizer's chat template of its task;
- every published version is keyed by transformers' own parameter names and shapes, the tied
  ``lm_head.weight`` held once (as ``model.embed_tokens.weight``);
- versions are consecutive and every group a step trained on was admitted, once;
- replaying the recorded admitted stream reproduces every version bit-exactly;
- the final version written as an HF directory (what ``rlstream demo`` does) loads with
  ``AutoModelForCausalLM.from_pretrained`` and hashes to the manifest's state hash.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
from helpers import decode_all, stop_procs, wait_for
from hf_checkpoints import bpe_checkpoint

from rlstream.ops.demo.demo import start_role
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.schemas import topics

pytestmark = pytest.mark.slow

VERSIONS = 3
SETS = [
    "groups_per_step=2",
    "group_size=4",
    "max_staleness=2",
    f"scheduler.max_tasks={2 * VERSIONS + 2}",
    "learner.warm_start.steps=20",
    "learner.keyframe_every=2",
    "admission.reject_no_signal=false",
    "rollout.harness.max_new_tokens=16",
]


def _sets(tmp: Path) -> list[str]:
    return [
        *SETS,
        f"policy.hf_dir={tmp / 'checkpoint'}",
        f"learner.state_dir={tmp / 'learner'}",
        f"learner.warm_start_cache={tmp / 'warm.pt'}",
    ]


def _manifests(kafka, run: str) -> list[dict]:
    return [d.record for d in decode_all(kafka, topics.topic_name(run, "weights.manifests"))]


@pytest.mark.parametrize("dense", [False, True], ids=["qwen3_moe", "llama"])
def test_hf_policy_runs_the_pipeline_keyed_by_hf_names(kafka, unique_run, tmp_path, dense):
    run = unique_run
    ensure_run_topics(kafka, run)
    bpe_checkpoint(tmp_path / "checkpoint", dense=dense)
    extra = [a for s in _sets(tmp_path) for a in ("--set", s)]
    roles = {
        "learner": ("learner",),
        "admission": ("admission",),
        "judge-tests": ("judge", "--name", "tests"),
        "judge-format": ("judge", "--name", "format"),
        "rollout": ("rollout", "--member", "0"),
        "scheduler": ("scheduler",),
    }
    procs = {
        name: start_role(role, run, kafka, tmp_path, [*rest, *extra], name).proc
        for name, (role, *rest) in roles.items()
    }
    try:
        wait_for(
            lambda: max((m["version"] for m in _manifests(kafka, run)), default=-1) >= VERSIONS,
            420,
            procs,
        )
        manifests = _manifests(kafka, run)
        _check_hf_names(manifests, _sets(tmp_path))
        _check_prompts_are_the_checkpoints_tokens(kafka, run, _sets(tmp_path))
        versions = [m["version"] for m in manifests if m["kind"] == "delta" or m["version"] == 0]
        assert versions == list(range(len(versions))), f"versions not consecutive: {versions}"
        _check_trained_groups_admitted(kafka, run)
    finally:
        stop_procs(procs)
    last = _manifests(kafka, run)[-1]
    config = _check_replay_is_bit_exact(kafka, run, tmp_path, int(last["version"]))
    _check_final_model_dir(kafka, run, config, last, tmp_path)


def _check_hf_names(manifests: list[dict], sets: list[str]) -> None:
    from rlstream.ops.run.config import load_run_config
    from rlstream.rollout.model import build_policy

    model = build_policy(load_run_config(None, sets).policy)
    want = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert "lm_head.weight" not in want and "model.embed_tokens.weight" in want
    routed = any(".mlp.experts." in k for k in want) and any(".mlp.gate." in k for k in want)
    assert routed == (model.hf.config.model_type == "qwen3_moe")  # a dense Llama: no router
    for m in manifests:
        got = {e["name"]: list(e["shape"]) for e in m["tensors"]}
        assert got == want, f"version {m['version']} is not keyed by the HF names and shapes"


def _check_prompts_are_the_checkpoints_tokens(kafka, run: str, sets: list[str]) -> None:
    from rlstream.ops.run.config import load_run_config
    from rlstream.rollout.model import build_policy
    from rlstream.schemas import arrays

    text = build_policy(load_run_config(None, sets).policy).text
    prompts = {
        d.record["task_id"]: d.record["prompt"]
        for d in decode_all(kafka, topics.topic_name(run, "tasks"))
    }
    firsts = [
        d.record
        for d in decode_all(kafka, topics.topic_name(run, "trajectories"))
        if d.record["segment_index"] == 0
    ]
    assert firsts
    for t in firsts:
        ids = arrays.unpack_tokens(t).token_ids[: t["prompt_tokens"]].tolist()
        assert ids == text.prompt(prompts[t["task_id"]]), t["task_id"]
        assert text.decode(ids).startswith("user\n")  # ChatML, its specials dropped


def _check_trained_groups_admitted(kafka, run: str) -> None:
    from rlstream.ops.observe.ledger import trained_groups

    admitted = {
        d.record["group_id"]
        for d in decode_all(kafka, topics.topic_name(run, "admitted"))
        if d.record["part_index"] == 0
    }
    trained = collections.Counter(trained_groups(kafka, run))
    assert len(trained) >= 2 * VERSIONS, trained
    assert set(trained) <= admitted and max(trained.values()) == 1


def _check_replay_is_bit_exact(kafka, run: str, tmp: Path, last_version: int):
    from rlstream.ops.forensics.replay import replay
    from rlstream.ops.run.config import load_run_config
    from rlstream.ops.run.recorded import record_run_manifest

    config = load_run_config(None, _sets(tmp))
    record_run_manifest(kafka, run, config, "finished", int(time.time() * 1000), ["trainer"])
    result = replay(kafka, run, log=lambda _: None)
    assert result.diverged_at is None, result.detail
    assert result.versions >= last_version >= VERSIONS
    return config


def _check_final_model_dir(kafka, run: str, config, last: dict, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlstream.ops.demo.demo import final_model
    from rlstream.schemas.deltacodec.bits import from_torch, state_hash

    result = final_model(kafka, run, config, int(last["version"]), tmp / "out")
    assert result["final_version"] == last["version"]
    assert result["final_state_hash"] == last["state_hash"]
    plain = AutoModelForCausalLM.from_pretrained(result["model_dir"], local_files_only=True)
    assert plain.config.model_type == config.policy.architecture  # qwen3_moe, or llama
    state = {k: v.bfloat16() for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    assert state_hash(from_torch(state)) == last["state_hash"]
