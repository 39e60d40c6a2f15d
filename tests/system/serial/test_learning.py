"""The main job learns: a short ``rlstream demo`` on the local cluster raises the success rate
of the policy's own samples well above the warm-start policy's (version 0). With ``--feedback``
simulated editor users' feedback on served completions is trained on beside the rollouts, and
``rlstream lineage`` traces it to the users' hashes.

Both demos keep their runs under one folder of the session (``_runs``): the second reuses the
first one's cached warm start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlstream.ops import cluster
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

pytestmark = pytest.mark.slow


def _runs(cluster_home):
    return cluster_home.parent / "demo-runs"


def _demo(cluster_home, run: str, *args: str) -> dict:
    """``rlstream demo --json`` on the session's cluster; its result line."""
    if KafkaSettings.from_env() is not None:
        pytest.skip("the demo runs on the local launcher's cluster")
    cmd = [sys.executable, "-m", "rlstream", "demo", "--json", "--run", run, *args]
    cmd += ["--out", str(_runs(cluster_home)), "--home", str(cluster_home)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    finally:  # the demo leaves its rollout region running; the tests after it need none
        rollout = [r for r in cluster.load(cluster_home).regions if r != "trainer"]
        cluster.down(home=cluster_home, log=lambda *_: None, only=rollout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_short_demo_run_learns(kafka, cluster_home, unique_run):
    result = _demo(
        cluster_home,
        unique_run,
        "--minutes",
        "7",  # a ceiling for busy cores: the run ends at --max-versions, in about 2 min alone
        "--max-versions",
        "50",
        *("--set", "eval.eval_tasks=8", "--set", "eval.k=2"),  # eval is not what this checks
    )
    assert result["policy_versions"] >= 40, result
    model = {"architecture": "qwen3_moe", "params": 238_464, "source": "built-in"}
    assert result["model"] == model, result["model"]  # the demo's own tiny Qwen3-MoE
    assert result["generate_tokens_per_s"] > 0 and result["train_tokens_per_s"] > 0, result
    assert result["final_success"] >= result["warm_start_success"] + 0.1, result
    assert (
        result["groups_admitted"] > 0
        and (_runs(cluster_home) / unique_run / "success_by_version.png").exists()
    )
    # the final policy is an ordinary HF directory holding exactly the learner's final weights
    import transformers

    from rlstream.schemas import deltacodec

    model = transformers.AutoModelForCausalLM.from_pretrained(result["model_dir"])
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert deltacodec.state_hash(deltacodec.from_torch(state)) == result["final_state_hash"]
    _check_tracking(result)


def _check_tracking(result: dict) -> None:
    """The demo's tracker wrote the run to MLflow: its own client reads the success by version,
    the learner's losses, the recipe and the final plot and model back."""
    import mlflow

    tracking = result["tracking"]
    assert tracking is not None and tracking["backend"] == "mlflow", result
    client = mlflow.tracking.MlflowClient(tracking["uri"])
    run_id = tracking["run_id"]
    tracked = client.get_run(run_id)
    assert tracked.info.status == "FINISHED" and tracked.data.params["learner.max_versions"] == "50"
    success = {m.step: m.value for m in client.get_metric_history(run_id, "success")}
    assert len(success) >= 10 and all(0.0 <= s <= 1.0 for s in success.values()), success
    loss = client.get_metric_history(run_id, "learner.loss")
    assert {m.step for m in loss} == set(range(1, result["policy_versions"] + 1))
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"success_by_version.png", "model"} <= names, names
    assert any(a.path.endswith("config.json") for a in client.list_artifacts(run_id, "model"))


def test_demo_trains_on_editor_feedback_beside_the_rollouts(kafka, cluster_home, unique_run):
    result = _demo(
        cluster_home,
        unique_run,
        *("--regions", "trainer", "--feedback", "2", "--minutes", "5", "--max-versions", "15"),
        *("--set", "eval.eval_tasks=4", "--set", "eval.k=1"),
    )
    fb = result["feedback"]
    assert fb["users"] == 2 and fb["requests"] > 0, fb
    assert fb["stored"] == fb["accepted"] + fb["rejected"] > 0, fb  # every feedback stored
    assert fb["online_groups_trained"] >= 1 and fb["online_versions"], fb
    assert result["groups_admitted"] > fb["online_groups_admitted"], result  # beside rollouts
    # lineage traces the trained online samples to the editors' feedback, by user hash only
    lineage = ["lineage", "--run", unique_run, "--json", "--version", str(fb["online_versions"][0])]
    found = subprocess.run(
        [sys.executable, "-m", "rlstream", *lineage, "--bootstrap", kafka.bootstrap_servers],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    [line] = found.stdout.splitlines()
    samples = json.loads(line)["samples"]
    online = [s for s in samples if s["feedback"] is not None]
    assert online, "no trained sample traced to editor feedback"
    served = topics.topic_name(unique_run, "served")
    for s in online:
        assert s["trajectory"]["topic"] == served and s["feedback"]["served"]["topic"] == served
        assert s["feedback"]["user_hash"] not in ("editor-0", "editor-1")
        assert {r["judge"] for r in s["rewards"]} >= {"feedback"}
    assert len({s["feedback"]["user_hash"] for s in online}) <= 2
