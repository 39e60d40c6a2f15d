"""``rlstream delta encode|apply|inspect`` on .pt, .npz, .safetensors files and HF directories.

Properties asserted: encode then apply reproduces the new state bit for bit through .pt and
.npz (bf16 included, NaN payloads and -0.0 kept), in any combination of formats; keyframes
apply without a base; apply refuses (exit 1, nothing written) a wrong base and a damaged
delta file; inspect reports every tensor and flags a damaged chunk.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlstream.ops.bench import delta_baselines
from rlstream.ops.cli import cmd_delta
from rlstream.schemas import deltacodec as dc
from rlstream.schemas.deltacodec import file as dfile

torch = pytest.importorskip("torch")


def _run(*argv: str | Path) -> int:
    parser = argparse.ArgumentParser(prog="rlstream")
    cmd_delta.register(parser.add_subparsers())
    args = parser.parse_args([str(a) for a in argv])
    return int(args.func(args))


def _states() -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    old = {
        "layer.weight": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(200, generator=g),
        "steps": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "file": torch.zeros(2, dtype=torch.float16),  # a name np.savez would choke on
    }
    new = {k: v.clone() for k, v in old.items()}
    new["layer.weight"].view(-1)[::53] += 0.01
    new["layer.bias"][3] = -0.0
    new["layer.bias"].view(torch.int32)[5] = 0x7FC0_0ABC  # a NaN with a payload
    new["steps"] += 1
    return old, new


def _bits(state: dict[str, Any]) -> dict[str, dc.TensorBits]:
    return dc.from_torch(state)


@pytest.mark.parametrize(
    ("fmt_old", "fmt_out"), [(".pt", ".pt"), (".npz", ".npz"), (".pt", ".npz")]
)
def test_encode_apply_round_trip(tmp_path: Path, fmt_old: str, fmt_out: str) -> None:
    old, new = _states()
    a, b = tmp_path / f"a{fmt_old}", tmp_path / "b.pt"
    cmd_delta.save_state(a, _bits(old))
    torch.save(new, b)
    d, c = tmp_path / "d.rld", tmp_path / f"c{fmt_out}"
    assert (
        _run("delta", "encode", "--old", a, "--new", b, "--out", d, "--max-chunk-bytes", "300") == 0
    )
    assert len(dfile.unpack(d.read_bytes()).chunks) > 1
    assert _run("delta", "apply", "--old", a, "--delta", d, "--out", c) == 0
    assert dc.same_state(cmd_delta.load_state(c), _bits(new))
    if fmt_out == ".pt":
        back = torch.load(c, weights_only=True)
        assert back["layer.weight"].dtype == torch.bfloat16
        assert back["layer.bias"].view(torch.int32)[5].item() == 0x7FC0_0ABC


def test_keyframe_applies_without_base(tmp_path: Path) -> None:
    _, new = _states()
    b, d, c = tmp_path / "b.pt", tmp_path / "k.rld", tmp_path / "c.npz"
    torch.save(new, b)
    assert _run("delta", "encode", "--keyframe", "--new", b, "--out", d, "--version", "9") == 0
    assert _run("delta", "apply", "--delta", d, "--out", c) == 0
    assert dc.same_state(cmd_delta.load_state(c), _bits(new))


def test_apply_refuses_a_wrong_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _states()
    a, b, d, c = (tmp_path / n for n in ("a.pt", "b.pt", "d.rld", "c.pt"))
    torch.save(old, a)
    torch.save(new, b)
    assert _run("delta", "encode", "--old", a, "--new", b, "--out", d) == 0
    capsys.readouterr()
    assert _run("delta", "apply", "--old", b, "--delta", d, "--out", c) == 1
    assert "BaseMismatch" in capsys.readouterr().err
    assert not c.exists()
    assert _run("delta", "apply", "--delta", d, "--out", c) == 2  # a delta needs --old
    assert not c.exists()


def test_apply_refuses_a_damaged_delta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _states()
    a, b, d, c = (tmp_path / n for n in ("a.npz", "b.pt", "d.rld", "c.pt"))
    cmd_delta.save_state(a, _bits(old))
    torch.save(new, b)
    assert _run("delta", "encode", "--old", a, "--new", b, "--out", d) == 0
    data = d.read_bytes()
    for where in (len(data) - 20, 60):  # inside a chunk, inside the manifest
        damaged = bytearray(data)
        damaged[where] ^= 0x01
        bad = tmp_path / f"bad{where}.rld"
        bad.write_bytes(bytes(damaged))
        capsys.readouterr()
        assert _run("delta", "apply", "--old", a, "--delta", bad, "--out", c) == 1
        assert "refused" in capsys.readouterr().err
        assert not c.exists()
        assert _run("delta", "inspect", bad) == 1


def test_inspect_lists_every_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _states()
    a, b, d = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "d.rld"
    torch.save(old, a)
    torch.save(new, b)
    assert _run("delta", "encode", "--old", a, "--new", b, "--out", d, "--base-version", "4") == 0
    capsys.readouterr()
    assert _run("delta", "inspect", d) == 0
    out = capsys.readouterr().out
    assert "delta v5 against v4" in out
    for name in old:
        assert name in out
    assert "unchanged" in out and "sparse" in out
    assert _run("delta", "inspect", d, "--json") == 0
    assert '"state_hash"' in capsys.readouterr().out


def test_warm_compiles_the_kernels_of_every_float_piece_kind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``delta warm`` (the set-up step of ``make demo`` and ``make test``) applies one delta
    of each float piece kind the encoder writes, bit-exactly."""
    assert _run("delta", "warm") == 0
    assert "kernels ready" in capsys.readouterr().err
    assert sorted(dc.compile_kernels()) == ["direct", "exponent2", "exponent3"]


