"""Live dashboard in a real browser, and the static report, against a real broker.

Properties asserted: the page served by ``rlstream dashboard`` loads in headless Chromium, and
its charts follow the run while records are produced (the page's own counters, updated by its
JavaScript from server-sent events, reach exactly the number of samples produced, batch after
batch); a topic mirrored from another region (``eu.rl.RUN.trajectories``) created mid-run is
picked up; a role group's committed offsets show up as lag; ``rlstream report`` reads the run
to its end and reports the same figures. A screenshot of the live page is kept in
``artifacts/dashboard.png`` for people to look at.

The browser is driven with Playwright's Python API; the browser itself is the Debian package
``chromium`` (``ops/sysdeps.sh`` installs it; Playwright's own browser download is not used).
Without ``/usr/bin/chromium`` the browser test is skipped (the report test still runs).
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from helpers import make_topics
from test_events import examples

from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def produce_batch(producer: EventProducer, run: str, batch: int, n: int, region_topic: str) -> None:
    """``n`` samples of policy version ``batch`` (trajectory, reward, admitted group) + a manifest."""
    ex = examples()
    now = int(time.time() * 1000)
    manifest = {**copy.deepcopy(ex["weight_manifest"]), "run": run, "version": batch}
    manifest.update(created_ms=now, base_version=batch - 1 if batch else None)
    producer.produce(
        topics.topic_name(run, "weights.manifests"), "weight_manifest", manifest, "moe-tiny"
    )
    for i in range(n):
        group = f"b{batch}-g{i}"
        traj = {**copy.deepcopy(ex["trajectory"]), "run": run, "group_id": group}
        traj.update(policy_version=batch, region="trainer", sample_index=0)
        traj["timings"].update(started_ms=now + 100 + i)
        topic = topics.topic_name(run, "trajectories")
        if i % 2 and region_topic:  # every other sample comes from the mirrored region
            traj["region"], topic = "eu", region_topic
        producer.produce(topic, "trajectory", traj, group)
        reward = {**copy.deepcopy(ex["reward"]), "run": run, "group_id": group}
        reward.update(
            policy_version=batch, passed=i % 2 == 0, score=float(i % 2 == 0), latency_ms=50 + i
        )
        producer.produce(topics.topic_name(run, "rewards"), "reward", reward, group)
        decision = {**copy.deepcopy(ex["admission"]), "run": run, "group_id": group}
        decision.update(staleness=i % 3, samples=[])
        if i % 5 == 4:
            decision.update(decision="rejected", reason="stale")
        stream = "admitted" if decision["decision"] == "admitted" else "rejected"
        producer.produce(topics.topic_name(run, stream), "admission", decision, group)
    producer.flush(30)


def commit_learner_offsets(settings: KafkaSettings, run: str) -> None:
    """Make ``rlstream.RUN.learner`` a group with committed offsets (at 0: all of it is lag)."""
    topic = topics.topic_name(run, "admitted")
    consumer = Consumer({**settings.librdkafka(), "group.id": topics.group_id(run, "learner")})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.commit(offsets=[TopicPartition(topic, p, 0) for p in parts], asynchronous=False)
    finally:
        consumer.close()


PAGE_STATE = """() => ({
  snapshots: +document.body.dataset.snapshots,
  samples: +document.body.dataset.samples,
  version: +document.body.dataset.policyVersion,
  points: Object.fromEntries([...document.querySelectorAll('canvas')].map(c => [c.id, +c.dataset.points])),
  conn: document.getElementById('conn').textContent,
})"""


def page_state_once(page: Page, samples: int) -> dict[str, Any]:
    """The page's state, once its counters show at least ``samples`` samples."""
    check = f"() => {{ const s = ({PAGE_STATE})(); return s.samples >= {samples} ? s : null }}"
    return page.wait_for_function(check, polling=250, timeout=45_000).json_value()


