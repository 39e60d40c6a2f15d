"""The demo's plot: the training samples' success by version (smoothed by pooling neighbouring
versions) and the held-out curves, labelled axes, no per-point labels."""

from __future__ import annotations

import random
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlstream.ops.demo.demo import _plot_success as plot_success
from rlstream.ops.demo.demo import smoothed_success, write_png
from rlstream.ops.observe.analytics import RunAnalytics

EVALS = [
    {"version": v, "greedy_success": g, "pass_at_k": p, "k": 4}
    for v, g, p in [(0, 0.25, 0.34), (40, 0.67, 0.8), (80, 0.7, 0.9), (120, 0.91, 0.97)]
]


def _progress(versions: int = 120, seed: int = 0) -> RunAnalytics:
    rng = random.Random(seed)
    progress = RunAnalytics(run="r")
    for v in range(versions):
        judged = rng.choice([8, 16, 24, 32])
        p = 0.2 + 0.7 * v / versions
        progress.success[v] = [sum(rng.random() < p for _ in range(judged)), judged]
    progress.staleness["admitted"].update({0: 40, 1: 250, 2: 40})
    progress.staleness["rejected"].update({3: 2})
    return progress


def test_smoothed_success_pools_the_neighbouring_versions() -> None:
    progress = RunAnalytics(run="r")
    progress.success = {0: [0, 8], 1: [8, 8], 2: [4, 16], 5: [1, 1]}
    assert smoothed_success(progress, half_window=1) == [8 / 16, 12 / 32, 12 / 24, 1.0]


def test_plot_shows_both_curves_without_point_labels() -> None:
    fig, ax = plt.subplots()
    plot_success(ax, _progress(), EVALS)
    assert len(ax.texts) == 0  # no per-point numbers to overlap
    assert ax.get_xlabel() == "policy version" and "success" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(lbl.startswith("training samples") for lbl in labels)
    assert "held-out tasks, greedy" in labels and "held-out tasks, pass@4" in labels
    (greedy,) = [ln for ln in ax.get_lines() if ln.get_label() == "held-out tasks, greedy"]
    assert list(greedy.get_xdata()) == [0, 40, 80, 120]
    assert list(greedy.get_ydata()) == [0.25, 0.67, 0.7, 0.91]
    plt.close(fig)


def test_write_png(tmp_path: Path) -> None:
    path = tmp_path / "success_by_version.png"
    write_png(_progress(), path, EVALS)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_png(_progress(), tmp_path / "no_evals.png")  # a run without eval events still plots
    assert (tmp_path / "no_evals.png").stat().st_size > 0
