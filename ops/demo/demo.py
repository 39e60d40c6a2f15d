"""The main job: a whole asynchronous GRPO run on the local cluster, every role its own process.

``rlstream demo`` starts the local Kafka (one cluster per region, MirrorMaker 2 between them),
creates each region's topics, records the run manifest, starts learner, admission, judges and the
scheduler in the trainer region and the rollout workers in the rollout regions, each a separate
``rlstream run ... --region R`` process, shows live progress read from the trainer region's
streams (local and mirrored), and at the end stops exactly the processes it started (by pid),
writes a PNG (success rate by policy version, staleness histogram) and returns the summary.

``rlstream demo --secure`` runs on the secured local cluster (every region and MirrorMaker 2 link
secured): it applies the run's users, topics and ACLs in each region (``rlstream acl apply
--region R``, each region's own plan) and on each link, every role connects as its own user in
its region (a rollout worker in ``eu`` as ``rollout``, reading the trainer region's copies), and
the demo's own readers (progress, held-out eval, run manifest) as ``admin``.

Per region the progress shows the trajectories admitted (samples of admitted groups, by the
region that generated them) and the weight version the region has applied: for a rollout region
the newest behaviour version among its trajectories (a worker generates a task with the version
it swapped in last), for the trainer region the learner's newest version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.consumers.consumer import Stopper
from rlstream.ops.observe.analytics import RunAnalytics
from rlstream.ops.run.os_users import Users
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.run_keys import RunKeys
from rlstream.schemas import topics


@dataclass
class RoleProcess:
    name: str
    proc: subprocess.Popen
    log: Path


def start_role(
    role: str,
    run: str,
    settings: KafkaSettings,
    logs: Path,
    extra: list[str],
    name: str = "",
    region: str | None = None,
    home: Path | str | None = None,
    env: dict[str, str] | None = None,
) -> RoleProcess:
    """``rlstream run ROLE`` as a process of its own, in ``region`` (reached at ``settings``,
    with its credentials when it has any).

    With ``home`` (the local cluster's state directory) the role is given no address: it finds
    ``region`` there and, when the cluster is secured, connects as its own user (``ops.run.roles``);
    no ``RLSTREAM_BOOTSTRAP``/``RLSTREAM_KAFKA_*`` is passed on that would make it someone else.
    ``env`` is added to this role's environment alone (its part of the run's keys: ``RunKeys.env``).
    """
    name = name or role
    log = logs / f"{name}.log"
    where = (
        ["--home", str(home)] if home is not None else ["--bootstrap", settings.bootstrap_servers]
    )
    cmd = [
        sys.executable,
        "-m",
        "rlstream",
        "run",
        role,
        "--run",
        run,
        *where,
        *(["--region", region] if region else []),
        *extra,
    ]
    inherited = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if home is not None:
        inherited = {k: v for k, v in inherited.items() if not _names_a_cluster(k)}
    else:
        inherited.update(credentials_env(settings))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**inherited, **(env or {})}
        )
    return RoleProcess(name, proc, log)


def start_plan(
    processes: list[Any],
    run: str,
    settings: dict[str, KafkaSettings],
    logs: Path,
    shared: list[str],
    keys: RunKeys,
    home: Path | str | None = None,
    users: Users | None = None,
) -> list[RoleProcess]:
    """Each of a run's ``processes`` (``ops.run.launch.Process``) started in its region, with
    the run's ``shared`` options and its part of the run's ``keys`` (``start_role``), as its
    role's own OS user where ``users`` says so (``ops.run.os_users``)."""
    return [
        start_role(
            p.role,
            run,
            settings[p.region],
            logs,
            [*p.args, *shared],
            p.name,
            region=p.region,
            home=home,
            env={**keys.env(p.role), **(users.env(p.role) if users else {})},
        )
        for p in processes
    ]


def credentials_env(settings: KafkaSettings) -> dict[str, str]:
    """The ``RLSTREAM_KAFKA_*`` variables that give a process started with ``--bootstrap``
    the security settings of ``settings`` (read back by ``KafkaSettings.from_env``)."""
    fields = ("security_protocol", "sasl_mechanism", "sasl_username", "ssl_ca_location")
    env = {
        f"RLSTREAM_KAFKA_{f.upper()}": str(getattr(settings, f))
        for f in fields
        if getattr(settings, f) is not None
    }
    if settings.sasl_password is not None:
        env["RLSTREAM_KAFKA_SASL_PASSWORD"] = settings.sasl_password.get_secret_value()
    return env


