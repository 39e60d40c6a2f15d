"""The attack helpers ``bench chaos`` can call (``ops.chaos.attacks``), against live services on a
real broker: a policy server taking pushed weights (and serving a completion, recorded in the
served stream), feedback-ingest with an HMAC key and feedback-rl, and admission.

Properties: every attack is tried and every try is refused, as counted from what the run
answered or wrote: pushes without the token are answered 401 and the served version stays;
forged feedback on the served completion (and on a request never served) is stored by ingest
(the client is authenticated) but rejected by feedback-rl and trained never; a trajectory and a
reward of a task never released are dead-lettered by admission.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from test_events import examples
from test_serve_policy import POLICY, _post, _Serving

from rlstream.consumers.admission import Admission
from rlstream.consumers.admission_rules import AdmissionConfig
from rlstream.consumers.consumer import Stopper
from rlstream.consumers.feedback.rl import FeedbackRL, FeedbackRLConfig
from rlstream.ops.chaos import attacks
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.service import running_service
from rlstream.rollout.hf_policy import save_state_hf
from rlstream.rollout.model import build_policy
from rlstream.rollout.push_auth import PushConfig, UpdateWeightsRequest
from rlstream.rollout.serve import PolicyServer, make_app
from rlstream.schemas import topics
from rlstream.schemas.deltacodec.bits import from_torch, state_hash

TOKEN = "attacks-push-token-0123456789"
KEY = b"attacks-hmac-key"


def test_every_attack_is_tried_and_refused(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    torch.set_num_threads(1)

    # a policy server that takes pushed weights, serving version 0 (pushed with the token)
    push = PushConfig(token=TOKEN, weights_dir=tmp_path / "pushed")
    state = {k: v.detach().bfloat16() for k, v in build_policy(POLICY).state_dict().items()}
    save_state_hf(POLICY, state, tmp_path / "pushed" / "v0")
    digest = state_hash(from_torch(state))
    server = PolicyServer(
        kafka, run, "policy", POLICY, weights="push", push=push, signed_hash={0: digest}.get
    )  # the run's learner signed version 0 with this state
    server.push(
        UpdateWeightsRequest(
            model_path=str(tmp_path / "pushed" / "v0"), weight_version="0", state_hash=digest
        )
    )
    serving = _Serving(make_app(server))
    base = f"http://127.0.0.1:{serving.port}"
    try:
        status, answer = _post(
            f"{base}/v1/completions", {"model": "policy", "prompt": "f(x)", "max_tokens": 6}
        )
        assert status == 200, answer  # recorded in the served stream: the forged feedback names it
        pushes = attacks.unauthenticated_policy_push(
            base, model_path=str(tmp_path / "pushed" / "v0")
        )
        assert server.version == 0
    finally:
        serving.close()
        server.close()

    # forged feedback through an authenticated client, then feedback-rl
    cfg = fm.FeedbackServiceConfig(run=run, port=0, hmac_keys={"k1": KEY.decode()})
    with running_service(cfg, kafka, environ={fm.SALT_ENV: "s"}) as ingest:
        landed = attacks.forged_feedback_tokens(kafka, ingest.url, run, KEY)
    rl_cfg = FeedbackRLConfig(window_size=len(landed), window_seconds=0.5, min_group_size=2)
    FeedbackRL(kafka, run, rl_cfg, version=lambda: 0).run(Stopper(), idle_exit_s=3.0)
    feedback = attacks.feedback_refusals(kafka, run, landed)

    # a task never released, sent home as a rollout region would; admission decides
    names = topics.run_topics(run)
    with EventProducer.connect(kafka) as producer:  # what the run rolled out so far
        producer.produce(
            names["trajectories"], "trajectory", {**examples()["trajectory"], "run": run}, "g"
        )
        producer.produce(names["rewards"], "reward", {**examples()["reward"], "run": run}, "g")
    injected = attacks.unreleased_task(kafka, run, "t1")
    admission = Admission(kafka, run, AdmissionConfig(judges={"tests": 1.0}))
    stopper = Stopper()
    thread = threading.Thread(target=admission.loop.run, args=(stopper,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while admission.counts["unreleased"] < 4:  # the two genuine-looking ones, and ours
            assert thread.is_alive() and time.monotonic() < deadline, admission.counts
            time.sleep(0.2)
    finally:
        stopper.stop()
        thread.join(30)
        admission.close()
    unreleased = attacks.dead_lettered(kafka, run, injected)

    assert pushes.as_dict() == {"tried": 4, "refused": 4}
    assert feedback.as_dict() == {"tried": 4, "refused": 4}
    assert unreleased.as_dict() == {"tried": 2, "refused": 2}
