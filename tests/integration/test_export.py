"""``rlstream export``: a committed version rebuilt from the run's weight log as an HF folder
that transformers loads without rlstream and that hashes to the learner's state hash; a version
that is not in the log is a clear error."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import signed_run

from rlstream.ops.cli import main
from rlstream.ops.forensics.export import ExportError, export_version
from rlstream.ops.run.config import load_run_config
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.rollout.model import build_policy
from rlstream.schemas.deltacodec.bits import from_torch, state_hash
from rlstream.trainer.learner_step import published_state


def _publish(kafka, run: str, versions: int) -> list[str]:
    """Versions 0..versions-1 of the run's policy (a keyframe every 2), each a small change;
    returns their state hashes."""
    config = load_run_config(None, [])
    model = build_policy(config.policy)
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner", timeout=30)
    signer = signed_run(kafka, run)
    publisher = WeightPublisher(producer, run, config.model, keyframe_every=2, signer=signer)
    hashes = []
    for version in range(versions):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
        state = published_state(model, "bfloat16")
        publisher.publish_version(state, version, stats={"loss": 1.0})
        hashes.append(state_hash(state))
    return hashes


def test_a_version_exports_as_a_folder_transformers_loads(kafka, unique_run, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    ensure_run_topics(kafka, unique_run)
    hashes = _publish(kafka, unique_run, 4)
    config = load_run_config(None, [])
    note = export_version(kafka, unique_run, 1, tmp_path / "v1", config)
    assert (note["version"], note["state_hash"]) == (1, hashes[1])
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v1"), local_files_only=True)
    state = {k: v.bfloat16() for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    assert state_hash(from_torch(state)) == hashes[1]
    with torch.no_grad():  # it generates
        out = plain.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    args = ["export", "--run", unique_run, "--out", str(tmp_path / "newest"), "--json"]
    assert main([*args, "--bootstrap", kafka.bootstrap_servers]) == 0
    assert (tmp_path / "newest" / "config.json").is_file()


def test_a_version_not_in_the_log_is_refused(kafka, unique_run, tmp_path: Path):
    ensure_run_topics(kafka, unique_run)
    _publish(kafka, unique_run, 2)
    config = load_run_config(None, [])
    try:
        export_version(kafka, unique_run, 7, tmp_path / "v7", config)
    except ExportError as exc:
        assert "version 7" in str(exc) and "0..1" in str(exc)
    else:
        raise AssertionError("exported a version the log does not hold")
    assert not (tmp_path / "v7").exists()
