"""A run's weight trust: the key its manifests are verified with, from the run's creation.

Rules:

- resolve (``run_trust``): a reader of run R's manifests takes, in this order: the public key
  its launcher gave it (``$RLSTREAM_WEIGHTS_VERIFY_KEY``, hex: ``rlstream demo`` gives every
  role the run's key this way, and a role on a secured cluster, which grants the roles no READ
  on ``rl.runs``, takes it from the cluster's secrets); else, on R's home cluster only, the
  public key recorded in R's run manifest (``rl.runs``, whose writers the ACLs restrict), or
  R's explicit insecure choice recorded there (said loudly); for a replay of a run recorded
  before keys (``audit``), any manifest, said loudly; else nothing is trusted and nothing
  accepted (fail-closed). A reader of a mirrored copy (``SOURCE.rl.R.weights.manifests`` in a
  rollout region) trusts only the key it is given: MirrorMaker's ``SOURCE.rl.runs`` is writable
  by whoever can write that region's cluster, so neither a key nor ``insecure`` is read there;
- create (``ensure_run_key``): a run gets its key once, from whoever creates it (``rlstream
  demo``, before any role starts) or at the learner's first start when nothing is recorded
  yet: the private half in a file only the learner is given, the public half recorded in the
  run manifest (read, updated and written back, every other field kept; a manifest is created
  when the run has none). A learner whose key file is missing, or holds another key than the
  one recorded, refuses to start rather than sign with a key no reader trusts;
  ``insecure=True`` records the explicit choice to publish unsigned instead, and a learner
  without it refuses a run recorded insecure (a record never downgrades it to unsigned);
- a run manifest written again (``rlstream demo`` at the end of a run) keeps the weight fields
  (``weight_fields``);
- a key folder (the key file and, beside it, ``PUBLIC_FILE``) hands the key over by
  environment (``key_folder_env``): the public key to every role, the key file's path to the
  learner's process alone. On a secured cluster the run's creator (``rlstream acl apply``)
  makes the key in the cluster's secrets, and each role started there takes its part.
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
from rlstream.producers.weights.run_keys import RunKeys
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


def run_trust(settings: KafkaSettings, topic: str, *, audit: bool = False) -> Trust:
    """The trust of the run whose manifests ``topic`` holds (rules in the module docstring)."""
    if os.environ.get(VERIFY_KEY_ENV):  # given by the role's launcher: rl.runs is not read
        return Trust(Verifier.from_hex(os.environ[VERIFY_KEY_ENV]), source=f"${VERIFY_KEY_ENV}")
    name = topics.parse_topic(topic)
    assert name.run is not None
    if name.region is not None:  # a mirrored copy: whoever writes this cluster could write it
        return Trust(
            source=f"{topic} is a copy from region {name.region}: a rollout region trusts only "
            f"the key it is given (${VERIFY_KEY_ENV}), never a mirrored {topics.RUNS_TOPIC}"
        )
    recorded = _recorded(settings, name.run)
    fields = weight_fields(None if recorded is UNREADABLE else recorded)
    if fields[KEY_FIELD]:
        return Trust(Verifier.from_hex(fields[KEY_FIELD]), source=f"run manifest of {name.run}")
    if fields[INSECURE_FIELD]:
        log.warning(INSECURE_WARNING, name.run)
        return Trust(insecure=True, source=f"run {name.run} created insecure")
    if audit:
        log.warning(
            "replaying run %s, recorded without a weight key: its manifests are NOT verified "
            "(their hashes still are)",
            name.run,
        )
        return Trust(insecure=True, source=f"replay of {name.run}, recorded without a key")
    return Trust(source=f"none recorded for run {name.run}, ${VERIFY_KEY_ENV} unset")


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
