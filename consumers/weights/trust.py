"""A run's weight trust: the key its manifests are verified with, pinned, never read from a record.

Rules:

- resolve (``run_trust``): a reader of run R's manifests, in any region, takes the public key
  (or the explicit insecure choice) its launcher gave it (``$RLSTREAM_WEIGHTS_VERIFY_KEY``,
  ``$RLSTREAM_WEIGHTS_INSECURE``; a role on a secured cluster takes it from the cluster's
  secrets, one started by hand from the run's key folder in ``learner.state_dir``), else what
  this host pins R to (``producers.weights.run_keys.pinned``: written by R's creator here, or
  with ``rlstream trust pin``); for a replay (``audit``) with neither, any manifest, said loudly
  (hashes still checked); else nothing is accepted (fail-closed) and the reader looks again.
  No record on a topic is a trust anchor: ``rl.runs`` (or MirrorMaker's copy of it) is written
  by whoever may write that cluster, so neither a key nor ``insecure`` is read there;
- create (``ensure_run_key``): a run gets its key once, from whoever creates it (``rlstream
  demo``, ``launch``, before any role starts) or at the learner's first start when nothing is
  recorded yet: the private half in a file only the learner is given, the public half beside
  it (``PUBLIC_FILE``), pinned on this host and recorded in the run manifest (for people and
  tools; every other field kept). A learner whose key file is missing, or holds another key
  than the one recorded, refuses to start; ``insecure=True`` records the explicit choice to
  publish unsigned instead, and a learner without it refuses a run recorded insecure (a
  record never downgrades it to unsigned);
- a run manifest written again (``rlstream demo`` at the end of a run) keeps the weight fields
  (``weight_fields``);
- a key folder (the key file and, beside it, ``PUBLIC_FILE``) hands the key over by
  environment (``key_folder_env``): the public key to every role, the key file's path to the
  learner's process alone (on a secured cluster, made in its secrets by ``acl apply``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from rlstream.consumers.run_log import run_manifest
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.run_keys import INSECURE_ENV, RunKeys, pin, pin_path, pinned
from rlstream.producers.weights.signing import (
    KEY_FILE,
    VERIFY_KEY_ENV,
    Signer,
    Trust,
    Verifier,
    generate,
)
from rlstream.schemas import topics

log = logging.getLogger(__name__)

#: The run manifest's weight fields (``RunManifest`` v6).
KEY_FIELD, INSECURE_FIELD = "weights_public_key", "weights_insecure"
#: Beside the key file: the public key in hex (what the other roles may be given).
PUBLIC_FILE = "weights-public-key.hex"
UNREADABLE = object()
INSECURE_WARNING = (
    "run %s was created INSECURE: its weight manifests are not signed and are accepted "
    "unchecked; anyone who can write its topics can make its workers serve their weights"
)


def weight_fields(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The weight fields of a run manifest (defaults when there is none)."""
    record = record or {}
    return {KEY_FIELD: record.get(KEY_FIELD), INSECURE_FIELD: bool(record.get(INSECURE_FIELD))}


def _recorded(settings: KafkaSettings, run: str) -> Any:
    """Run ``run``'s manifest as this client may read it: the record, None when there is none,
    or ``UNREADABLE`` when this client may not read ``rl.runs`` (the reason is logged)."""
    topic = topics.RUNS_TOPIC
    try:
        return run_manifest(settings, run, topic=topic)
    except (RuntimeError, TimeoutError, KafkaException) as exc:
        log.info("weights: %s not readable here (%s): no run key taken from it", topic, exc)
        return UNREADABLE


def run_trust(topic: str, *, audit: bool = False) -> Trust:
    """The trust of the run whose manifests ``topic`` holds (rules in the module docstring)."""
    name = topics.parse_topic(topic)
    assert name.run is not None
    return keys_trust(RunKeys.from_env(), name.run, audit=audit)


def keys_trust(given: RunKeys, run: str, *, audit: bool = False) -> Trust:
    """The trust of run ``run`` from the keys a reader was ``given``, else this host's pin."""
    if given.known:
        source = f"${VERIFY_KEY_ENV}" if given.verify_hex else f"${INSECURE_ENV}"
    else:
        given, source = pinned(run), f"pinned on this host ({pin_path(run)})"
    if given.verify_hex:
        return Trust(Verifier.from_hex(given.verify_hex), source=source)
    if given.insecure:
        log.warning(INSECURE_WARNING, run)
        return Trust(insecure=True, source=f"run {run} created insecure ({source})")
    if audit:
        log.warning(
            "replaying run %s with no key given or pinned: its manifests are NOT verified "
            "(their hashes still are); pin its key (rlstream trust pin) to verify them",
            run,
        )
        return Trust(insecure=True, source=f"replay of {run}, no key given or pinned")
    return Trust(
        source=f"no key given (${VERIFY_KEY_ENV}) or pinned on this host for run {run} "
        f"({pin_path(run)}; rlstream trust pin): a record on a topic is never trusted"
    )


