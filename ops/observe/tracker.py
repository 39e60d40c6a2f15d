"""The tracker role: a run's metrics, recipe and final artifacts in an experiment tracker.

The role reads the run's streams the way the dashboard does (``RunReader``: every partition from
the beginning, no group, no commits, so a restart rebuilds the same figures and moves no role's
offsets), folds them into ``RunAnalytics`` and, every ``interval_s``, writes what is new to the
backend. MLflow is the backend (``mlflow``, an optional extra: ``pip install 'rlstream[tracking]'``;
without it the role refuses to start and says so); W&B is not built in.

Rules:

- one tracker run per rlstream run: found again by its tag ``rlstream.run`` (a restarted role
  goes on logging into the same run, and does not log a per-version figure twice), created with the recipe (the run manifest's resolved
  config, flattened to ``a.b.c`` keys) as params;
- per-version figures are logged once, at step = version (``versioned``): success and mean
  reward by judge, the learner's step statistics (losses, kl, clip fraction ...), weight sizes and
  sync timings (publish interval, first use per region), held-out evaluations; running figures
  (``gauges``: staleness, throughput per stream, admitted, rejections by reason) at the current
  version each time they are written;
- where: ``tracking_uri``, else a SQLite store ``mlflow.db`` in ``artifacts_dir`` (else the
  working directory); the backend, URI and run id are written to ``ARTIFACTS_DIR/tracking.json``
  as soon as the run exists;
- when stopped it reads to the end once more, writes the last figures, then uploads the files of
  ``artifacts`` found in ``artifacts_dir`` (the demo's final HF model folder and plot) and marks
  the run finished.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlstream.schemas.derive import LOCAL
from rlstream.schemas.errors import SetupError

if TYPE_CHECKING:
    from rlstream.consumers.consumer import RoleContext

TAG = "rlstream.run"
TRACKING_FILE = "tracking.json"


class TrackerConfig(BaseModel):
    """The tracker role: where a run's metrics go."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["mlflow"] = Field("mlflow", description="Experiment tracker backend.")
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server, file: or sqlite:); None: a SQLite store in "
        "artifacts_dir.",
        json_schema_extra=LOCAL,
    )
    experiment: str = Field("rlstream", min_length=1, description="MLflow experiment name.")
    interval_s: float = Field(5.0, gt=0, le=3600, description="Seconds between writes.")
    artifacts_dir: str | None = Field(
        None,
        description="Folder of the run's outputs (tracking.json is written there).",
        json_schema_extra=LOCAL,
    )
    artifacts: list[str] = Field(
        default_factory=lambda: ["success_by_version.png", "model"],
        description="Files or folders of artifacts_dir uploaded when the role stops.",
    )


def _key(*parts: Any) -> str:
    """A metric name MLflow accepts (letters, digits, _ - . / and spaces)."""
    return ".".join(str(p) for p in parts).replace(":", "_").replace("@", "_at_")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def versioned(snap: dict[str, Any]) -> list[tuple[str, int, float]]:
    """The per-version figures of a snapshot as ``(key, version, value)`` (see the rules)."""
    out: list[tuple[str, int, float]] = []
    for row in snap.get("versions", []):
        v = int(row["version"])
        out += [("success", v, row["success"])]
        out += [(_key("mean_reward", j), v, m) for j, m in row["mean_reward"].items()]
    for row in snap.get("weights", []):
        v = int(row["version"])
        out += [(_key("learner", k), v, x) for k, x in row["stats"].items()]
        for name in ("encoded_bytes", "ratio", "interval_ms"):
            out.append((_key("weights", name), v, row[name]))
        out += [(_key("weights.first_use_ms", r), v, ms) for r, ms in row["first_use_ms"].items()]
    for row in snap.get("evals", []):
        v = int(row["version"])
        out += [(_key("eval", k), v, row[k]) for k in ("greedy_success", "pass_at_k")]
    return [(k, v, float(x)) for k, v, x in out if _finite(x)]


