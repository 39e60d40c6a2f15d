"""Every benchmark runs end to end at a tiny size: it prints its JSON keys and keeps its result
(with the machine's description) in the results folder. Figures at this size mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GEO_RTT_MS
from vllm_support import requires_vllm

pytestmark = pytest.mark.slow

CASES = {
    "bus": (["--events", "20", "--tokens", "256", "--reps", "1"], ["ratio", "p50_ms"]),
    "deltas": (
        [
            *("--params", "200000", "--reps", "1", "--lrs", "1e-5", "--real-seconds", "1"),
            *("--real-width", "32", "--real-layers", "1"),
            *("--finetune-width", "32", "--finetune-layers", "1", "--pretrain-minutes", "0.01"),
            "--finetune-steps=2",
            *("--learner-warm-steps", "2", "--learner-steps", "1"),
            # pretrained (SmolLM2, 325 MB of bf16 a version) is too big for a smoke run: its
            # workload runs on a tiny checkpoint in tests/unit/test_delta_baselines.py
            *("--workloads", "synthetic,adam-real,finetune,learner"),
        ],
        ["cases"],
    ),
    "sync": (
        ["--mb", "2", "--versions", "3", "--keyframe-every", "2", "--subscribers", "1"],
        ["wire_ratio", "zstd_xor_ratio", "apply_seconds_p50"],
    ),
    "router-replay": (
        ["--tasks", "2", "--group-size", "2", "--warm-steps", "2"],
        ["with_replay", "without_replay"],
    ),
    "async": (
        [
            *("--versions", "3", "--seeds", "1", "--sigmas", "0.5", "--sweep", ""),
            *("--groups-per-step", "2", "--group-size", "2", "--workers", "1"),
            *("--env-median-s", "0.05", "--minutes", "5", "--eval-every", "1", "--eval-tasks", "2"),
            # the arms' figures, not learning: a barely warm policy whose groups all train
            *("--set", "learner.warm_start.steps=20", "--set", "admission.reject_no_signal=false"),
        ],
        ["speedup", "time_to_target", "breakdown", "env_sigma_sweep", "sweep", "baseline"],
    ),
    "ingest": (
        ["--seconds", "0.5", "--reps", "1", "--concurrency", "2,4", "--warmup", "0.5"],
        ["ratio", "stored_check", "levels"],
    ),
    "plan": (
        [
            *(
                "--calibrate-gb",
                "0.01,0.02",
                "--check-gb",
                "0.04",
                "--trials",
                "1",
                "--tensor-mb",
                "2",
            )
        ],
        ["rates", "checks", "held", "max_error", "scale"],
    ),
}


#: Benchmarks that reach Kafka by a bare bootstrap address (``async``: roles given one).
ON_KAFKA = {"bus", "sync", "ingest", "async", "plan"}
UNSECURED = pytest.mark.unsecured_only("the benchmark is given a bare bootstrap, no credentials")


@pytest.mark.parametrize(
    "bench", [pytest.param(b, marks=[UNSECURED] if b in ON_KAFKA else []) for b in sorted(CASES)]
)
def test_bench_runs_and_keeps_its_result(
    bench: str, kafka, cluster_home: Path, tmp_path: Path
) -> None:
    args, keys = CASES[bench]
    env = {**os.environ, "RLSTREAM_RESULTS": str(tmp_path)}
    if bench in ("bus", "sync", "ingest", "plan"):
        args = [*args, "--bootstrap", kafka.bootstrap_servers]
    if bench == "async":  # the pipeline runs on the session's local cluster
        args = [*args, "--home", str(cluster_home)]
    cmd = [sys.executable, "-m", "rlstream", "bench", bench, "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [k for k in keys if k not in result] == []
    kept = json.loads((tmp_path / f"bench-{bench}.json").read_text())
    assert kept["result"] == result and kept["machine"]["cores"] >= 1


@requires_vllm
@UNSECURED
def test_engines_bench_runs_and_keeps_its_result(kafka, cluster_home: Path, tmp_path: Path) -> None:
    """``bench engines`` at a tiny size, its partial-rollout runs on the session's cluster."""
    env = {**os.environ, "RLSTREAM_RESULTS": str(tmp_path)}
    args = ["--levels", "1,2", "--new-tokens", "8", "--prompt-tokens", "16", "--reps", "1"]
    args += ["--swaps", "2", "--partial-versions", "3", "--home", str(cluster_home)]
    args += ["--set", "learner.warm_start.steps=20", "--set", "admission.reject_no_signal=false"]
    cmd = [sys.executable, "-m", "rlstream", "bench", "engines", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [t["concurrency"] for t in result["throughput"]] == [1, 2]
    assert all(
        t["torch_tokens_per_s"] > 0 and t["vllm_tokens_per_s"] > 0 for t in result["throughput"]
    )
    assert result["swap"]["in_place_p50_s"] > 0 and result["swap"]["from_disk_p50_s"] > 0
    partial = result["partial"]
    assert partial["gain"] > 0 and 0 <= partial["partial"]["spanning_fraction"] <= 1
    assert partial["between_tasks"]["spanning_fraction"] == 0  # one version per trajectory
    assert len(result["load_average"]) == 2
    assert json.loads((tmp_path / "bench-engines.json").read_text())["result"] == result


def test_geo_bench_runs_on_the_regions_cluster(geo, tmp_path: Path) -> None:
    """``bench geo`` on the session's multi-region cluster (its trainer and eu regions and link)."""
    env = {**os.environ, "RLSTREAM_RESULTS": str(tmp_path)}
    args = ["--mb", "1", "--versions", "3", "--keyframe-every", "2", "--groups", "2"]
    args += ["--group-size", "2", "--tokens", "64", "--home", str(geo.home)]
    cmd = [sys.executable, "-m", "rlstream", "bench", "geo", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    [setting] = result["settings"]
    for key in ("propagation_p50_s", "propagation_p99_s", "cross_region_ratio", "trajectory_p50_s"):
        assert setting[key] > 0, (key, setting)
    assert setting["baseline"]["propagation_p50_s"] > 0
    link = setting["link"]  # the geo cluster's WAN, its round trip measured
    assert link["rtt_ms"] == GEO_RTT_MS and link["measured_rtt_ms"] >= GEO_RTT_MS * 0.9, link
    assert json.loads((tmp_path / "bench-geo.json").read_text())["result"] == result


#: The learner-ranks benchmarks at a tiny size: rank counts measured and their figures.
RANK_CASES = {
    "publish": ["--gb", "0.01", "--tensor-mb", "1", "--ranks", "1,2"],
    "learner": [
        *("--ranks", "1,2", "--steps", "1", "--groups-per-step", "2", "--group-size", "2"),
        *("--max-new-tokens", "8", "--warm-steps", "2"),
    ],
}


@UNSECURED
@pytest.mark.parametrize("bench", sorted(RANK_CASES))
def test_rank_bench_measures_every_rank_count(bench: str, kafka, tmp_path: Path) -> None:
    env = {**os.environ, "RLSTREAM_RESULTS": str(tmp_path)}
    args = [*RANK_CASES[bench], "--bootstrap", kafka.bootstrap_servers]
    cmd = [sys.executable, "-m", "rlstream", "bench", bench, "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted({r["ranks"] for r in result["runs"]}) == [1, 2]
    rate = ("publish_gb_per_s", "apply_gb_per_s") if bench == "publish" else ("samples_per_s",)
    assert all(r[k] > 0 for r in result["runs"] for k in rate), result
    if bench == "publish":
        assert result["max_version_gb"] >= 0.01
    else:  # the one-rank learner also on every core; packed against padded on the same steps
        cores = os.cpu_count() or 1
        assert {(r["ranks"], r["threads"]) for r in result["runs"]} == {(1, 1), (1, cores), (2, 1)}
        packing = result["packing"]
        assert packing["packed"]["tokens_per_s"] > 0 and packing["packing_speedup"] > 0
        assert all(0 <= packing[arm]["padding_share"] < 1 for arm in ("packed", "padded"))
        assert packing["lengths"]["min"] <= packing["lengths"]["p50"] <= packing["lengths"]["max"]
    assert json.loads((tmp_path / f"bench-{bench}.json").read_text())["result"] == result


def test_jit_cpu_seconds_reads_the_local_brokers_compiler_threads(
    kafka, cluster_home: Path
) -> None:
    """``bench ingest`` warms up until these go quiet: a JVM that has served requests has
    compiled (a positive figure, growing), this Python process has no such threads (0), and a
    process that is not there reads as None."""
    from rlstream.ops import cluster
    from rlstream.ops.bench.common import jit_cpu_seconds

    region = cluster.load(cluster_home).regions.get("trainer")
    if region is None or not region.pid:
        pytest.skip("the session's broker is not a local cluster's")
    used = jit_cpu_seconds(region.pid)
    assert used is not None and used > 0
    later = jit_cpu_seconds(region.pid)
    assert later is not None and later >= used
    assert jit_cpu_seconds(os.getpid()) == 0.0
    assert jit_cpu_seconds(2**22 + 12345) is None
