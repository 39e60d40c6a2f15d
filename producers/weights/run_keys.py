"""A run's weight keys as values: what a launcher hands a role, without the crypto library.

``RunKeys`` travels in ``RoleContext.keys``; every role's context carries one, so this module
imports the standard library only (``cryptography`` loads where a key is used:
``signing.Verifier.given``).

Pins: this host's trust anchors, one file per run in ``trust_dir()`` holding the run's public
key in hex, or ``insecure`` for a run created insecure on purpose. The run's creator on this
host writes its pin (``consumers.weights.trust.ensure_run_key``); a user pins a run made
elsewhere with ``rlstream trust pin``. A reader trusts what it is given or what is pinned here,
never a record on a topic (rules: ``consumers.weights.trust``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SIGNING_KEY_ENV = "RLSTREAM_WEIGHTS_SIGNING_KEY"
VERIFY_KEY_ENV = "RLSTREAM_WEIGHTS_VERIFY_KEY"
#: ``1``: the run was created insecure on purpose (its manifests are accepted unsigned).
INSECURE_ENV = "RLSTREAM_WEIGHTS_INSECURE"
#: Where this host's pins are (default ``~/.config/rlstream/trust``).
TRUST_DIR_ENV = "RLSTREAM_TRUST_DIR"
INSECURE_PIN = "insecure"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """A run's weight keys as a launcher hands them to a role's process: the public key every
    reader verifies with, and the private key's file, the learner's alone. A launcher gives them
    to its children as their environment (``env``); a process reads its own with ``from_env``
    and passes them on as a value (``RoleContext.keys``), never through ``os.environ``."""

    verify_hex: str | None = None
    signing_key: str | None = None
    #: no key: the run was created insecure on purpose (said loudly by every reader)
    insecure: bool = False

    @property
    def known(self) -> bool:
        """Whether a reader knows what to accept: a public key, or an insecure run."""
        return bool(self.verify_hex) or self.insecure

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunKeys:
        """The keys this process was started with (``$RLSTREAM_WEIGHTS_VERIFY_KEY``,
        ``$RLSTREAM_WEIGHTS_SIGNING_KEY``, ``$RLSTREAM_WEIGHTS_INSECURE``)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get(VERIFY_KEY_ENV) or None,
            env.get(SIGNING_KEY_ENV) or None,
            env.get(INSECURE_ENV) == "1",
        )

    def env(self, role: str) -> dict[str, str]:
        """The environment a launcher gives ``role``'s process: the public key (or the insecure
        choice), and the key file to the learner alone."""
        out = {VERIFY_KEY_ENV: self.verify_hex} if self.verify_hex else {}
        if self.insecure and not self.verify_hex:
            out[INSECURE_ENV] = "1"
        if role == "learner" and self.signing_key:
            out[SIGNING_KEY_ENV] = self.signing_key
        return out

    def or_else(self, other: RunKeys) -> RunKeys:
        """These keys, each one missing taken from ``other`` (a key given wins over an insecure
        choice taken from ``other``)."""
        verify = self.verify_hex or other.verify_hex
        insecure = self.insecure or (other.insecure and not self.verify_hex)
        return RunKeys(verify, self.signing_key or other.signing_key, insecure and not verify)


def trust_dir(environ: Mapping[str, str] | None = None) -> Path:
    """This host's pins (``$RLSTREAM_TRUST_DIR``, default ``~/.config/rlstream/trust``)."""
    env = os.environ if environ is None else environ
    given = env.get(TRUST_DIR_ENV)
    return Path(given).expanduser() if given else Path.home() / ".config" / "rlstream" / "trust"


def pin_path(run: str) -> Path:
    """Run ``run``'s pin file. Raises ``ValueError`` for a name that is no run's."""
    if not run or run.startswith(".") or "/" in run or "\\" in run:
        raise ValueError(f"not a run name: {run!r}")
    return trust_dir() / f"{run}.pin"


def pin(run: str, keys: RunKeys) -> Path:
    """Pin run ``run`` on this host to ``keys``' public key (or its insecure choice); returns
    the pin's file. The folder is the user's (0700), each pin readable by the user only."""
    if not keys.known:
        raise ValueError(f"run {run}: nothing to pin (no public key, not insecure)")
    path = pin_path(run)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = keys.verify_hex.strip() if keys.verify_hex else INSECURE_PIN
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def pinned(run: str) -> RunKeys:
    """What this host pins run ``run`` to (``RunKeys()`` when nothing: the run is not known)."""
    try:
        text = pin_path(run).read_text().strip()
    except (OSError, ValueError):
        return RunKeys()
    if text == INSECURE_PIN:
        return RunKeys(insecure=True)
    return RunKeys(text or None)


def unpin(run: str) -> bool:
    """Forget run ``run``'s pin; whether there was one."""
    try:
        pin_path(run).unlink()
    except FileNotFoundError:
        return False
    return True