def test_unusable_inputs_exit_2(tmp_path: Path) -> None:
    assert (
        _run(
            "delta",
            "apply",
            "--old",
            tmp_path / "a.pt",
            "--delta",
            tmp_path / "x",
            "--out",
            tmp_path / "c.pt",
        )
        == 2
    )
    (tmp_path / "s.txt").write_text("x")
    assert (
        _run("delta", "encode", "--keyframe", "--new", tmp_path / "s.txt", "--out", tmp_path / "d")
        == 2
    )
    np.save(tmp_path / "plain.npy", np.zeros(3))
    torch.save([1, 2], tmp_path / "list.pt")
    assert (
        _run(
            "delta", "encode", "--keyframe", "--new", tmp_path / "list.pt", "--out", tmp_path / "d"
        )
        == 2
    )
    assert _run("delta") == 2


def test_bench_deltas_json_is_the_last_stdout_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from rlstream.ops.bench import deltas

    parser = argparse.ArgumentParser()
    deltas.register_bench(parser.add_subparsers())
    argv = ["deltas", "--params", "40000", "--reps", "1", "--json", "--workloads", "synthetic"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert [(c["workload"], c["lr"]) for c in result["cases"]] == [
        ("synthetic", 1e-6),
        ("synthetic", 1e-5),
    ]
    for case in result["cases"]:
        assert case["bit_exact"] is True and case["ratio"] > 1
        assert case["fraction_of_conditioned_bound"] == pytest.approx(
            case["ratio"] / case["conditioned_bound_x"]
        )
        assert case["conditioned_bound_x"] > case["order0_bound_x"]
        generic = case["generic"]
        assert set(generic) == set(delta_baselines.NAMES)
        assert all(v > 1 for v in generic.values())
        strongest = case["strongest_generic"]
        assert strongest["ratio"] == max(generic.values()) == generic[strongest["name"]]
        assert case["x_smaller_than_strongest_generic"] == pytest.approx(
            case["ratio"] / strongest["ratio"]
        )
        assert case["steady_state"] is False  # a simulated step
        for key in (
            "changed_fraction",
            "encode_gb_per_s",
            "apply_gb_per_s",
            "decode_gb_per_s",
            "memcpy_gb_per_s",
            "hash_gb_per_s",
            "crypto_hash_gb_per_s",
            "encode_xxh3_gb_per_s",
            "apply_xxh3_gb_per_s",
            "zstd_xor_ratio",
            "encode_cores_gb_per_s",
            "apply_cores_gb_per_s",
            "encode_scaling",
            "apply_scaling",
        ):
            assert case[key] > 0
        assert case["cores"] == args.cores >= 1


def test_hugging_face_directories_round_trip(tmp_path: Path) -> None:
    """A delta between two HF model directories applies into a directory ``from_pretrained``
    loads, bit-exact to the new one (bf16 weights as saved, config and tokenizer copied)."""
    transformers = pytest.importorskip("transformers")
    from rlstream.rollout import hf_policy
    from rlstream.rollout.text import char_tokenizer

    old = hf_policy.build_hf_policy(hf_policy.tiny_qwen3_moe_config(), seed=1).to(torch.bfloat16)
    new = hf_policy.build_hf_policy(hf_policy.tiny_qwen3_moe_config(), seed=1).to(torch.bfloat16)
    with torch.no_grad():
        first = next(p for p in new.parameters() if p.ndim == 2)
        first.view(-1)[::7] += 0.125
    tokenizer = char_tokenizer()
    hf_policy.save_hf(old, tokenizer, tmp_path / "old")
    hf_policy.save_hf(new, tokenizer, tmp_path / "new")
    delta, out = tmp_path / "v1.rld", tmp_path / "applied"
    assert (
        _run(
            "delta", "encode", "--old", tmp_path / "old", "--new", tmp_path / "new", "--out", delta
        )
        == 0
    )
    assert _run("delta", "apply", "--old", tmp_path / "old", "--delta", delta, "--out", out) == 0
    assert dc.same_state(cmd_delta.load_state(out), cmd_delta.load_state(tmp_path / "new"))
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), ref.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