def _names_a_cluster(variable: str) -> bool:
    return variable == "RLSTREAM_BOOTSTRAP" or variable.startswith("RLSTREAM_KAFKA_")


def learner_key_file(secure: bool, home: Path, run: str, out: Path) -> Path:
    """Where the run's weight key is kept: in a secured cluster's secrets (where ``acl apply``
    made it), else beside the run's logs."""
    from rlstream.ops.cluster import security
    from rlstream.producers.weights.signing import KEY_FILE

    return security.weights_key_file(home, run) if secure else out / "learner-key" / KEY_FILE


def sign_weights(settings: KafkaSettings, run: str, key_file: Path, insecure: bool) -> RunKeys:
    """The run's weight-signing key, made and recorded in its run manifest before any role
    starts (``consumers.weights.trust.ensure_run_key``); returns the keys each role's process is
    given (``RunKeys.env``): the public key to every role (on a secured cluster the roles may
    not read ``rl.runs``), the private key's file ``key_file`` (mode 0600) to the learner alone.
    ``insecure``: the run is created insecure instead (recorded, said loudly; no keys)."""
    from rlstream.consumers.weights.trust import ensure_run_key

    signer = ensure_run_key(settings, run, key_file, insecure=insecure)
    if signer is None:
        print(f"run {run}: created INSECURE, its weight manifests are not signed", flush=True)
        return RunKeys(insecure=True)
    return RunKeys(signer.public_hex, str(key_file))


def stop_tracker(tracker: RoleProcess, out: Path, timeout: float = 120.0) -> dict | None:
    """Stop the tracker role last (it writes the final figures and uploads the plot and the
    final model from ``out``); its ``{backend, uri, run_id}``, or None when it tracked nothing
    (e.g. MLflow is not installed: its log says so)."""
    from rlstream.ops.observe.tracker import TRACKING_FILE

    stop_roles([tracker], timeout)
    where = out / TRACKING_FILE
    return json.loads(where.read_text()) if where.exists() else None


def stop_roles(roles: list[RoleProcess], timeout: float = 20.0) -> None:
    """SIGTERM each role we started (by pid), wait, then SIGKILL what is left."""
    for r in roles:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in roles:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


@dataclass
class RegionTally:
    """Per region: samples of admitted groups it generated, newest behaviour version seen."""

    admitted: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def take(self, topic: str, record: dict[str, Any]) -> None:
        stream = topics.parse_topic(topic).stream
        if stream == "trajectories":
            region = str(record.get("region") or "")
            version = int(record["policy_version"])
            self.versions[region] = max(self.versions.get(region, -1), version)
        elif stream == "admitted" and int(record.get("part_index", 0)) == 0:
            for sample in record.get("samples") or []:
                region = str(sample.get("region") or "")
                self.admitted[region] = self.admitted.get(region, 0) + 1

    def figures(self, regions: topics.Regions, learner_version: int) -> dict[str, Any]:
        out = {}
        for name in regions.names:
            own = learner_version if name == regions.trainer else self.versions.get(name, -1)
            out[name] = {
                "trajectories_admitted": self.admitted.get(name, 0),
                "weights_version": own,
            }
        return out


def follow_streams(
    settings: KafkaSettings,
    run: str,
    progress: RunAnalytics,
    stopper: Stopper,
    regions: topics.Regions | None = None,
    tally: RegionTally | None = None,
) -> None:
    """Feed ``progress`` (and ``tally``) from the run's streams in the trainer region, local and
    mirrored home, until stopped (runs in a thread)."""
    from rlstream.consumers.consumer import RoleConsumer, make_consumer

    regions = regions or topics.Regions()
    streams = ["rewards", "trajectories", "admitted", "rejected", "weights.manifests"]
    consumer = RoleConsumer(
        make_consumer(
            settings,
            f"rlstream.{run}.demo-monitor",
            **{"topic.metadata.refresh.interval.ms": "2000"},
        ),
        [regions.pattern(run, s, regions.trainer) for s in streams],
        settings=settings,
    )
    try:
        while not stopper.stopped:
            for rec in consumer.poll_batch(500, 0.5):
                if rec.event is not None:
                    topic = rec.topic_partition[0]
                    progress.take(topic, rec.value, rec.message.timestamp()[1])
                    if tally is not None:
                        tally.take(topic, rec.value)
    finally:
        consumer.close()


