"""The README's benchmark table is what ``rlstream bench table`` renders from results/*.json, and
every kept result records the load average before and after its bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.ops.bench import common, table
from rlstream.ops.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_matches_the_results(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "table", "--check"]) == 0, capsys.readouterr().err


def _readme(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "README.md"
    path.write_text(f"# x\n\nbefore\n{table.START}\n{body}\n{table.END}\nafter\n")
    return path


def _result(folder: Path, name: str, record: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"bench-{name}.json").write_text(json.dumps(record))


BUS = {
    "bench": "bus",
    "measured_at": "2026-12-03T10:00:00+00:00",
    "command": "rlstream bench bus --json",
    "machine": {"cpu": "Some CPU", "cores": 2, "commit": "abc1234"},
    "load_average": {"before": [0.5, 0.6, 0.7], "after": [1.25, 0.9, 0.8]},
    "result": {
        "events_per_s": 100.0,
        "mb_per_s": 60.0,
        "raw_events_per_s": 110.0,
        "raw_mb_per_s": 66.0,
        "ratio": 0.909,
        "p50_ms": 10.0,
        "p99_ms": 400.0,
        "raw_p50_ms": 9.0,
        "raw_p99_ms": 380.0,
    },
}


def test_check_fails_when_a_row_differs_and_writing_fixes_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _result(results, "bus", BUS)
    readme = _readme(tmp_path, "| stale | row |")
    args = ["bench", "table", "--readme", str(readme), "--results", str(results)]
    assert main([*args, "--check"]) == 1
    assert "stale" in readme.read_text()  # --check changes nothing
    assert main(args) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{table.END}\nafter\n")
    assert main([*args, "--check"]) == 0
    (row,) = [ln for ln in text.splitlines() if ln.startswith("| `rlstream bench bus")]
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1:] == [
        "100.0 events/s, 60.0 MB/s; ratio **0.91**; p50 10.0 ms, p99 400 ms",
        "raw bytes: 110.0 events/s, 66.0 MB/s; p50 9.0 ms, p99 380 ms",
        "abc1234 (no provenance: kept before it was recorded)",
        "Some CPU, 2 cores",
        "0.50 → 1.25",
        "2026-12-03",
    ]
    # a changed figure in the results makes the README stale again
    _result(results, "bus", {**BUS, "result": {**BUS["result"], "ratio": 0.5}})
    assert main([*args, "--check"]) == 1


def test_missing_markers_are_an_error(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    assert main(["bench", "table", "--check", "--readme", str(readme)]) == 2


def test_unknown_or_reshaped_results_say_where_to_look_and_no_load_is_not_recorded() -> None:
    for record in (
        {"bench": "new-bench", "command": "rlstream bench new-bench", "result": {}},
        {"bench": "bus", "command": "rlstream bench bus", "result": {"ratio": 1.0}},
    ):
        cells = table.row("bench-x", record).strip("|").split(" | ")
        assert "docs/benchmarks.md" in cells[1]
        assert [c.strip() for c in cells[3:6]] == [
            "not recorded (no provenance: kept before it was recorded)",
            "not recorded",
            "not recorded",
        ]


def test_save_records_the_load_before_and_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLSTREAM_RESULTS", str(tmp_path))
    loads = iter([(3.0, 2.0, 1.0), (4.0, 2.5, 1.5)])
    monkeypatch.setattr(common.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(common, "_load_before", None)  # restored after the test
    common.mark_start()
    saved = json.loads(common.save("t", {"x": 1}).read_text())
    assert saved["load_average"] == {"before": [3.0, 2.0, 1.0], "after": [4.0, 2.5, 1.5]}
    assert table.load_cell(saved) == "3.00 → 4.00"


def _kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, result: dict, **prov: object) -> dict:
    """A result as ``save`` keeps it, its provenance amended by ``prov``."""
    monkeypatch.setenv("RLSTREAM_RESULTS", str(tmp_path / "results"))
    path = common.save("bus", result)
    record = json.loads(path.read_text())
    record["provenance"].update(prov)
    return record


def test_a_kept_result_records_its_provenance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _kept(tmp_path, monkeypatch, BUS["result"])
    prov = record["provenance"]
    assert len(prov["commit"]) == 40 and isinstance(prov["dirty"], bool)
    assert (prov["diff_hash"] is None) == (not prov["dirty"]) and "cores" in prov["machine"]
    assert prov["result_sha256"] == common.result_hash(BUS["result"])
    assert set(record) == common.SAVED_KEYS


def test_check_refuses_dirty_edited_and_hand_annotated_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean = _kept(tmp_path, monkeypatch, BUS["result"], dirty=False, diff_hash=None)
    assert table.problems(clean) == []
    dirty = {**clean, "provenance": {**clean["provenance"], "dirty": True, "diff_hash": "ab12"}}
    assert table.problems(dirty) == ["measured on a dirty tree (diff ab12)"]
    edited = {**clean, "result": {**clean["result"], "ratio": 2.0}}
    assert "edited after it was kept" in table.problems(edited)[0]
    annotated = {**clean, "note": "quiet machine"}
    assert table.problems(annotated) == ["keys the saver never writes: ['note']"]
    results = tmp_path / "results"
    (results / "bench-bus.json").write_text(json.dumps(edited))
    readme = _readme(tmp_path)
    before = readme.read_text()
    args = ["bench", "table", "--readme", str(readme), "--results", str(results)]
    assert main(args) == 1 and main([*args, "--check"]) == 1
    assert "bench-bus.json: its result was edited" in capsys.readouterr().err
    assert readme.read_text() == before  # nothing written


def test_every_note_is_rendered_with_who_wrote_it() -> None:
    legacy = {**BUS, "load_average": {**BUS["load_average"], "note": "busy machine"}}
    legacy["result"] = {**BUS["result"], "note": "2 seeds only"}
    figure = table.row("bench-bus", legacy).split(" | ")[1]
    assert "note: 2 seeds only" in figure
    assert "hand-added note (load_average): busy machine" in figure


def test_a_bench_keeps_its_result_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RLSTREAM_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "_keep", False)  # restored after the test
    common.emit({"x": 1}, False, [], "t")
    assert not (tmp_path / "results").exists()
    assert "not kept (--save" in capsys.readouterr().err
    common.mark_start(keep=True)
    common.emit({"x": 1}, False, [], "t")
    assert json.loads((tmp_path / "results" / "bench-t.json").read_text())["result"] == {"x": 1}
    common.mark_start(keep="t-variant")  # --save-as
    common.emit({"x": 2}, False, [], "t")
    assert json.loads((tmp_path / "results" / "bench-t-variant.json").read_text())["bench"] == "t"


def test_provenance_is_the_code_as_the_bench_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = iter([{"commit": "a" * 40, "dirty": False, "diff_hash": None}])
    end = {"commit": "b" * 40, "dirty": True, "diff_hash": "cd"}
    monkeypatch.setattr(common, "code_state", lambda: next(states, end))
    monkeypatch.setattr(common, "_code_before", None)  # restored after the test
    monkeypatch.setattr(common, "_keep", False)
    common.mark_start(keep=True)
    prov = common.provenance({"x": 1}, {"cpu": "c", "cores": 2})
    assert prov["commit"] == "a" * 40 and prov["dirty"] is False and prov["code_at_end"] == end
    record = {"bench": "t", "result": {"x": 1}, "provenance": prov}
    assert table.problems(record) == ["the code was changed and not committed while it ran"]
