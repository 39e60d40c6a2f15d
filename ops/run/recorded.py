"""A run's recorded config: written once by whoever creates the run, checked by every role.

The config a run records is its resolved ``RunConfig``; what its roles must agree on is that
config without the values of one process or host (paths, addresses, thread counts, ranks: the
fields marked ``LOCAL``, ``schemas.derive.shared``). Its hash (``config_hash``) names it.

Rules (``check_config``, at every role's start, before the role touches its streams):

- no manifest, or one without a config (the learner's weight key can create the run first): the
  role records its own config, keeping every other field of the manifest; in a rollout region,
  which may not write the trainer region's ``rl.runs``, the role goes on unchecked and says so;
- a recorded config: the role's must hash the same, else the role refuses to start with
  ``ConfigMismatch``, naming each key that differs and both values; the supervisor does not
  restart a role that failed so (exit status ``schemas.errors.CONFIG_EXIT``);
- ``rl.runs`` this client may not read (a secured cluster gives roles no read of it): unchecked,
  said in the role's log.

``rlstream demo`` and ``rlstream launch`` record the config before any role starts, so a run they
start is checked from its first role; two roles racing to create a run both record, and the one
whose record did not win refuses at its next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlstream.schemas import topics
from rlstream.schemas.derive import shared
from rlstream.schemas.errors import SetupError

if TYPE_CHECKING:
    from rlstream.ops.run.config import RunConfig
    from rlstream.producers.client.settings import KafkaSettings

log = logging.getLogger(__name__)

MAX_SHOWN = 60  # characters of a value shown in a difference


class ConfigMismatch(SetupError):
    """This role's config is not the one its run recorded."""


def config_hash(config: RunConfig | dict[str, Any]) -> str:
    """The hash of what a run's roles agree on (16 hex digits of SHA-256 of its canonical JSON)."""
    view = config if isinstance(config, dict) else shared(config)
    text = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recorded_view(config_json: str) -> dict[str, Any] | None:
    """The shared view of a recorded ``config_json`` (None when none was recorded), read back
    through ``RunConfig`` so that defaults added since it was written compare equal."""
    from rlstream.ops.run.config import RunConfig

    data = json.loads(config_json or "{}")
    if not data:
        return None
    return shared(RunConfig.model_validate(data))


def differences(recorded: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """``key: recorded X, here Y`` for every dotted key whose value differs, sorted."""
    flat_a, flat_b = _flatten(recorded), _flatten(ours)
    lines = []
    for key in sorted(flat_a.keys() | flat_b.keys()):
        a, b = flat_a.get(key, "(absent)"), flat_b.get(key, "(absent)")
        if a != b:
            lines.append(f"{key}: recorded {_shown(a)}, here {_shown(b)}")
    return lines


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) or value == "(absent)" else repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def check_config(
    settings: KafkaSettings, run: str, config: RunConfig, *, region: str, trainer: str
) -> str:
    """Record or check this role's ``config`` against run ``run``'s (rules in the module
    docstring); returns a line for the role's log. Raises ``ConfigMismatch``."""
    from confluent_kafka import KafkaException

    from rlstream.consumers.run_log import run_manifest

    home = region == trainer
    topic = topics.RUNS_TOPIC if home else topics.remote_topic(trainer, topics.RUNS_TOPIC)
    ours = shared(config)
    digest = config_hash(ours)
    try:
        manifest = run_manifest(settings, run, topic=topic)
    except (RuntimeError, TimeoutError, KafkaException) as exc:
        return f"config {digest}: unchecked, {topic} not readable here ({exc})"
    recorded = recorded_view(manifest.get("config_json", "")) if manifest else None
    if recorded is None:
        if not home:
            return f"config {digest}: unchecked, run {run} has no config in {topic} yet"
        record_config(settings, run, config, manifest)
        return f"config {digest}: recorded for run {run}"
    if config_hash(recorded) == digest:
        return f"config {digest}: the run's"
    lines = differences(recorded, ours)
    raise ConfigMismatch(
        f"run {run} was recorded with config {config_hash(recorded)}, this role has {digest}; "
        f"start it with the run's recipe and --set values, or name a new run. Differences:\n  "
        + "\n  ".join(lines)
    )


def create_run(settings: KafkaSettings, run: str, config: RunConfig, regions: list[str]) -> str:
    """Record ``config`` as run ``run``'s before its roles start (``demo``, ``launch``): a new
    run, or a run recorded with the same config; raises ``ConfigMismatch`` for another config.
    Returns the config's hash."""
    from rlstream.consumers.run_log import run_manifest

    manifest = run_manifest(settings, run)
    recorded = recorded_view(manifest.get("config_json", "")) if manifest else None
    ours = shared(config)
    if recorded is not None and config_hash(recorded) != config_hash(ours):
        raise ConfigMismatch(
            f"run {run} exists with config {config_hash(recorded)}, not {config_hash(ours)}: "
            "name a new run (--run), or use its recipe. Differences:\n  "
            + "\n  ".join(differences(recorded, ours))
        )
    record_config(settings, run, config, manifest, regions=regions)
    return config_hash(ours)


def record_config(
    settings: KafkaSettings,
    run: str,
    config: RunConfig,
    manifest: dict[str, Any] | None,
    status: str = "running",
    regions: list[str] | None = None,
) -> None:
    """Write run ``run``'s manifest with ``config``, keeping every other field ``manifest`` has
    (its weight key, its creation time); ``regions`` default: the manifest's, else the
    config's."""
    created = int((manifest or {}).get("created_ms") or time.time() * 1000)
    if regions is None:
        regions = list((manifest or {}).get("regions") or config.regions.topology().names)
    record_run_manifest(settings, run, config, status, created, regions)


def record_run_manifest(
    settings: KafkaSettings,
    run: str,
    config: RunConfig,
    status: str,
    created_ms: int,
    regions: list[str],
) -> None:
    """Put the run manifest (resolved config, seeds, code version, topics) in ``rl.runs``,
    keeping the weight fields recorded for the run (its signing key)."""
    from rlstream import __version__
    from rlstream.consumers.run_log import run_manifest
    from rlstream.consumers.weights.trust import weight_fields
    from rlstream.producers.client.producer import EventProducer

    record = {
        "run": run,
        "created_ms": created_ms,
        "updated_ms": int(time.time() * 1000),
        "status": status,
        "config_json": config.model_dump_json(),
        "seeds": {"run": config.seed},
        "code_version": _code_version(__version__),
        "model": config.model,
        "start_offsets": [],
        "topics": sorted(topics.run_topics(run).values()),
        "regions": regions,
        **weight_fields(run_manifest(settings, run)),  # the run's key stays recorded
    }
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", record, run)


def _code_version(version: str) -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    return f"{version}+{sha}" if sha else version
