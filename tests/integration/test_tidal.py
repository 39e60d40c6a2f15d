"""Tidal capacity on a real broker: the capacity role reads a serving engine's /metrics over HTTP
and reclaims at a burst; lent rollout workers join and leave with the signal; a reclaim in the
middle of a long rollout is handed on as a checkpoint and resumed by another worker with the same
tokens; a region that lends nothing gets no new task."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import read_all, signed_run

from rlstream.consumers.capacity_log import CapacityView
from rlstream.consumers.consumer import RoleContext, Stopper
from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.roles import role_config
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.publisher import WeightPublisher
from rlstream.producers.weights.signing import Verifier
from rlstream.rollout import capacity as cap
from rlstream.rollout import scheduler
from rlstream.rollout.checkpoint import GroupCheckpoint
from rlstream.rollout.model import build_policy
from rlstream.rollout.worker import RolloutWorker, lent_loops
from rlstream.schemas import arrays, events, topics
from rlstream.schemas.derive import derive
from rlstream.trainer.learner_step import published_state

pytestmark = pytest.mark.timeout(300)


class Signal:
    """Plays a region's capacity role: publishes ``lent`` every 0.3 s until closed."""

    def __init__(self, kafka: KafkaSettings, run: str, region: str = "trainer") -> None:
        self.lent, self.kafka, self.run, self.region = 0, kafka, run, region
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        cfg = cap.CapacityConfig(engines=2, min_serving=0)
        topic = topics.topic_name(self.run, "capacity")
        with EventProducer.connect(self.kafka) as producer:
            while not self._stop.is_set():
                reading = cap.Reading(busy=float(2 - self.lent))
                rec = cap.capacity_record(
                    self.run, self.region, cfg, "test", reading, self.lent, ""
                )
                producer.produce(topic, "capacity", rec, topics.record_key("capacity", rec))
                producer.flush()
                self._stop.wait(0.3)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _records(kafka: KafkaSettings, run: str, stream: str) -> list[dict[str, Any]]:
    return [events.decode(v).record for _, v, _ in read_all(kafka, topics.topic_name(run, stream))]


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _start(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_reclaim_mid_rollout_resumes_elsewhere_with_the_same_tokens(
    kafka: KafkaSettings, unique_run: str
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    config = load_run_config(None, [])
    model = build_policy(config.policy)
    producer = EventProducer.transactional(kafka, f"rlstream.{run}.learner", timeout=30)
    publisher = WeightPublisher(producer, run, config.model, signer=signed_run(kafka, run))
    publisher.publish_version(published_state(model, "bfloat16"), 0)

    rollout_cfg: Any = role_config(config, "rollout")
    harness = derive(rollout_cfg.harness, max_new_tokens=160, max_turns=0)
    rollout_cfg = derive(rollout_cfg, lent=True, harness=harness, torch_threads=1)
    sched_cfg = derive(
        role_config(config, "scheduler"),
        max_tasks=1,
        follow_capacity=True,
        max_turns=0,
        group_size=4,
    )
    signal = Signal(kafka, run)
    stoppers = {name: Stopper() for name in ("scheduler", "a", "c")}
    released = _start(
        lambda: scheduler.run_role(RoleContext(kafka, run, sched_cfg, stoppers["scheduler"]))
    )
    try:
        time.sleep(4)  # a live signal that lends nothing: no task is released
        assert _records(kafka, run, "tasks") == []

        ctx_a = RoleContext(kafka, run, rollout_cfg, stoppers["a"], member="0")
        worker_a = RolloutWorker(kafka, run, rollout_cfg, "0", verifier=Verifier.given(ctx_a.keys))
        worker_a.wait_for_weights(stoppers["a"])
        asked = [0]

        def reclaim_mid_rollout() -> bool:  # the engine asks before every sampling step
            asked[0] += 1
            if asked[0] == 40:  # serving takes the engine back 40 tokens in
                signal.lent = 0
                deadline = time.monotonic() + 20
                while worker_a.lease is not None and worker_a.lease.active():
                    assert time.monotonic() < deadline, "the worker never saw the reclaim"
                    time.sleep(0.05)
            return worker_a.reclaimed()

        worker_a.engine.stop = reclaim_mid_rollout  # type: ignore[attr-defined]
        thread_a = _start(lambda: lent_loops(ctx_a, worker_a))
        signal.lent = 1
        _until(lambda: _records(kafka, run, "preempted"), 90, "the reclaimed group")
        stoppers["a"].stop()
        thread_a.join(timeout=30)
        worker_a.close()
        (cut,) = _records(kafka, run, "preempted")
        assert cut["attempt"] == 0 and cut["worker_id"] == "trainer-0"
        ck = GroupCheckpoint.from_bytes(cut["checkpoint"])
        assert cut["generated_tokens"] == ck.generated > 0 and any(r.open for r in ck.rows)
        assert worker_a.preempted == 1 and _records(kafka, run, "trajectories") == []

        time.sleep(2)  # lending nothing: the reclaimed group waits for an engine
        assert [t["attempt"] for t in _records(kafka, run, "tasks")] == [0]

        ctx_c = RoleContext(kafka, run, rollout_cfg, stoppers["c"], member="0")
        worker_c = RolloutWorker(kafka, run, rollout_cfg, "0", verifier=Verifier.given(ctx_c.keys))
        worker_c.wait_for_weights(stoppers["c"])
        thread_c = _start(lambda: lent_loops(ctx_c, worker_c))
        signal.lent = 1
        _until(lambda: len(_records(kafka, run, "trajectories")) >= 4, 120, "the resumed group")
        stoppers["c"].stop()
        thread_c.join(timeout=30)
        worker_c.close()
        assert worker_c.resumed == 1

        tasks = _records(kafka, run, "tasks")
        assert [t["attempt"] for t in tasks] == [0, 1]
        assert tasks[0]["checkpoint"] is None and tasks[1]["checkpoint"] == cut["checkpoint"]
        samples = sorted(_records(kafka, run, "trajectories"), key=lambda r: r["sample_index"])
        assert len(samples) == 4  # one record a sample at this size
        for rec, row in zip(samples, ck.rows, strict=True):
            got = arrays.unpack_tokens(rec)
            t = len(row.tokens)
            assert np.array_equal(got.token_ids[:t], row.tokens)  # nothing generated twice
            assert np.array_equal(got.logprobs[:t], row.logprobs)
            assert rec["worker_id"] == "trainer-0" and rec["policy_version"] == 0
    finally:
        for stopper in stoppers.values():
            stopper.stop()
        released.join(timeout=30)
        signal.close()


class _Metrics(http.server.BaseHTTPRequestHandler):
    """A serving engine's /metrics in vLLM's names, whatever ``page`` holds now."""

    page = ""

    def do_GET(self) -> None:
        body = type(self).page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _page(running: int, waiting: int) -> str:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
    )


def test_a_serving_burst_reclaims_within_one_interval(
    kafka: KafkaSettings, unique_run: str
) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    _Metrics.page = _page(running=2, waiting=0)  # 2 of 4 engines' slots busy (8 slots each)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    _start(server.serve_forever)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    cfg = cap.CapacityConfig(
        engines=4, source="metrics", metrics_urls=[url], slots_per_engine=8, interval_s=0.5,
        raise_step=4, headroom=0.25, min_serving=1,
    )  # fmt: skip
    stopper = Stopper()
    role = _start(lambda: cap.run_role(RoleContext(kafka, run, cfg, stopper)))
    view = CapacityView(kafka, [topics.topic_name(run, "capacity")])
    try:
        _until(lambda: view.lent("trainer") == 3, 30, "lending at a quiet load")
        burst = time.monotonic()
        _Metrics.page = _page(running=16, waiting=8)  # 3 engines' worth: 4 needed
        _until(lambda: view.lent("trainer") == 0, 15, "the reclaim")
        reclaimed_s = time.monotonic() - burst
        # one interval to scrape, a flush and the follower's fetch: well under 2 intervals + 1 s
        assert reclaimed_s < 2 * cfg.interval_s + 1.0, reclaimed_s
        rec = view.latest("trainer")
        assert rec is not None and rec["busy_engines"] == pytest.approx(3.0)
        assert rec["source"] == "metrics" and rec["engines"] == 4
    finally:
        stopper.stop()
        role.join(timeout=10)
        view.close()
        server.shutdown()


def test_a_dead_signal_lends_nothing(kafka: KafkaSettings, unique_run: str) -> None:
    run = unique_run
    ensure_run_topics(kafka, run)
    signal = Signal(kafka, run)
    signal.lent = 2
    view = CapacityView(kafka, [topics.topic_name(run, "capacity")], stale_s=1.5)
    try:
        _until(lambda: view.lent("trainer") == 2, 20, "the signal")
        signal.close()  # the capacity role dies
        _until(lambda: view.lent("trainer") == 0, 10, "lending to lapse")
        assert view.latest("trainer") is not None  # still known, no longer live
    finally:
        view.close()
