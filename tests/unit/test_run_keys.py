"""A run's weight keys travel as values (``RunKeys`` in ``RoleContext.keys``), handed to a child
process as its environment by its launcher, and no product code writes its own ``os.environ``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlstream.consumers.weights.trust import PUBLIC_FILE, key_folder_keys, run_trust
from rlstream.producers.weights.run_keys import (
    INSECURE_ENV,
    TRUST_DIR_ENV,
    RunKeys,
    pin,
    pinned,
    unpin,
)
from rlstream.producers.weights.signing import (
    KEY_FILE,
    SIGNING_KEY_ENV,
    VERIFY_KEY_ENV,
    Signer,
    Verifier,
    generate,
)
from rlstream.schemas import topics

ROOT = Path(__file__).resolve().parents[2]
#: where writing the environment is the protocol: torch's ``env://`` rendezvous, and the sandboxed
#: test driver's own process (which pytest reads)
WRITES_ALLOWED = {"trainer/distributed.py", "envs/repo_driver.py"}


def test_the_signing_key_goes_to_the_learner_alone() -> None:
    keys = RunKeys("ab" * 32, "/keys/k.pem")
    assert keys.env("learner") == {VERIFY_KEY_ENV: "ab" * 32, SIGNING_KEY_ENV: "/keys/k.pem"}
    assert keys.env("rollout") == {VERIFY_KEY_ENV: "ab" * 32}
    assert RunKeys().env("learner") == {}
    assert RunKeys.from_env(keys.env("learner")) == keys
    assert RunKeys(None, "a").or_else(RunKeys("b", "c")) == RunKeys("b", "a")


def test_a_key_folder_gives_each_role_its_part(tmp_path: Path) -> None:
    path, public = generate(tmp_path, KEY_FILE)
    (tmp_path / PUBLIC_FILE).write_text(public + "\n")
    learner, worker = key_folder_keys(tmp_path, "learner"), key_folder_keys(tmp_path, "rollout")
    assert learner == RunKeys(public, str(path))
    assert worker == RunKeys(public, None)
    verifier = Verifier.given(worker)
    assert verifier is not None and verifier.key_id == Signer.from_file(path).key_id
    assert key_folder_keys(tmp_path / "none", "learner") == RunKeys()


def test_no_product_code_writes_its_own_environment() -> None:
    write = re.compile(r"os\.environ(\[[^\]]+\]\s*=[^=]|\.setdefault\(|\.update\(|\.pop\()")
    found = []
    for folder in ("schemas", "producers", "consumers", "envs", "rollout", "trainer", "ops"):
        for path in (ROOT / folder).rglob("*.py"):
            name = str(path.relative_to(ROOT))
            if name not in WRITES_ALLOWED and write.search(path.read_text()):
                found.append(name)
    assert not found, f"pass values (RoleContext, a child's env=) instead: {found}"


def test_an_insecure_choice_travels_to_every_role_and_a_key_wins_over_it() -> None:
    insecure = RunKeys(insecure=True)
    assert insecure.env("rollout") == {INSECURE_ENV: "1"} and insecure.known
    assert RunKeys.from_env(insecure.env("judge")) == insecure
    assert RunKeys("ab" * 32).or_else(insecure) == RunKeys("ab" * 32)
    assert not RunKeys().known


def test_a_pin_is_the_only_trust_anchor_besides_what_a_reader_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRUST_DIR_ENV, str(tmp_path / "trust"))
    monkeypatch.delenv(VERIFY_KEY_ENV, raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    topic = topics.topic_name("r1", "weights.manifests")
    assert not run_trust(topic).known  # nothing given or pinned: fail-closed
    assert run_trust(topic, audit=True).insecure  # a replay says so loudly, hashes still checked
    _, public = generate(tmp_path)
    path = pin("r1", RunKeys(public))
    assert oct(path.stat().st_mode & 0o777) == "0o600" and pinned("r1") == RunKeys(public)
    trust = run_trust(topics.remote_topic("trainer", topic))  # a mirrored copy too
    assert trust.verifier is not None and "pinned" in trust.source
    pin("r1", RunKeys(insecure=True))
    assert run_trust(topic).insecure
    other = Signer.from_file(generate(tmp_path / "given")[0])
    monkeypatch.setenv(VERIFY_KEY_ENV, other.public_hex)  # what a launcher gives wins
    assert run_trust(topic).verifier.key_id == other.key_id
    assert unpin("r1") and not unpin("r1") and pinned("r1") == RunKeys()
    with pytest.raises(ValueError):
        pin("../x", RunKeys(public))
    with pytest.raises(ValueError):
        pin("r2", RunKeys())


def test_rlstream_trust_pins_lists_and_forgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlstream.ops.cli import main

    monkeypatch.setenv(TRUST_DIR_ENV, str(tmp_path / "trust"))
    _, public = generate(tmp_path)
    (tmp_path / PUBLIC_FILE).write_text(public + "\n")
    assert main(["trust", "pin", "r1", "--key-file", str(tmp_path / PUBLIC_FILE)]) == 0
    assert main(["trust", "pin", "r2", "--insecure"]) == 0
    assert main(["trust", "pin", "r3", "--key", "zz"]) == 2
    assert "not an Ed25519 public key" in capsys.readouterr().err
    assert main(["trust", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["pins"]
    assert listed == {"r1": f"key {Verifier.from_hex(public).key_id}", "r2": "insecure"}
    assert main(["trust", "forget", "r2"]) == 0 and pinned("r2") == RunKeys()
