"""Lineage and forgetting on a real broker, through real-time RL's own path.

A learner (the real role, its own process) trains one online group per version: ``serve policy``
answers one request with three choices, three editor users (alice, bob, carol) send feedback on
them through feedback-ingest, feedback-rl admits the group. Three rounds make versions 1..3;
alice gives feedback in round 2 only.

Properties:
- lineage of every version lists exactly the admitted records its manifest names, each sample
  with its served record, task, rewards and feedback (user hash, never the raw id);
  ``--sample`` on alice's feedback record finds version 2 only;
- forget of alice's hash writes a new run whose first affected version is 2 and whose versions
  differ from the original's from 2 on only (1 is bit for bit the same); lineage of the new run
  finds nothing of alice; replay of the new run is bit-exact; the exclusion is in the new run's
  manifest and in ``rl.audit``;
- an interrupted forget leaves the new run ``running`` (never ``finished``) and a second forget
  finishes it; bad input (unknown run, unknown hash, malformed record) is an error and writes
  nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from typing import Any

import pytest
from helpers import decode_all, stop_procs, wait_for
from test_feedback_ingest import TOKEN, post_json
from test_serve_policy import _post, _Serving
from test_served_feedback import _wait_for_version

from rlstream.consumers.consumer import Stopper
from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
from rlstream.consumers.run_log import run_manifest
from rlstream.ops.cli import main
from rlstream.ops.demo.demo import start_role
from rlstream.ops.forensics import forget as forget_module
from rlstream.ops.forensics.replay import replay
from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.recorded import record_run_manifest
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.service import running_service
from rlstream.rollout.serve import PolicyServer, make_app
from rlstream.schemas import topics

SALT = "lineage-salt"
USERS = ("alice", "bob", "carol")
ROUNDS = [("bob", "carol", "bob"), ("alice", "bob", "carol"), ("carol", "bob", "carol")]
ACTIONS = ("accepted", "rejected", "dissatisfied")
SETS = [
    "learner.warm_start.steps=0",
    "groups_per_step=1",
    "learner.max_versions=3",
    "policy.vocab_size=128",
    "policy.d_model=32",
    "policy.n_heads=2",
    "policy.d_expert=32",
    "policy.max_seq_len=128",
]


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def _round(base: str, ingest_url: str, kafka: KafkaSettings, run: str, r: int) -> None:
    """One request of three choices, one feedback per choice, one admitted online group."""
    status, answer = _post(
        f"{base}/v1/completions",
        {"model": "policy", "prompt": f"round {r}:", "max_tokens": 6, "n": 3, "seed": r},
    )
    assert status == 200, answer
    events_ = [
        {
            "feedback_id": f"fb-{r}-{c}",
            "request_id": answer["request_id"],
            "policy_version": answer["policy_version"],
            "model": "policy",
            "action": ACTIONS[c],
            "user_id": user,
            "task_class": "tab",
            "metadata": {"choice": str(c)},
        }
        for c, user in enumerate(ROUNDS[r - 1])
    ]
    status, _, body = post_json(ingest_url, {"events": events_})
    assert status == 202 and body["accepted"] == 3, body
    cfg = FeedbackRLConfig(window_size=3, window_seconds=1.0, min_group_size=2)
    counts = FeedbackRL(kafka, run, cfg).run(Stopper(), idle_exit_s=3.0)
    assert counts["served_found"] >= 3, counts


@pytest.fixture(scope="module")
def trained(kafka: KafkaSettings, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run of three versions trained on editor feedback (see the module docstring)."""
    tmp = tmp_path_factory.mktemp("lineage")
    run = f"lineage-{int(time.time() * 1000) % 10**9}"
    sets = [*SETS, f"learner.state_dir={tmp / 'learner'}"]
    config = load_run_config(None, sets)
    ensure_run_topics(kafka, run)
    record_run_manifest(kafka, run, config, "running", int(time.time() * 1000), ["trainer"])
    args = [a for s in sets for a in ("--set", s)]
    procs = {"learner": start_role("learner", run, kafka, tmp, args, "learner").proc}
    policy = config.role("learner").policy  # type: ignore[attr-defined]
    server = PolicyServer(kafka, run, "policy", policy)
    serving = _Serving(make_app(server))
    base = f"http://127.0.0.1:{serving.port}"
    cfg = fm.FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN], durable_dedupe=False)
    try:
        with running_service(cfg, settings=kafka, environ={fm.SALT_ENV: SALT}) as ingest:
            for r in range(1, len(ROUNDS) + 1):
                _wait_for_version(base, r - 1, timeout=90)
                _round(base, ingest.url, kafka, run, r)
        wait_for(lambda: procs["learner"].poll() is not None, 120, {})
        assert procs["learner"].returncode == 0
    finally:
        serving.close()
        server.close()
        stop_procs(procs)
    record_run_manifest(kafka, run, config, "finished", int(time.time() * 1000), ["trainer"])
    salt = SALT.encode()
    return {"run": run, "hashes": {u: fm.hash_user(u, salt) for u in USERS}}


