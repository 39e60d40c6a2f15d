"""Authentic weights: every weight manifest is signed by the run's learner, and readers verify
the signature before they decode the manifest, let alone allocate for its tensors.

Rules:

- a run has an Ed25519 key pair from its creation (``consumers.weights.trust``): the public key
  is recorded in the run manifest (``rl.runs``, which only the run's creator writes), the
  private key is a PEM file (mode 0600) that only the learner is given: by its own
  ``$RLSTREAM_WEIGHTS_SIGNING_KEY``, set for the learner's process alone, or in its state
  directory (``Signer.from_file``); no other role is told where it is;
- the learner signs the exact bytes of each manifest record value and sends the signature and
  the key id (the first 8 bytes of the public key, hex) as headers;
- every reader (weight subscriber, version watcher, learner ledger, replay) judges a record by
  the run's ``Trust``: with the run's public key (``Verifier``), a manifest that is unsigned,
  signed by another key, or altered after signing is refused (``Refused``), counted, and
  never decoded: old weights keep serving, and a forged version number (say 10^12) never
  pins a worker or makes admission reject everything as stale. Fail-closed: a reader that
  knows no key for the run accepts nothing, unless the run was explicitly created insecure
  (``Trust.insecure``), which every reader says loudly in its log.

Chunks need no signature of their own: a signed manifest names every chunk's checksum and every
tensor's hash, of a cryptographic algorithm (``deltacodec.bits``), and nothing is applied that
does not match them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from rlstream.producers.weights.run_keys import SIGNING_KEY_ENV, VERIFY_KEY_ENV, RunKeys
from rlstream.schemas.errors import Refused

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "rlstream.weights.signature"
KEY_ID_HEADER = "rlstream.weights.key-id"

Headers = Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None]


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public: Ed25519PublicKey) -> str:
    return _raw(public)[:8].hex()


class Signer:
    """Signs manifest record values with the run's private key."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_hex = _raw(private.public_key()).hex()
        self.key_id = key_id(private.public_key())

    @classmethod
    def from_file(cls, path: str | Path) -> Signer:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key")
        return cls(key)

    @classmethod
    def from_env(cls) -> Signer | None:
        """The key file named by this process's own ``$RLSTREAM_WEIGHTS_SIGNING_KEY`` (the
        learner's; set for its process alone); None when unset."""
        path = os.environ.get(SIGNING_KEY_ENV)
        return cls.from_file(path) if path else None

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The headers that carry ``value``'s signature."""
        signature = self._private.sign(value)
        return [(SIGNATURE_HEADER, signature), (KEY_ID_HEADER, self.key_id.encode())]


class Verifier:
    """Checks manifest signatures against the run's public key."""

    def __init__(self, public: Ed25519PublicKey) -> None:
        self._public = public
        self.key_id = key_id(public)

    @classmethod
    def from_hex(cls, public_hex: str) -> Verifier:
        try:
            raw = bytes.fromhex(public_hex.strip())
            return cls(Ed25519PublicKey.from_public_bytes(raw))
        except ValueError as exc:
            raise ValueError(f"not an Ed25519 public key in hex: {exc}") from None

    @classmethod
    def given(cls, keys: RunKeys) -> Verifier | None:
        """The verifier of the public key a launcher gave (None: none given; the run's record
        decides)."""
        return cls.from_hex(keys.verify_hex) if keys.verify_hex else None

    @classmethod
    def from_env(cls) -> Verifier | None:
        value = os.environ.get(VERIFY_KEY_ENV)
        return cls.from_hex(value) if value else None

    def check(self, value: bytes | None, headers: Headers | None) -> None:
        """Return if ``value`` carries a good signature of this key; raise ``Refused``."""
        found = dict(headers.items() if isinstance(headers, Mapping) else headers or [])
        signature, kid = found.get(SIGNATURE_HEADER), found.get(KEY_ID_HEADER)
        if signature is None:
            raise Refused("unsigned manifest")
        if isinstance(kid, bytes):
            kid = kid.decode(errors="replace")
        if kid != self.key_id:
            raise Refused(f"signed by key {kid}, not the run's key {self.key_id}")
        try:
            sig = signature if isinstance(signature, bytes) else signature.encode()
            self._public.verify(sig, value or b"")
        except InvalidSignature:
            raise Refused("bad signature (the manifest was altered or forged)") from None


@dataclass(frozen=True)
class Trust:
    """What a reader of a run's manifests accepts: those signed with ``verifier``'s key; with
    no verifier, any (``insecure``: a run created insecure on purpose, or a replay of a run
    recorded before keys) or none (no key known: fail-closed). ``source`` says where the
    decision came from, for the logs."""

    verifier: Verifier | None = None
    insecure: bool = False
    source: str = "no key known"

    @property
    def known(self) -> bool:
        """Whether the reader may accept anything (a key, or an explicit insecure run)."""
        return self.verifier is not None or self.insecure

    def check(self, value: bytes | None, headers: Headers | None) -> None:
        """Return if a record may be decoded; raise ``Refused``."""
        if self.verifier is not None:
            self.verifier.check(value, headers)
        elif not self.insecure:
            raise Refused(f"no weight-signing key known for the run ({self.source})")


KEY_FILE = "weights-signing-key.pem"


def _private_dirs(folder: Path) -> None:
    """Create ``folder`` and every missing folder above it readable by the owner only (0700):
    a key's folder tells who else can list the runs that have keys."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    for each in reversed(missing):
        each.mkdir(mode=0o700, exist_ok=True)


def generate(folder: str | Path, name: str = KEY_FILE) -> tuple[Path, str]:
    """A new key pair for a run: the private key as a PEM file ``name`` in ``folder`` (mode
    0600) and the public key in hex (what the run manifest records)."""
    private = Ed25519PrivateKey.generate()
    path = Path(folder) / name
    _private_dirs(path.parent)
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return path, _raw(private.public_key()).hex()
