"""Live dashboard in a real browser, and the static report, against a real broker.

Properties asserted: the page served by ``rlstream dashboard`` loads in headless Chromium, and
its charts follow the run while records are produced (the page's own counters, updated by its
JavaScript from server-sent events, reach exactly the number of samples produced, batch after
batch); a topic mirrored from another region (``eu.rl.RUN.trajectories``) created mid-run is
picked up; a role group's committed offsets show up as lag; ``rlstream report`` reads the run
to its end and reports the same figures. A screenshot of the live page is kept in
``artifacts/dashboard.png`` for people to look at.

Chromium is the Debian package ``chromium``; without ``/usr/bin/chromium`` the browser test
is skipped (the report test still runs).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from helpers import make_topics
from test_events import examples

from rlstream.producers.admin import ensure_run_topics
from rlstream.producers.producer import EventProducer
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import topics

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,2000",
]


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


class DevTools:
    """Just enough of the Chrome DevTools protocol: evaluate JavaScript, take a screenshot."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.next_id = ws, 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            reply = await self.ws.receive_json(timeout=30)
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 45.0) -> Any:
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"timed out waiting for {expression}: last {value!r}")


PAGE_STATE = """JSON.stringify({
  snapshots: +document.body.dataset.snapshots,
  samples: +document.body.dataset.samples,
  version: +document.body.dataset.policyVersion,
  points: Object.fromEntries([...document.querySelectorAll('canvas')].map(c => [c.id, +c.dataset.points])),
  conn: document.getElementById('conn').textContent,
})"""


def start_chromium(url: str, profile: Path) -> tuple[subprocess.Popen, int]:
    """Headless Chromium on ``url`` with DevTools on a free port; returns (process, port)."""
    proc = subprocess.Popen(
        [
            str(CHROMIUM),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    active = profile / "DevToolsActivePort"  # Chromium writes the port it bound here
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if active.exists() and active.read_text().strip():
            return proc, int(active.read_text().split()[0])
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("chromium did not open its DevTools port")


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def drive_page(
    devtools_port: int, url: str, produce_next: Any, first: int, second: int
) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        targets = await (await http.get(f"http://127.0.0.1:{devtools_port}/json/list")).json()
        page = next(t for t in targets if t.get("type") == "page" and t["url"].startswith(url))
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = DevTools(ws)
            state = json.loads(
                await cdp.wait_for(
                    f"(() => {{ const s = {PAGE_STATE}; return JSON.parse(s).samples >= {first} ? s : null }})()"
                )
            )
            assert state["samples"] == first and state["conn"] == "live"
            await asyncio.get_running_loop().run_in_executor(None, produce_next)
            later = json.loads(
                await cdp.wait_for(
                    f"(() => {{ const s = {PAGE_STATE}; return JSON.parse(s).samples >= {first + second} ? s : null }})()"
                )
            )
            # let the mirrored topic and the lag poller show up before the screenshot
            await cdp.wait_for("+document.getElementById('chart-lag').dataset.points > 0")
            await asyncio.sleep(1.5)
            final = json.loads(await cdp.evaluate(PAGE_STATE))
            shot = await cdp.call(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True
            )
    return {"first": state, "later": later, "final": final, "png": base64.b64decode(shot["data"])}


@pytest.mark.slow
@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs headless Chromium at /usr/bin/chromium (apt-get install chromium)",
)
def test_dashboard_page_follows_the_run_in_chromium(kafka: KafkaSettings, unique_run: str) -> None:
    from rlstream.ops.dashboard import serve_dashboard

    run = unique_run
    ensure_run_topics(kafka, run, partitions=2)
    first, second = 12, 8
    with EventProducer.connect(kafka) as producer:
        produce_batch(producer, run, 1, first, "")
    dashboard, server = serve_dashboard(kafka, run, port=0, interval_s=0.5)
    profile = Path(tempfile.mkdtemp(prefix="rlstream-chromium-"))
    browser, devtools_port = start_chromium(server.url, profile)
    try:

        def produce_next() -> None:
            mirrored = f"eu.{topics.topic_name(run, 'trajectories')}"
            make_topics(kafka, mirrored, partitions=2)  # as MirrorMaker 2 would, mid-run
            commit_learner_offsets(kafka, run)
            with EventProducer.connect(kafka) as producer:
                produce_batch(producer, run, 2, second, mirrored)

        seen = asyncio.run(drive_page(devtools_port, server.url, produce_next, first, second))
        with urllib.request.urlopen(server.url + "api/snapshot", timeout=10) as resp:
            snap = json.load(resp)
    finally:
        stop_process(browser)
        server.stop()
        dashboard.stop()
        shutil.rmtree(profile, ignore_errors=True)
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
    from rlstream.ops.report import build_report
    from rlstream.producers.admin import ensure_cluster_topics

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