def record_weight_fields(
    settings: KafkaSettings, run: str, *, public_hex: str | None = None, insecure: bool = False
) -> None:
    """Write run ``run``'s manifest with its weight key (or explicit insecure choice), every
    other field as recorded (a manifest of status ``created`` when there is none)."""
    from rlstream import __version__

    now = int(time.time() * 1000)
    record = run_manifest(settings, run) or {
        "run": run,
        "created_ms": now,
        "status": "created",
        "config_json": "{}",
        "seeds": {},
        "code_version": __version__,
        "model": "",
        "start_offsets": [],
        "topics": sorted(topics.run_topics(run).values()),
        "description": "created by the run's first learner start (its weight key)",
    }
    record = {**record, "updated_ms": now, KEY_FIELD: public_hex, INSECURE_FIELD: insecure}
    with EventProducer.connect(settings) as producer:
        producer.produce(topics.RUNS_TOPIC, "run_manifest", record, run)


def ensure_run_key(
    settings: KafkaSettings,
    run: str,
    key_file: str | Path,
    *,
    insecure: bool = False,
    given: str | None = None,
) -> Signer | None:
    """``_ensure_run_key``, with the public key written beside the key file (``PUBLIC_FILE``).
    ``given``: the public key this process was given (default: its ``$RLSTREAM_WEIGHTS_VERIFY_KEY``)."""
    given = given if given is not None else os.environ.get(VERIFY_KEY_ENV)
    signer = _ensure_run_key(settings, run, key_file, insecure, given)
    if signer is not None:
        (Path(key_file).parent / PUBLIC_FILE).write_text(signer.public_hex + "\n")
    pin(run, RunKeys(signer.public_hex) if signer else RunKeys(insecure=True))
    return signer


def _ensure_run_key(
    settings: KafkaSettings, run: str, key_file: str | Path, insecure: bool, given: str | None
) -> Signer | None:
    """The learner's signer of ``run`` (None for a run created insecure), its key created and
    recorded when the run has none (rules in the module docstring). Raises ``RuntimeError``
    when the run is recorded with a key that ``key_file`` does not hold, or has none and this
    client can neither read nor record one."""
    path = Path(key_file)
    if given and path.exists() and Signer.from_file(path).public_hex == given.strip():
        return Signer.from_file(path)  # the launcher's key, as every reader is given it
    recorded = _recorded(settings, run)
    if recorded is UNREADABLE:  # a secured cluster: the run's creator recorded the key
        if not path.exists():
            raise RuntimeError(
                f"no key at {path} and {topics.RUNS_TOPIC} not readable: create "
                f"run {run} with its key first (rlstream demo --secure)"
            )
        return Signer.from_file(path)
    fields = weight_fields(recorded)
    if fields[INSECURE_FIELD] and not insecure:
        raise RuntimeError(
            f"run {run} is recorded insecure (unsigned weights) but this learner is not "
            "configured so (learner.insecure_weights): refusing to publish unsigned weights "
            "on a record's word"
        )
    if fields[INSECURE_FIELD] or (insecure and not fields[KEY_FIELD]):
        if not fields[INSECURE_FIELD]:
            record_weight_fields(settings, run, insecure=True)
        log.warning(INSECURE_WARNING, run)
        return None
    if fields[KEY_FIELD] is None:  # the run's first start: its key is made here
        if not path.exists():
            generate(path.parent, path.name)
        signer = Signer.from_file(path)
        record_weight_fields(settings, run, public_hex=signer.public_hex)
        log.info("weights: run %s signs with key %s (%s)", run, signer.key_id, path)
        return signer
    if not path.exists():
        raise RuntimeError(
            f"run {run} is signed by key {fields[KEY_FIELD][:16]}..., whose "
            f"private key is not at {path}"
        )
    signer = Signer.from_file(path)
    if signer.public_hex != fields[KEY_FIELD]:
        raise RuntimeError(f"{path} holds key {signer.key_id}, not run {run}'s")
    return signer


def key_folder_keys(folder: Path, role: str) -> RunKeys:
    """What a role of a run whose key is in ``folder`` is given: the public key, and for the
    learner alone the key file's path (nothing when the folder holds no key)."""
    public = folder / PUBLIC_FILE
    key = folder / KEY_FILE
    return RunKeys(
        public.read_text().strip() if public.exists() else None,
        str(key) if role == "learner" and key.exists() else None,
    )