def gauges(snap: dict[str, Any]) -> list[tuple[str, float]]:
    """The running figures of a snapshot as ``(key, value)`` (see the rules)."""
    out: list[tuple[str, Any]] = [
        ("staleness.recent_mean", snap.get("mean_recent_staleness")),
        ("admitted", snap.get("admitted")),
        ("rejected", snap.get("rejected")),
        ("samples", snap.get("samples")),
    ]
    out += [(_key("rejections", r), n) for r, n in snap.get("rejections", {}).items()]
    out += [(_key("throughput", s, "per_s"), f["rate"]) for s, f in snap.get("streams", {}).items()]
    return [(k, float(x)) for k, x in out if _finite(x)]


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``a.b.c -> value`` strings (MLflow params are flat, <= 6000 chars)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flat_params(v, f"{name}.")
        else:
            out[name] = json.dumps(v)[:6000] if not isinstance(v, str) else v[:6000]
    return out


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise SetupError(
            "the tracker role needs MLflow: pip install 'rlstream[tracking]' (or mlflow)"
        ) from exc
    return mlflow


class MlflowSink:
    """One rlstream run's MLflow run (see the module rules)."""

    def __init__(self, cfg: TrackerConfig, run: str, params: dict[str, str]) -> None:
        mlflow = _mlflow()
        from mlflow.entities import Param

        folder = Path(cfg.artifacts_dir or ".").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.uri = cfg.tracking_uri or f"sqlite:///{folder / 'mlflow.db'}"
        self.client = mlflow.tracking.MlflowClient(self.uri)
        found = self.client.get_experiment_by_name(cfg.experiment)
        # artifacts beside our own store, never in ./mlruns of whatever folder the role ran in
        beside = None if cfg.tracking_uri else (folder / "mlartifacts").as_uri()
        exp = (
            found.experiment_id
            if found
            else self.client.create_experiment(cfg.experiment, artifact_location=beside)
        )
        runs = self.client.search_runs([exp], f"tags.`{TAG}` = '{run}'", max_results=1)
        self.logged: set[tuple[str, int]] = set()
        if runs:
            self.run_id = runs[0].info.run_id
            for key in runs[0].data.metrics:  # a restart: what is logged already stays once
                history = self.client.get_metric_history(self.run_id, key)
                self.logged |= {(key, int(m.step)) for m in history}
        else:
            self.run_id = self.client.create_run(exp, tags={TAG: run}, run_name=run).info.run_id
            items = [Param(k, v) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=items[i : i + 100])
        where = {"backend": "mlflow", "uri": self.uri, "run_id": self.run_id}
        (folder / TRACKING_FILE).write_text(json.dumps(where))

    def write(self, snap: dict[str, Any]) -> int:
        """Log what is new in ``snap``; returns how many values were written."""
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), max(int(snap.get("policy_version", 0)), 0)
        fresh = [(k, v, x) for k, v, x in versioned(snap) if (k, v) not in self.logged]
        metrics = [Metric(k, x, now, v) for k, v, x in fresh]
        metrics += [Metric(k, x, now, step) for k, x in gauges(snap)]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.logged |= {(k, v) for k, v, _ in fresh}
        return len(metrics)

    def finish(self, folder: Path, names: list[str]) -> None:
        for name in names:
            path = folder / name
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), name)
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id)


def run_role(ctx: RoleContext[TrackerConfig]) -> dict[str, Any]:
    """The tracker until stopped (see the module rules); returns what it wrote."""
    from rlstream.consumers.run_log import run_manifest
    from rlstream.ops.observe.analytics import RunAnalytics
    from rlstream.ops.observe.run_reader import RunReader

    cfg: TrackerConfig = ctx.cfg
    _mlflow()  # refuse before reading anything
    try:
        recorded = run_manifest(ctx.settings, ctx.run) or {}
    except (RuntimeError, TimeoutError):  # rl.runs not readable here: no recipe params
        recorded = {}
    sink = MlflowSink(cfg, ctx.run, flat_params(json.loads(recorded.get("config_json") or "{}")))
    analytics, reader = RunAnalytics(run=ctx.run), RunReader(ctx.settings, ctx.run)
    written, last = 0, 0.0
    try:
        while not ctx.stopper.stopped:
            reader.pump(analytics.take, analytics.take_undecodable, timeout=0.5)
            if time.monotonic() - last >= cfg.interval_s:
                written += sink.write(analytics.snapshot(int(time.time() * 1000)))
                last = time.monotonic()
        reader.read_to_end(analytics.take, analytics.take_undecodable, idle_s=5.0)
        written += sink.write(analytics.snapshot(int(time.time() * 1000)))
    finally:
        reader.close()
    sink.finish(Path(cfg.artifacts_dir or "."), cfg.artifacts)
    return {"run_id": sink.run_id, "uri": sink.uri, "values": written}
