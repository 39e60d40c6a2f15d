"""``rlstream report RUN --out DIR``: a static HTML report of a run, with PNG plots.

The run's streams are read from the beginning to the end they have when the report starts
(``ops.observe.run_reader``, no consumer group, nothing committed), folded by the same rules as the
live dashboard (``ops.observe.analytics``), and written to ``DIR``:

- ``index.html``: headline figures, every plot, tables, and the run manifest from ``rl.runs``
  (with its resolved config pretty-printed) when there is one;
- ``*.png``: one plot per figure (matplotlib, Agg backend: no display needed);
- ``snapshot.json``: the figures as data, the same JSON the dashboard's ``/api/snapshot`` serves.

A figure with no data is drawn as an empty plot saying so, never skipped, so two reports of
different runs have the same layout.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlstream.ops.observe.analytics import RUN_BUCKET_S, RunAnalytics

MAX_TIME_BINS = 240
Figure = Any  # matplotlib.figure.Figure, imported lazily


def rebin(
    series: list[tuple[int, int]],
    span: tuple[int, int] | None = None,
    max_bins: int = MAX_TIME_BINS,
) -> tuple[list[float], list[float], int]:
    """Whole-run counts ``(start s, n)`` as ``(minutes since span start, records/s, bin seconds)``.

    Rule: bins are a multiple of ``RUN_BUCKET_S`` wide, as narrow as keeps at most ``max_bins``
    over ``span`` (first, last bucket start; default: the series' own), so every stream of a run
    is binned alike; empty bins inside the span count as zero, so a stall shows as a drop to 0.
    """
    if not series:
        return [], [], RUN_BUCKET_S
    first, last = span or (series[0][0], series[-1][0])
    width = RUN_BUCKET_S * max(
        1, math.ceil((last - first + RUN_BUCKET_S) / RUN_BUCKET_S / max_bins)
    )
    counts = [0] * ((last - first) // width + 1)
    for start, n in series:
        counts[(start - first) // width] += n
    return [i * width / 60 for i in range(len(counts))], [c / width for c in counts], width


# --- plots ------------------------------------------------------------------------------------


def _axes(ncols: int = 1, width: float = 10.0) -> tuple[Figure, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, 3.6), squeeze=False)
    return fig, list(axes[0])


def _no_data(ax: Any, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#888")


def plot_events(analytics: RunAnalytics, snap: dict[str, Any]) -> Figure:
    fig, (ax,) = _axes(width=11)
    series = {s: analytics.run_series(s) for s in snap["streams"]}
    starts = [t for points in series.values() for t, _ in points]
    drawn = False
    for stream, points in series.items():
        minutes, rates, width = rebin(points, (min(starts), max(starts)) if starts else None)
        if minutes:
            total = snap["streams"][stream]["total"]
            # repeat the last bin's rate at its end, so the last bin is drawn with its width
            xs, ys = [*minutes, minutes[-1] + width / 60], [*rates, rates[-1]]
            ax.step(xs, ys, where="post", label=f"{stream} ({total})", lw=1.4)
            drawn = True
            ax.set_xlabel(f"minutes since the run's first record ({width} s bins)")
    ax.set_ylabel("records / s")
    ax.set_title("events per stream")
    if drawn:  # outside the axes: a legend inside would hide the run's first minutes
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        _no_data(ax, "no timestamped records")
    return fig


def plot_versions(snap: dict[str, Any]) -> Figure:
    fig, (ax1, ax2) = _axes(2)
    rows = snap["versions"]
    judged = [r for r in rows if r["success"] is not None]
    evals = snap.get("evals") or []
    if judged:
        ax1.plot(
            [r["version"] for r in judged],
            [r["success"] for r in judged],
            marker="o",
            ms=3,
            label="training samples",
        )
    if evals:
        xs = [e["version"] for e in evals]
        ax1.plot(xs, [e["greedy_success"] for e in evals], marker="s", label="held-out greedy")
        k = evals[-1]["k"]
        ax1.plot(xs, [e["pass_at_k"] for e in evals], marker="^", label=f"held-out pass@{k}")
        ax1.legend(fontsize=7)
    if not judged and not evals:
        _no_data(ax1)
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("behaviour policy version")
    ax1.set_ylabel(f"success rate ({snap['success_judge'] or 'no judge'})")
    ax1.set_title("success rate by policy version")
    judges = sorted({j for r in rows for j in r["mean_reward"]})
    for judge in judges:
        pts = [
            (r["version"], r["mean_reward"][judge])
            for r in rows
            if r["mean_reward"].get(judge) is not None
        ]
        ax2.plot(*zip(*pts, strict=True), marker=".", label=judge)
    if judges:
        ax2.legend(fontsize=7)
    else:
        _no_data(ax2)
    ax2.set_xlabel("behaviour policy version")
    ax2.set_ylabel("mean score")
    ax2.set_title("mean reward by policy version (per judge)")
    return fig


def plot_admission(snap: dict[str, Any]) -> Figure:
    fig, (ax1, ax2) = _axes(2)
    rows = snap["staleness"]
    if rows:
        xs = [r[0] for r in rows]
        ax1.bar(xs, [r[1] for r in rows], label="admitted", color="#109618")
        ax1.bar(
            xs, [r[2] for r in rows], bottom=[r[1] for r in rows], label="rejected", color="#dc3912"
        )
        ax1.legend(fontsize=7)
    else:
        _no_data(ax1)
    ax1.set_xlabel("staleness at admission (versions)")
    ax1.set_ylabel("groups")
    ax1.set_title("staleness histogram")
    reasons = snap["rejections"]
    if reasons:
        ax2.barh(list(reasons), list(reasons.values()), color="#dc3912")
        ax2.invert_yaxis()
    else:
        _no_data(ax2, "no group rejected")
    ax2.set_xlabel("groups")
    ax2.set_title("admission rejections by reason")
    return fig


def plot_weights(snap: dict[str, Any]) -> Figure:
    fig, (ax1, ax2) = _axes(2)
    rows = snap["weights"]
    if not rows:
        _no_data(ax1, "no weight manifest")
        _no_data(ax2, "no weight manifest")
    versions = [r["version"] for r in rows]
    if rows:
        ax1.semilogy(versions, [r["raw_bytes"] for r in rows], label="raw (full state)")
        ax1.semilogy(
            versions, [max(1, r["encoded_bytes"]) for r in rows], marker=".", label="encoded"
        )
        ax1.legend(fontsize=7)
        interval = [(r["version"], r["interval_ms"]) for r in rows if r["interval_ms"] is not None]
        if interval:
            ax2.plot(*zip(*interval, strict=True), label="publish interval", color="#ff9900")
        for region in sorted({g for r in rows for g in r["first_use_ms"]}):
            pts = [
                (r["version"], r["first_use_ms"][region])
                for r in rows
                if region in r["first_use_ms"]
            ]
            ax2.plot(
                *zip(*pts, strict=True), marker=".", label=f"publish → first rollout ({region})"
            )
        ax2.legend(fontsize=7)
    ax1.set_xlabel("policy version")
    ax1.set_ylabel("bytes")
    ax1.set_title("weight sync: bytes per version")
    ax2.set_xlabel("policy version")
    ax2.set_ylabel("ms")
    ax2.set_title("weight sync: time per version")
    return fig


def plot_judges_regions(snap: dict[str, Any]) -> Figure:
    fig, (ax1, ax2) = _axes(2)
    judges = snap["judges"]
    if judges:
        names = list(judges)
        for k, (q, color) in enumerate(
            (("p50_ms", "#3366cc"), ("p95_ms", "#ff9900"), ("max_ms", "#dc3912"))
        ):
            ax1.bar(
                [i + (k - 1) * 0.27 for i in range(len(names))],
                [judges[n][q] or 0 for n in names],
                0.27,
                label=q[:-3],
                color=color,
            )
        ax1.set_xticks(range(len(names)), names)
        ax1.legend(fontsize=7)
    else:
        _no_data(ax1, "no reward")
    ax1.set_ylabel("ms")
    ax1.set_title("judge latency")
    regions = snap["regions"]
    if regions:
        ax2.bar(list(regions), [r["samples"] for r in regions.values()], color="#3366cc")
    else:
        _no_data(ax2, "no trajectory")
    ax2.set_ylabel("samples")
    ax2.set_title("trajectories by region")
    return fig


def plot_lag(snap: dict[str, Any]) -> Figure:
    fig, (ax,) = _axes(width=7)
    lag = snap["lag"]
    if lag:
        ax.barh(list(lag), [g["total"] for g in lag.values()], color="#3366cc")
        ax.invert_yaxis()
    else:
        _no_data(ax, "no group has committed offsets")
    ax.set_xlabel("records behind (at report time)")
    ax.set_title("consumer lag per role group")
    return fig


# --- the page ---------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _headline(snap: dict[str, Any]) -> list[list[Any]]:
    rows = snap["versions"]
    first = next((r for r in rows if r["success"] is not None), None)
    last = next((r for r in reversed(rows) if r["success"] is not None), None)
    return [
        ["policy version (newest manifest)", snap["policy_version"]],
        ["samples (trajectories)", snap["samples"]],
        ["groups admitted / rejected", f"{snap['admitted']} / {snap['rejected']}"],
        [
            "success, first judged version",
            f"{_cell(first['success'])} (v{first['version']})" if first else None,
        ],
        [
            "success, last judged version",
            f"{_cell(last['success'])} (v{last['version']})" if last else None,
        ],
        *_eval_rows(snap.get("evals") or []),
        ["dead letters", sum(snap["dead_letters"].values())],
        ["weight manifests refused", sum((snap.get("weights_refused") or {}).values())],
        ["undecodable records", sum(snap["undecodable"].values())],
    ]


def _eval_rows(evals: list[dict[str, Any]]) -> list[list[Any]]:
    if not evals:
        return [["held-out eval", None]]
    first, last = evals[0], evals[-1]
    released = [e["version"] for e in evals if e["released"]]
    return [
        [
            f"held-out greedy success (v{first['version']} -> v{last['version']})",
            f"{_cell(first['greedy_success'])} -> {_cell(last['greedy_success'])}",
        ],
        [
            f"held-out pass@{last['k']}",
            f"{_cell(first['pass_at_k'])} -> {_cell(last['pass_at_k'])}",
        ],
        ["released versions", ", ".join(f"v{v}" for v in released) or None],
    ]


def _manifest_html(manifest: dict[str, Any] | None) -> str:
    if manifest is None:
        return "<p>No manifest for this run in <code>rl.runs</code>.</p>"
    fields = {k: v for k, v in manifest.items() if k != "config_json"}
    try:
        config = json.dumps(
            json.loads(manifest.get("config_json") or "{}"), indent=2, sort_keys=True
        )
    except ValueError:
        config = str(manifest.get("config_json"))
    return (
        f"<pre>{html.escape(json.dumps(fields, indent=2, default=str))}</pre>"
        f"<h3>resolved config</h3><pre>{html.escape(config)}</pre>"
    )


_STYLE = (
    "body{font:14px/1.45 system-ui,'DejaVu Sans',sans-serif;margin:24px auto;max-width:1150px;"
    "color:#1d2330}img{max-width:100%;border:1px solid #e3e7ee;margin:6px 0}table{border-collapse:"
    "collapse;margin:8px 0}td,th{border-bottom:1px solid #e3e7ee;padding:3px 10px;text-align:left}"
    "pre{background:#f4f6f9;padding:10px;overflow:auto;font-size:12px}h2{margin-top:28px}"
)


def _tables(snap: dict[str, Any]) -> list[str]:
    """The tables below the plots: weight versions, judges, regions, dead letters."""
    weight_keys = (
        "version",
        "kind",
        "raw_bytes",
        "encoded_bytes",
        "ratio",
        "chunks",
        "interval_ms",
    )
    judge_keys = ("count", "errors", "mean_ms", "p50_ms", "p95_ms", "max_ms")
    region_keys = ("samples", "mean_generate_ms", "mean_weights_wait_ms", "last_version")
    weights = [[w[k] for k in weight_keys] for w in snap["weights"][-50:]]
    judges = [[j, *(s[k] for k in judge_keys)] for j, s in snap["judges"].items()]
    regions = [
        [g, *(r[k] for k in region_keys), ", ".join(r["topics"])]
        for g, r in snap["regions"].items()
    ]
    return [
        "<h2>Weight versions (newest 50)</h2>",
        _table(
            ["version", "kind", "raw bytes", "encoded bytes", "ratio", "chunks", "interval ms"],
            weights,
        ),
        "<h2>Judges</h2>",
        _table(["judge", "rewards", "errors", "mean ms", "p50 ms", "p95 ms", "max ms"], judges),
        "<h2>Regions</h2>",
        _table(
            [
                "region",
                "samples",
                "mean generate ms",
                "mean weights wait ms",
                "last version",
                "topics",
            ],
            regions,
        ),
        "<h2>Dead letters</h2>",
        _table(["reason", "records"], [[k, v] for k, v in snap["dead_letters"].items()]),
    ]


def write_report(
    analytics: RunAnalytics,
    manifest: dict[str, Any] | None,
    out: Path,
    now_ms: int,
    complete: bool = True,
) -> Path:
    """Write ``index.html``, the PNGs and ``snapshot.json`` for ``analytics`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    snap = analytics.snapshot(now_ms)
    (out / "snapshot.json").write_text(json.dumps(snap, indent=1, allow_nan=False))
    plots: list[tuple[str, Callable[[], Figure]]] = [
        ("events.png", lambda: plot_events(analytics, snap)),
        ("versions.png", lambda: plot_versions(snap)),
        ("admission.png", lambda: plot_admission(snap)),
        ("weights.png", lambda: plot_weights(snap)),
        ("judges_regions.png", lambda: plot_judges_regions(snap)),
        ("lag.png", lambda: plot_lag(snap)),
    ]
    images = [_save(make(), out / name) for name, make in plots]
    when = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    run = html.escape(analytics.run)
    stopped = "" if complete else "<p><b>Reading stopped idle before every partition's end.</b></p>"
    page = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>rlstream report {run}</title>",
        f"<style>{_STYLE}</style></head><body><h1>Run {run}</h1>",
        f"<p>Report written {when} from the run's streams, read to their end.</p>{stopped}",
        _table(["figure", "value"], _headline(snap)),
        *[f"<img src='{name}' alt='{name}'>" for name in images],
        *_tables(snap),
        "<h2>Run manifest</h2>",
        _manifest_html(manifest),
        "</body></html>",
    ]
    index = out / "index.html"
    index.write_text("\n".join(page))
    return index


def build_report(
    settings: Any, run: str, out: Path, idle_s: float = 10.0, log: Callable[[str], None] = print
) -> Path:
    """Read ``run``'s streams to their current end and write the report into ``out``."""
    import time

    from rlstream.consumers.run_log import run_manifests
    from rlstream.ops.observe.run_reader import RunReader, measure_lag
    from rlstream.producers.client.admin import admin_client

    analytics = RunAnalytics(run=run)
    reader = RunReader(settings, run)
    try:
        complete = reader.read_to_end(analytics.take, analytics.take_undecodable, idle_s=idle_s)
        topics = sorted({t for t, _ in reader.assigned})
    finally:
        reader.close()
    if not topics:
        raise SystemExit(f"error: run {run!r} has no topics (rl.{run}.* or REGION.rl.{run}.*)")
    log(f"read {reader.records} records from {len(topics)} topic(s): {', '.join(topics) or 'none'}")
    analytics.set_lag(measure_lag(admin_client(settings), run))
    manifest = run_manifests(settings).get(run)
    return write_report(analytics, manifest, out, int(time.time() * 1000), complete)
