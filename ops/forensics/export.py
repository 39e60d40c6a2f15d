"""``rlstream export``: any committed version of a run as an ordinary Hugging Face folder.

The version is rebuilt from the run's weight log the way a rollout worker rebuilds it (the newest
keyframe at or before it, then its deltas, every manifest's signature and every tensor's hash
checked), and must hash to the state hash the learner published for it. The folder is the run's
policy (``config.json``, ``model.safetensors`` in the published dtype, the tokenizer) and a note
(``rlstream-export.json``: run, version, state hash); ``transformers`` loads it without rlstream.
The run's policy config comes from its run manifest, or from ``--config``/``--set`` when the run
recorded none. Written under a temporary name and renamed into place: nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import RlstreamError

NOTE = "rlstream-export.json"


class ExportError(RlstreamError, RuntimeError):
    """The version cannot be exported; the message says why."""


def run_policy(settings: KafkaSettings, run: str, config: str | None, sets: list[str]) -> Any:
    """The run's config: recorded in its run manifest when it has one, else the recipe given."""
    from rlstream.consumers.run_log import run_manifest
    from rlstream.ops.run.config import RunConfig, load_run_config

    recorded = run_manifest(settings, run)
    text = (recorded or {}).get("config_json") or "{}"
    if text != "{}" and not config and not sets:
        return RunConfig.model_validate(json.loads(text))
    return load_run_config(config, sets)


def export_version(
    settings: KafkaSettings,
    run: str,
    version: int | None,
    out: str | Path,
    run_config: Any,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Write ``version`` (None: the newest) of ``run`` to ``out`` (module rules); returns the
    note. ``ExportError`` when the version is not in the log or does not rebuild."""
    from rlstream.consumers.weights.manifest_log import read_manifests
    from rlstream.consumers.weights.subscriber import WeightSubscriber
    from rlstream.rollout.hf_policy import save_state_hf
    from rlstream.schemas.deltacodec.bits import state_hash, to_torch
    from rlstream.schemas.deltacodec.manifest import hash_algorithm

    target = Path(out)
    if target.exists():
        raise ExportError(f"{target} exists: name a new folder")
    model = run_config.model
    manifests = {m["version"]: m for m in read_manifests(settings, run, model)}
    if not manifests:
        raise ExportError(f"run {run!r} has no weight manifests of model {model!r}")
    version = max(manifests) if version is None else version
    if version not in manifests:
        raise ExportError(
            f"version {version} of run {run!r} is not in the weight log (versions "
            f"{min(manifests)}..{max(manifests)} are: older ones were pruned)"
        )
    with WeightSubscriber(settings, run, model, fetch_timeout=timeout) as sub:
        sub.ceiling = version
        snap = sub.wait_for(version, timeout=timeout)
        refused = sub.refusal_of(version)
    if snap is None or snap.version != version:
        raise ExportError(f"version {version} did not rebuild: {refused or 'timed out'}")
    want = manifests[version]["state_hash"]
    got = state_hash(snap.state, hash_algorithm(manifests[version]))
    if got != want:
        raise ExportError(f"version {version} rebuilt to {got}, the learner published {want}")
    target.parent.mkdir(parents=True, exist_ok=True)
    note = {"run": run, "version": version, "state_hash": want, "model": model}
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        staging = Path(tmp) / "model"
        save_state_hf(run_config.policy, to_torch(snap.state), staging)
        (staging / NOTE).write_text(json.dumps(note, indent=1) + "\n")
        shutil.move(str(staging), target)
    return {**note, "folder": str(target)}