#: Versions pooled on each side of a version for the training samples' smoothed success curve.
SMOOTH_VERSIONS = 5


def smoothed_success(progress: RunAnalytics, half_window: int = SMOOTH_VERSIONS) -> list[float]:
    """Per judged version, the success rate of the samples of the versions within
    ``half_window`` of it, pooled (a version's own rate rests on a few groups and swings widely)."""
    versions = sorted(progress.success)
    return [progress.rate(range(v - half_window, v + half_window + 1)) for v in versions]


def write_png(
    progress: RunAnalytics, path: Path, evals: list[dict[str, Any]] | None = None
) -> None:
    """Success by policy version (the training samples' per-version rate faint, smoothed bold,
    and the held-out greedy success and pass@k of ``evals`` when given), beside the staleness
    histogram. No per-point labels: the curves are read at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(2, 1))
    _plot_success(ax1, progress, evals or [])
    staleness = progress.staleness["admitted"] + progress.staleness["rejected"]
    ax2.bar(list(staleness), list(staleness.values()), width=0.8, color="tab:gray")
    ax2.set_xlabel("staleness at admission (versions)")
    ax2.set_ylabel("groups")
    ax2.set_xticks(sorted(staleness))
    ax2.set_title("staleness of the groups decided")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_success(ax: Any, progress: RunAnalytics, evals: list[dict[str, Any]]) -> None:
    versions = sorted(progress.success)
    rates = [progress.rate([v]) for v in versions]
    ax.plot(versions, rates, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(
        versions,
        smoothed_success(progress),
        color="tab:blue",
        linewidth=2,
        label=f"training samples (temperature 1; ±{SMOOTH_VERSIONS} versions pooled)",
    )
    if evals:
        xs = [int(e["version"]) for e in evals]
        ax.plot(
            xs,
            [e["greedy_success"] for e in evals],
            "o-",
            color="tab:red",
            linewidth=2,
            label="held-out tasks, greedy",
        )
        k = evals[-1].get("k")
        ax.plot(
            xs,
            [e["pass_at_k"] for e in evals],
            "s--",
            color="tab:orange",
            label=f"held-out tasks, pass@{k}" if k else "held-out tasks, pass@k",
        )
    ax.set_xlabel("policy version")
    ax.set_ylabel("success rate (hidden tests)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("success by policy version")
    ax.legend(loc="best", fontsize=8)


def status_line(
    progress: RunAnalytics, started: float, regions: dict[str, Any] | None = None
) -> str:
    newest = sorted(progress.success)[-2:]
    per_region = "".join(
        f"\n    region {name}: {r['trajectories_admitted']} trajectories admitted, "
        f"weights v{r['weights_version']}"
        for name, r in (regions or {}).items()
    )
    return (
        f"[{time.monotonic() - started:5.0f}s] policy v{progress.version}  success "
        f"{progress.rate(newest):.2f} (v{newest[-1] if newest else '-'})  trajectories "
        f"{progress.trajectories}  rewards {progress.rewards}  admitted {progress.admitted}  "
        f"rejected {sum(progress.rejected.values())}  staleness "
        f"{progress.mean_recent_staleness() or 0.0:.1f}{per_region}"
    )


def summary(
    run: str,
    progress: RunAnalytics,
    wall: float,
    png: Path,
    regions: topics.Regions | None = None,
    tally: RegionTally | None = None,
) -> dict[str, Any]:
    final = progress.final_versions()
    regions = regions or topics.Regions()
    tally = tally or RegionTally()
    return {
        "run": run,
        "warm_start_success": progress.rate([0]),
        "final_success": progress.rate(final),
        "final_versions": sorted(final),
        "policy_versions": progress.version,
        "wall_seconds": round(wall, 1),
        "groups_admitted": progress.admitted,
        "groups_rejected": sum(progress.rejected.values()),
        "rejected_by_reason": dict(progress.rejected),
        "trajectories": progress.trajectories,
        "trainer_region": regions.trainer,
        "regions": tally.figures(regions, progress.version),
        "png": str(png),
    }


def last_due(version: int, every: int) -> int:
    """The newest version the eval role evaluates at or below ``version`` (0 and every N-th)."""
    return max(0, version) // every * every


def wait_for_eval(
    settings: KafkaSettings, run: str, version: int, roles: list[RoleProcess], grace_s: float = 90
) -> None:
    """Wait (at most ``grace_s``) until the eval role has written the eval of ``version``."""
    from rlstream.consumers.eval_log import read_evals

    deadline = time.monotonic() + grace_s
    print(f"waiting for the held-out eval of v{version} ...", flush=True)
    while time.monotonic() < deadline and all(r.proc.poll() is None for r in roles):
        if any(int(r["version"]) >= version for r in read_evals(settings, run, timeout=20)):
            return
        time.sleep(2.0)


def eval_summary(settings: KafkaSettings, run: str, model: str) -> dict[str, Any]:
    """The held-out figures of the run's eval events (None when there are none): greedy success
    of the warm start and of the last evaluated version, pass@k of both, the released versions."""
    from rlstream.consumers.eval_log import read_evals

    evals = sorted(
        (r for r in read_evals(settings, run, timeout=20) if r["model"] == model),
        key=lambda r: int(r["version"]),
    )
    first = next((r for r in evals if int(r["version"]) == 0), None)
    last = evals[-1] if evals else None
    return {
        "eval_warm_start": None if first is None else first["greedy_success"],
        "eval_final": None if last is None else last["greedy_success"],
        "eval_final_version": None if last is None else int(last["version"]),
        "eval_pass_at_k_warm_start": None if first is None else first["pass_at_k"],
        "eval_pass_at_k": None if last is None else last["pass_at_k"],
        "k": None if last is None else int(last["k"]),
        "eval_tasks": None if last is None else int(last["n_tasks"]),
        "eval_versions": [int(r["version"]) for r in evals],
        "eval_released": [int(r["version"]) for r in evals if r["released"]],
        "eval_curve": [
            {
                "version": int(r["version"]),
                "greedy_success": r["greedy_success"],
                "pass_at_k": r["pass_at_k"],
                "sample_success": r["sample_success"],
                "released": r["released"],
            }
            for r in evals
        ],
    }


def final_model(
    settings: KafkaSettings, run: str, config: Any, version: int, out: Path, timeout: float = 120
) -> dict[str, Any]:
    """The run's final policy: ``final_version``, ``final_state_hash`` (the learner's, as in the
    manifest) and ``model_dir`` (``out/model``, or None when no version at or past
    ``version`` could be read back)."""
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.schemas.deltacodec.bits import state_hash, to_torch

    with WeightSubscriber(settings, run, config.model) as sub:
        snap = sub.wait_for(version, timeout=timeout)
    if snap is None or snap.version < version:
        return {"final_version": None, "final_state_hash": None, "model_dir": None}
    result = {"final_version": snap.version, "final_state_hash": state_hash(snap.state)}
    from rlstream.rollout.hf_policy import save_state_hf

    save_state_hf(config.policy, to_torch(snap.state), out / "model")
    return {**result, "model_dir": str(out / "model")}


VLLM_DEMO_SETS = ("rollout.engine=vllm", "policy.head_dim=64")
"""``rlstream demo --engine vllm``: rollouts on vLLM servers the workers supervise. The demo's
policy has heads of 16 (d_model 64, 4 heads), which vLLM's CPU attention does not run; this demo
gives them 64 (the attention projections grow to 4 x 64 wide; everything else is the same)."""


FEEDBACK_SETS = ["feedback_rl.window_seconds=2", "feedback_rl.max_staleness=10"]
"""With ``--feedback``: feedback-rl closes a window 2 s after its first feedback (default 10 s,
five versions of the demo's learner), and online groups keep a staleness budget of 10 versions:
the served version trails the learner by the policy server's swap, the editor's request and the
window, 6-15 s in all, and this learner publishes a version every 1-3 s (a budget of 4 refused
2 or 3 of the 4-5 online groups of each of three test runs on a quiet machine as stale)."""


def engine_sets(engine: str, out: Path) -> list[str]:
    """The overrides that put the run's rollouts on ``engine`` and keep its figures in
    ``out/engines`` (each worker's engine writes its own file there)."""
    sets = [f"rollout.engine_stats_dir={out / 'engines'}"]
    if engine == "vllm":
        sets += [*VLLM_DEMO_SETS, f"rollout.vllm.work_dir={out / 'logs'}"]
    return sets


def engine_summary(folder: Path) -> dict[str, Any]:
    """The rollout workers' engine figures (``engine_stats_dir`` files), summed over workers:
    ``engine``, ``engine_version``, ``engine_swaps``, ``engine_restarts`` (0 when nothing
    failed), ``engine_refusals``, ``swap_p50_s`` and ``pause_s_p50``/``pause_s_p99`` (over every
    swap: the pause generation saw, pause -> resumed for vLLM), ``sync_s_p50`` (the whole way
    in, the preparing done while generation went on included), ``engine_checks`` {``checked``,
    ``mismatches``, ``repaired``} and ``engine_check_gap_max`` (the checks of what a vLLM engine
    holds, its backend's checkpoint hash and the canary: ``rollout.vllm_engine``),
    ``engine_memory_bytes`` (the largest worker's
    engine, PSS; None for the in-process engine)."""
    import statistics

    from rlstream.rollout.engines import percentile

    figures = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    swaps = [s for f in figures for s in f.get("swap_s") or []]
    syncs = [s for f in figures for s in f.get("sync_s") or []]
    memory = [f["engine_memory_bytes"] for f in figures if f.get("engine_memory_bytes")]
    gaps = [f["engine_check_gap_max"] for f in figures if f.get("engine_check_gap_max") is not None]
    return {
        "engine": figures[0]["engine"] if figures else None,
        "engine_version": figures[0]["engine_version"] if figures else None,
        "engine_workers": len(figures),
        "engine_swaps": sum(int(f["engine_swaps"]) for f in figures),
        "engine_restarts": sum(int(f["engine_restarts"]) for f in figures),
        "engine_refusals": sum(int(f["engine_refusals"]) for f in figures),
        "swap_p50_s": statistics.median(swaps) if swaps else None,
        "pause_s_p50": percentile(swaps, 50),
        "pause_s_p99": percentile(swaps, 99),
        "sync_s_p50": percentile(syncs, 50),
        "engine_checks": {
            "checked": sum(int(f.get("engine_checks") or 0) for f in figures),
            "mismatches": sum(int(f.get("engine_check_failures") or 0) for f in figures),
            "repaired": sum(int(f.get("engine_repairs") or 0) for f in figures),
        },
        "engine_check_gap_max": max(gaps) if gaps else None,
        "engine_memory_bytes": max(memory) if memory else None,
    }


def weights_summary(settings: KafkaSettings, run: str, config: Any) -> dict[str, Any]:
    """What a version costs on the wire and to swap in: ``lora_rank``; the chunk bytes of each
    version after 0 (``wire_bytes_per_version_p50``, and of deltas alone), the full state's
    bytes; a fresh subscriber's apply time per version (``apply_ms_p50``) and the torch engine's
    swap of the newest state into a policy (``swap_ms``)."""
    import statistics

    import torch

    from rlstream.consumers.weights.manifest_log import read_manifests
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.rollout.model import build_policy
    from rlstream.schemas.deltacodec.bits import to_torch

    manifests = [m for m in read_manifests(settings, run, config.model) if m["version"] > 0]
    deltas = [m["encoded_bytes"] for m in manifests if m["kind"] == "delta"]
    out: dict[str, Any] = {
        "lora_rank": config.policy.lora.rank,
        "wire_bytes_per_version_p50": statistics.median([m["encoded_bytes"] for m in manifests])
        if manifests
        else None,
        "wire_bytes_per_delta_p50": statistics.median(deltas) if deltas else None,
        "state_bytes": manifests[-1]["raw_bytes"] if manifests else None,
        "apply_ms_p50": None,
        "swap_ms": None,
    }
    if not manifests:
        return out
    with WeightSubscriber(settings, run, config.model) as sub:
        snap = sub.wait_for(manifests[-1]["version"], timeout=120)
        applied = [r.apply_s * 1000 for r in sub.reports]
    if snap is not None:
        policy = build_policy(config.policy)
        started = time.perf_counter()
        with torch.no_grad():
            policy.load_state_dict(to_torch(snap.state))
        out["swap_ms"] = round((time.perf_counter() - started) * 1000, 2)
        out["apply_ms_p50"] = round(statistics.median(applied), 2) if applied else None
    return out


def json_default(value: Any) -> Any:
    return float(value) if isinstance(value, int | float) else str(value)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, default=json_default)


def recipe_and_model(
    config: str | None, recipe: str | None, model: str | None, sets: list[str]
) -> tuple[str | None, list[str]]:
    """``demo --recipe NAME`` / ``--model DIR`` as the recipe path and ``--set`` items they
    mean; ``SystemExit`` with the reason for an unknown recipe or an unusable model folder."""
    from rlstream.ops.run.config import find_recipe
    from rlstream.rollout.config import check_model_dir

    if recipe is not None:
        if config is not None:
            raise SystemExit("error: --recipe and --config name the recipe twice: give one")
        config = find_recipe(recipe)
    if model is not None:
        try:
            sets = [*sets, f"policy.hf_dir={check_model_dir(model)}"]
        except ValueError as exc:
            raise SystemExit(f"error: --model: {exc}") from None
    return config, sets


def model_record(policy: Any) -> dict[str, Any]:
    """What the run's policy is: ``architecture`` (the model type), ``params`` and ``source``
    (an imported file and its SHA-256, the folder, or the built-in model's shape)."""
    from rlstream.rollout.model import build_policy

    params = sum(p.numel() for p in build_policy(policy).parameters())
    if policy.hf_dir is None:
        return {"architecture": policy.architecture, "params": params, "source": "built-in"}
    from rlstream.rollout.model_import import imported_from

    found = imported_from(policy.hf_dir)
    source = found.get("source_name") or policy.hf_dir
    if found.get("sha256"):
        source = f"{source} (sha256 {found['sha256'][:12]})"
    return {"architecture": found.get("model_type"), "params": params, "source": source}


def throughput(
    settings: KafkaSettings, run: str, model: str, regions: topics.Regions
) -> dict[str, float | None]:
    """The run's speeds from its own records: ``generate_tokens_per_s``, the tokens the rollout
    engines generated over the time they spent generating (a group's samples are generated
    together, so a group counts its slowest sample's time), and ``train_tokens_per_s``, the
    loss-bearing tokens the learner trained on over its optimizer steps' time."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.consumers.weights.manifest_log import read_manifests
    from rlstream.schemas import arrays, events

    tokens: dict[str, int] = {}
    seconds: dict[str, float] = {}
    name = topics.topic_name(run, "trajectories")
    for source in regions.sources("trajectories", regions.trainer):  # every region's copy
        for msg in read_topic(settings, topics.remote_topic(source, name), name="demo-throughput"):
            value = msg.value()
            if value is None:
                continue
            record = events.decode(value).record
            group = f"{source}/{record['group_id']}"
            mask = arrays.unpack_tokens(record).loss_mask
            tokens[group] = tokens.get(group, 0) + int(mask.sum())
            spent = record["timings"]["generate_ms"] / 1000
            seconds[group] = max(seconds.get(group, 0.0), spent)
    stats = [m["stats"] for m in read_manifests(settings, run, model) if m["version"] > 0]
    trained = sum(float(s.get("tokens", 0.0)) for s in stats)
    step_s = sum(float(s.get("step_s", 0.0)) for s in stats)
    generate_s = sum(seconds.values())
    return {
        "generate_tokens_per_s": sum(tokens.values()) / generate_s if generate_s else None,
        "train_tokens_per_s": trained / step_s if step_s else None,
    }
