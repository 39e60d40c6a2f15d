"""The sizing model behind ``rlstream plan``: stage arithmetic, what binds a stage, growing a
deployment to its goals, and the rates fitted from ``bench plan``'s measurements."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from rlstream.ops.bench.plan import fit_rates
from rlstream.ops.plan.model import (
    Deployment,
    Rates,
    binding,
    fit_line,
    one_host,
    plan,
    size,
    stage_seconds,
)

RATES = Rates(
    encode_keyframe=(0.0, 4.0), encode_delta=(0.0, 5.0), decode_keyframe=(0.0, 1.0),
    decode_delta=(0.0, 2.0), write=(0.5, 2.0), fetch=(0.5, 4.0), keyframe_wire_ratio=0.7, cores=2,
)  # fmt: skip


def test_each_stage_is_its_bytes_over_the_resources_that_carry_them() -> None:
    d = Deployment(
        snapshot_gb=100, delta_gb=10, ranks=10, cores_per_rank=4, producers=4, partitions=100,
        partition_gb_s=1, brokers=3, broker_gb_s=1, replication=3, link_gbit_s=8, rtt_ms=100,
        link_round_trips=2, hosts=1, fetchers_per_host=2, host_cores=10, gpus_per_engine=10,
        changed_fraction=0.1, h2d_gb_s=1,
    )  # fmt: skip
    s = stage_seconds(d, RATES)
    assert s["encode"] == pytest.approx(100 * 5 / 40)  # a delta's rate
    # producers 4/2 = 2 GB/s, partitions 100, brokers 3*1/3 = 1 GB/s: the brokers bind
    assert s["write"] == pytest.approx(0.5 + 10 / 1) and binding(d, RATES, "write") == "brokers"
    assert s["link"] == pytest.approx(10 / 1 + 0.2)
    # fetchers 2/4 = 0.5 GB/s against the brokers' 3 GB/s for one host: the fetchers bind
    assert s["fetch"] == pytest.approx(0.5 + 10 / 0.5)
    assert binding(d, RATES, "fetch") == "fetchers_per_host"
    assert s["decode"] == pytest.approx(100 * 2 / 10)
    key = stage_seconds(d, RATES, "keyframe")  # 70 GB on the wire
    assert key["encode"] == pytest.approx(100 * 4 / 40) and key["link"] == pytest.approx(70.2)
    assert s["pause"] == pytest.approx(100 * 0.1 / 10 / 1)


def test_growing_doubles_what_binds_the_longest_stage_until_the_goals_hold() -> None:
    d = Deployment(land_s=60, pause_s=5)
    grown, steps = size(d, RATES)
    answer = stage_seconds(grown, RATES)
    assert sum(answer.values()) <= 60 and answer["pause"] <= 5
    assert steps and all("x2" in s for s in steps)
    assert plan(d, RATES)["sized"]["met"]


def test_a_stage_held_by_its_fixed_part_is_said_to_be_out_of_reach() -> None:
    d = Deployment(land_s=60, rtt_ms=40_000)  # two round trips alone take 80 s
    _, steps = size(d, RATES)
    assert steps[-1] == "link cannot be shortened further by link_gbit_s"
    assert not plan(d, RATES)["sized"]["met"]


def test_fitted_rates_give_back_the_times_they_were_fitted_on() -> None:
    def row(kind: str, raw: float, wire: float, encode: float, decode: float) -> dict:
        # write 0.1 s + 2 s/GB, fetch 0.2 s + 3 s/GB: one line through every version
        publish, follow = encode + 0.1 + 2 * wire, 0.2 + 3 * wire + decode
        return {"kind": kind, "raw_gb": raw, "wire_gb": wire, "publish_s": publish,
                "encode_s": encode, "follow_s": follow, "fetch_s": 0.0, "decode_s": decode}  # fmt: skip

    rows = [
        row("keyframe", 0.25, 0.17, 0.4, 0.2), row("delta", 0.25, 0.004, 0.15, 0.3),
        row("keyframe", 0.5, 0.34, 0.8, 0.4), row("delta", 0.5, 0.008, 0.3, 0.5),
    ]  # fmt: skip
    rates = fit_rates(rows, cores=2)
    assert rates.decode_delta == pytest.approx((0.1, 1.6))  # 0.1 s + 0.8 s/GB on 2 cores
    assert rates.write == pytest.approx((0.1, 2.0)) and rates.fetch == pytest.approx((0.2, 3.0))
    for r in rows:
        predicted = one_host(r["kind"], r["raw_gb"], r["wire_gb"], rates)
        assert predicted["publish_s"] == pytest.approx(r["publish_s"])
        assert predicted["follow_s"] == pytest.approx(r["follow_s"])


def test_a_line_through_points_and_through_one_point() -> None:
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1, 2))
    assert fit_line([2, 2], [4, 4]) == (0.0, 2.0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlstream", "plan", *args], capture_output=True, text=True
    )


def test_plan_reads_a_kept_bench_result_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    kept = tmp_path / "bench-plan.json"
    kept.write_text(json.dumps({"result": {"rates": asdict(RATES)}}))
    out = _cli("--rates", str(kept), "--delta-gb", "20", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.splitlines()[-1])
    assert answer["deployment"]["delta_gb"] == 20 and answer["dominant"] in answer["stages_s"]
    missing = _cli("--rates", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "bench plan --save" in missing.stderr
    (tmp_path / "bad.json").write_text('{"rates": {"cores": 2}}')
    bad = _cli("--rates", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "no bench plan rates" in bad.stderr
