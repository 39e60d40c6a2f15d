"""A run's weight keys travel as values (``RunKeys`` in ``RoleContext.keys``), handed to a child
process as its environment by its launcher, and no product code writes its own ``os.environ``."""

from __future__ import annotations

import re
from pathlib import Path

from rlstream.consumers.weights.trust import PUBLIC_FILE, key_folder_keys
from rlstream.producers.weights.run_keys import RunKeys
from rlstream.producers.weights.signing import (
    KEY_FILE,
    SIGNING_KEY_ENV,
    VERIFY_KEY_ENV,
    Signer,
    Verifier,
    generate,
)

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