def _manifests(kafka: KafkaSettings, run: str) -> dict[int, dict[str, Any]]:
    out = {}
    for d in decode_all(kafka, topics.topic_name(run, "weights.manifests")):
        out[d.record["version"]] = d.record
    return out


def _lineage(kafka: KafkaSettings, run: str, *extra: str) -> list[dict[str, Any]]:
    rc, out = cli("lineage", "--run", run, "--json", "--bootstrap", kafka.bootstrap_servers, *extra)
    assert rc == 0, out
    return [json.loads(line) for line in out.splitlines()]


def test_lineage_of_each_version_is_its_manifests_admitted_records(kafka, trained) -> None:
    run, hashes = trained["run"], trained["hashes"]
    manifests = _manifests(kafka, run)
    found = _lineage(kafka, run, "--version", "3", "--since-version", "1")
    assert [f["version"] for f in found] == [1, 2, 3]
    for f in found:
        named = manifests[f["version"]]["step_inputs"]
        assert named, f"version {f['version']} trained on nothing"
        assert {json.dumps(s["admitted"], sort_keys=True) for s in f["samples"]} == {
            json.dumps(r, sort_keys=True) for r in named
        }
        users = [s["feedback"]["user_hash"] for s in f["samples"]]
        assert users == [hashes[u] for u in ROUNDS[f["version"] - 1]]
        for s in f["samples"]:
            assert set(s) >= {"trajectory", "task", "rewards", "feedback"}
            assert s["trajectory"]["topic"] == topics.topic_name(run, "served")
            assert s["trajectory"]["engine"] == "serve" and s["trajectory"]["worker"]
            assert s["feedback"]["served"] == {
                k: s["trajectory"][k] for k in ("topic", "partition", "offset")
            }
            assert {r["judge"] for r in s["rewards"]} == {"feedback", "baseline"}
    text = json.dumps(found)
    assert not any(f'"{u}"' in text for u in USERS), "a raw user id in lineage"
    alice = next(s for s in found[1]["samples"] if s["feedback"]["user_hash"] == hashes["alice"])
    fb = _feedback_position(kafka, run, alice["feedback"]["feedback_id"])
    [reverse] = _lineage(kafka, run, "--sample", fb)
    assert reverse["versions"] == [2]


def _feedback_position(kafka: KafkaSettings, run: str, feedback_id: str) -> str:
    from helpers import read_all

    from rlstream.schemas import events

    topic = topics.topic_name(run, "feedback")
    [where] = [
        f"{topic}:{m.partition()}:{m.offset()}"
        for _, value, m in read_all(kafka, topic)
        if events.decode(value).record["feedback_id"] == feedback_id
    ]
    return where


def test_bad_input_is_an_error_and_writes_nothing(kafka, trained) -> None:
    run, boot = trained["run"], kafka.bootstrap_servers
    before = _audits(kafka)
    for argv in (
        ("forget", "--run", "no-such-run", "--user-hash", "ab" * 16),
        ("forget", "--run", run, "--user-hash", "ab" * 16),
        ("forget", "--run", run, "--record", "not-a-position"),
        ("forget", "--run", run, "--record", f"{topics.topic_name(run, 'feedback')}:0:99999"),
        ("forget", "--run", run),
        ("lineage", "--run", run, "--version", "99"),
        ("lineage", "--run", "no-such-run"),
    ):
        rc, out = cli(*argv, "--bootstrap", boot)
        assert rc == 2 and out == "", (argv, out)
    assert _audits(kafka) == before


def _audits(kafka: KafkaSettings) -> list[dict[str, Any]]:
    return [d.record for d in decode_all(kafka, topics.AUDIT_TOPIC)]