def drive_page(
    url: str, produce_next: Callable[[], None], first: int, second: int
) -> dict[str, Any]:
    """Open the dashboard in the system Chromium, produce the second batch, watch it arrive."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            page.goto(url)
            state = page_state_once(page, first)
            assert state["samples"] == first and state["conn"] == "live"
            produce_next()
            later = page_state_once(page, first + second)
            # let the mirrored topic and the lag poller show up before the screenshot
            page.wait_for_function(
                "+document.getElementById('chart-lag').dataset.points > 0", timeout=45_000
            )
            page.wait_for_timeout(1500)
            final = page.evaluate(PAGE_STATE)
            png = page.screenshot(full_page=True)
        finally:
            browser.close()
    return {"first": state, "later": later, "final": final, "png": png}


@pytest.mark.slow
@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs headless Chromium at /usr/bin/chromium (apt-get install chromium)",
)
def test_dashboard_page_follows_the_run_in_chromium(kafka: KafkaSettings, unique_run: str) -> None:
    from rlstream.ops.observe.dashboard import serve_dashboard

    run = unique_run
    ensure_run_topics(kafka, run, partitions=2)
    first, second = 12, 8
    with EventProducer.connect(kafka) as producer:
        produce_batch(producer, run, 1, first, "")
    dashboard, server = serve_dashboard(kafka, run, port=0, interval_s=0.5)
    try:

        def produce_next() -> None:
            mirrored = f"eu.{topics.topic_name(run, 'trajectories')}"
            make_topics(kafka, mirrored, partitions=2)  # as MirrorMaker 2 would, mid-run
            commit_learner_offsets(kafka, run)
            with EventProducer.connect(kafka) as producer:
                produce_batch(producer, run, 2, second, mirrored)

        seen = drive_page(server.url, produce_next, first, second)
        with urllib.request.urlopen(server.url + "api/snapshot", timeout=10) as resp:
            snap = json.load(resp)
    finally:
        server.stop()
        dashboard.stop()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "dashboard.png").write_bytes(seen["png"])
    assert seen["png"][:8] == b"\x89PNG\r\n\x1a\n"
    later, final = seen["later"], seen["final"]
    assert later["samples"] == first + second and later["version"] == 2
    assert later["snapshots"] > seen["first"]["snapshots"]  # the page kept receiving events
    for chart in (
        "chart-rates",
        "chart-success",
        "chart-reward",
        "chart-staleness",
        "chart-rejections",
        "chart-weight-bytes",
        "chart-weight-time",
        "chart-judges",
        "chart-regions",
        "chart-lag",
    ):
        assert final["points"][chart] > 0, (chart, final["points"])
    assert snap["samples"] == first + second
    assert snap["regions"]["eu"]["samples"] == second // 2  # picked up by pattern
    assert snap["lag"]["learner"]["total"] == snap["admitted"]  # committed at 0: all behind
    assert snap["rejections"] == {"stale": 2 + 1}
    assert [v["success"] for v in snap["versions"]] == [0.5, 0.5]


def test_report_reads_the_run_to_its_end(
    kafka: KafkaSettings, unique_run: str, tmp_path: Path
) -> None:
    from rlstream.ops.observe.report import build_report
    from rlstream.producers.client.admin import ensure_cluster_topics

    run = unique_run
    ensure_run_topics(kafka, run, partitions=2)
    ensure_cluster_topics(kafka)
    manifest = {**examples()["run_manifest"], "run": run, "updated_ms": int(time.time() * 1000)}
    with EventProducer.connect(kafka) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", manifest, run)
        for batch in range(3):
            produce_batch(producer, run, batch, 10, "")
    index = build_report(kafka, run, tmp_path, idle_s=15, log=lambda _: None)
    snap = json.loads((tmp_path / "snapshot.json").read_text())
    assert snap["samples"] == 30 and snap["admitted"] == 24 and snap["rejected"] == 6
    assert snap["policy_version"] == 2 and [w["version"] for w in snap["weights"]] == [0, 1, 2]
    page = index.read_text()
    assert f"Run {run}" in page and "resolved config" in page
    assert len(list(tmp_path.glob("*.png"))) == 6
