"""A run's weight keys as values: what a launcher hands a role, without the crypto library.

``RunKeys`` travels in ``RoleContext.keys``; every role's context carries one, so this module
imports the standard library only (``cryptography`` loads where a key is used:
``signing.Verifier.given``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SIGNING_KEY_ENV = "RLSTREAM_WEIGHTS_SIGNING_KEY"
VERIFY_KEY_ENV = "RLSTREAM_WEIGHTS_VERIFY_KEY"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """A run's weight keys as a launcher hands them to a role's process: the public key every
    reader verifies with, and the private key's file, the learner's alone. A launcher gives them
    to its children as their environment (``env``); a process reads its own with ``from_env``
    and passes them on as a value (``RoleContext.keys``), never through ``os.environ``."""

    verify_hex: str | None = None
    signing_key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunKeys:
        """The keys this process was started with (``$RLSTREAM_WEIGHTS_VERIFY_KEY``,
        ``$RLSTREAM_WEIGHTS_SIGNING_KEY``)."""
        env = os.environ if environ is None else environ
        return cls(env.get(VERIFY_KEY_ENV) or None, env.get(SIGNING_KEY_ENV) or None)

    def env(self, role: str) -> dict[str, str]:
        """The environment a launcher gives ``role``'s process: the public key, and the key
        file to the learner alone."""
        out = {VERIFY_KEY_ENV: self.verify_hex} if self.verify_hex else {}
        if role == "learner" and self.signing_key:
            out[SIGNING_KEY_ENV] = self.signing_key
        return out

    def or_else(self, other: RunKeys) -> RunKeys:
        """These keys, each one missing taken from ``other``."""
        return RunKeys(self.verify_hex or other.verify_hex, self.signing_key or other.signing_key)