def test_forget_a_user_recomputes_from_the_first_affected_version(
    kafka, trained, monkeypatch
) -> None:
    run, hashes = trained["run"], trained["hashes"]
    boot = kafka.bootstrap_servers
    original = forget_module._recompute

    def interrupted(*args: Any, **kw: Any) -> list[int]:
        raise RuntimeError("killed mid-forget")

    monkeypatch.setattr(forget_module, "_recompute", interrupted)
    with pytest.raises(RuntimeError, match="killed mid-forget"):
        cli("forget", "--run", run, "--user-hash", hashes["alice"], "--bootstrap", boot)
    new_run = forget_module.new_run_name(run, [hashes["alice"]], [])
    assert run_manifest(kafka, new_run)["status"] == "running"  # never finished
    monkeypatch.setattr(forget_module, "_recompute", original)

    rc, out = cli(
        "forget", "--run", run, "--user-hash", hashes["alice"], "--json", "--bootstrap", boot
    )
    assert rc == 0, out
    result = json.loads(out)
    assert set(result) == {
        "run", "new_run", "first_affected_version", "excluded_records", "versions_differ"
    }  # fmt: skip
    assert result["run"] == run and result["new_run"] == new_run
    assert result["first_affected_version"] == 2
    assert result["versions_differ"] == [2, 3]  # 0 and 1 bit for bit the same
    old, new = _manifests(kafka, run), _manifests(kafka, new_run)
    assert [new[v]["state_hash"] == old[v]["state_hash"] for v in range(4)] == [
        True, True, False, False
    ]  # fmt: skip

    found = _lineage(kafka, new_run, "--version", "3", "--since-version", "1")
    users = [[s["feedback"]["user_hash"] for s in f["samples"]] for f in found]
    assert users == [[hashes[u] for u in r if u != "alice"] for r in ROUNDS]
    manifest = run_manifest(kafka, new_run)
    assert manifest["status"] == "finished" and manifest["parent_run"] == run
    assert manifest["excluded_user_hashes"] == [hashes["alice"]]
    assert manifest["recomputed_from"] == 2
    assert manifest["excluded_records"] == result["excluded_records"]
    audits = [a for a in _audits(kafka) if a["new_run"] == new_run]
    assert [a["status"] for a in audits] == ["started", "started", "finished"]
    assert audits[-1]["versions_differ"] == [2, 3]

    replayed = replay(kafka, new_run, log=lambda _: None)
    assert replayed.diverged_at is None and replayed.versions == 3, replayed.detail

    rc, _ = cli("forget", "--run", run, "--user-hash", hashes["alice"], "--bootstrap", boot)
    assert rc == 2  # already done: refused, nothing written


def test_tracker_writes_the_runs_metrics_to_mlflow(kafka, trained, tmp_path) -> None:
    """The tracker role on the run: MLflow's own client reads each version's learner figures
    back at their version, the recipe as params, and the artifacts it was given."""
    mlflow = pytest.importorskip("mlflow")
    import threading

    from rlstream.consumers.consumer import RoleContext
    from rlstream.ops.observe.tracker import TrackerConfig, run_role

    run = trained["run"]
    (tmp_path / "success_by_version.png").write_bytes(b"\x89PNG not really")
    cfg = TrackerConfig(artifacts_dir=str(tmp_path), interval_s=1.0)
    stopper = Stopper()
    threading.Timer(8.0, stopper.stop).start()
    result = run_role(RoleContext(kafka, run, cfg, stopper))
    where = json.loads((tmp_path / "tracking.json").read_text())
    assert where == {"backend": "mlflow", "uri": result["uri"], "run_id": result["run_id"]}
    client = mlflow.tracking.MlflowClient(where["uri"])
    tracked = client.get_run(where["run_id"])
    assert tracked.data.tags["rlstream.run"] == run and tracked.info.status == "FINISHED"
    assert tracked.data.params["learner.max_versions"] == "3"
    manifests = _manifests(kafka, run)
    loss = {m.step: m.value for m in client.get_metric_history(where["run_id"], "learner.loss")}
    assert loss == {v: pytest.approx(manifests[v]["stats"]["loss"]) for v in (1, 2, 3)}
    assert [a.path for a in client.list_artifacts(where["run_id"])] == ["success_by_version.png"]
    again = run_role(RoleContext(kafka, run, cfg, _stopped()))  # a restart: the same run
    assert again["run_id"] == where["run_id"]
    assert len(client.get_metric_history(where["run_id"], "learner.loss")) == 3  # not again


def _stopped() -> Stopper:
    stopper = Stopper()
    stopper.stop()
    return stopper
