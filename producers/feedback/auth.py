"""feedback-ingest authentication: a bearer token, or an HMAC-SHA256 signature of the request.

Rules:
- a bearer token (``Authorization: Bearer <t>``) must be one of the configured tokens;
- OR an HMAC-SHA256 signature under a configured key id of the *request*, not only its body:
  ``signed_message`` joins the timestamp, the method, the path, the run, the Idempotency-Key
  and the body, so a captured request cannot be replayed later (the timestamp must lie within a
  skew window), elsewhere (another path or run) or under a new idempotency key (which would make
  it a new event); inside the window the same key makes a replay a stored-once duplicate;
- the timestamp is 1 to 12 ASCII digits (unix seconds): anything else is refused, never parsed;
- comparisons are constant-time; every refusal says why to the caller of these functions, and
  the service answers every one of them with the same 401 (``UNAUTHORIZED``), so a client cannot
  tell an unknown key id from a bad signature. Pure functions: unit tested without a socket.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from rlstream.producers.feedback.models import IDEMPOTENCY_HEADER

KEY_ID_HEADER = "X-Rlstream-Key-Id"
SIGNATURE_HEADER = "X-Rlstream-Signature"
TIMESTAMP_HEADER = "X-Rlstream-Timestamp"


#: The one answer to every authentication failure.
UNAUTHORIZED = "authentication failed"
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class Target:
    """What a signature binds besides the body: the request line and the run it writes to."""

    method: str
    path: str
    run: str


def signed_message(timestamp: str, target: Target, idempotency_key: str, body: bytes) -> bytes:
    """The bytes an HMAC signature covers: ``TS\nMETHOD\nPATH\nRUN\nIDEMPOTENCY-KEY\n`` + body
    (an absent Idempotency-Key is the empty string)."""
    return _signed_head(timestamp, target, idempotency_key) + body


def _signed_head(timestamp: str, target: Target, idempotency_key: str) -> bytes:
    fields = (timestamp, target.method.upper(), target.path, target.run, idempotency_key)
    return "\n".join(fields).encode() + b"\n"


def sign(key: bytes, timestamp: str, target: Target, idempotency_key: str, body: bytes) -> str:
    """The ``X-Rlstream-Signature`` value: ``sha256=`` + hex HMAC-SHA256 of ``signed_message``.

    The key schedule is computed once per key (``_keyed``) and copied per request, and the
    body is fed as it is, not copied behind the head."""
    mac = _keyed(key).copy()
    mac.update(_signed_head(timestamp, target, idempotency_key))
    mac.update(body)
    return "sha256=" + mac.hexdigest()


@functools.lru_cache(maxsize=64)
def _keyed(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def check_bearer(authorization: str | None, tokens: list[bytes]) -> bool:
    """True if ``Authorization: Bearer <t>`` names an accepted token (constant-time compare)."""
    if not authorization or not tokens:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    candidate = given.strip().encode()
    matches = [hmac.compare_digest(candidate, token) for token in tokens]  # no early exit
    return any(matches)


def check_signature(
    headers: Mapping[str, str],
    target: Target,
    body: bytes,
    keys: Mapping[str, bytes],
    now_s: float,
    skew_s: int,
) -> str | None:
    """None if the HMAC headers authenticate this request, else why not.

    Rule: the key id must be configured, the timestamp 1-12 ASCII digits within ``skew_s`` of
    ``now_s``, and the signature equal to ``sign`` of this request (see the module rules)."""
    key_id, ts = headers.get(KEY_ID_HEADER), headers.get(TIMESTAMP_HEADER)
    signature = headers.get(SIGNATURE_HEADER)
    if not key_id or not ts or not signature:
        return "missing credentials"
    key = keys.get(key_id)
    if key is None:
        return "unknown key id"
    if not _TIMESTAMP.fullmatch(ts):
        return "bad timestamp"
    if abs(now_s - int(ts)) > skew_s:
        return "timestamp outside the allowed skew"
    expected = sign(key, ts, target, headers.get(IDEMPOTENCY_HEADER, ""), body)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return "bad signature"
    return None


def check_headers(
    headers: Mapping[str, str], tokens: list[bytes], keys: Mapping[str, bytes]
) -> str | None:
    """What can be refused before the body is read: None if the request may go on (a good
    bearer token, or signature headers naming a known key), else why not."""
    if check_bearer(headers.get("Authorization"), tokens):
        return None
    if headers.get(SIGNATURE_HEADER) is None:
        return "bad bearer token" if headers.get("Authorization") else "missing credentials"
    if headers.get(KEY_ID_HEADER) not in keys:
        return "unknown key id"
    return None


def authenticate(
    headers: Mapping[str, str],
    target: Target,
    body: bytes,
    tokens: list[bytes],
    keys: Mapping[str, bytes],
    now_s: float,
    skew_s: int,
) -> str | None:
    """None if the request is authenticated by bearer token OR HMAC signature, else why not."""
    if check_bearer(headers.get("Authorization"), tokens):
        return None
    if headers.get(SIGNATURE_HEADER) is not None:
        return check_signature(headers, target, body, keys, now_s, skew_s)
    return "bad bearer token" if headers.get("Authorization") else "missing credentials"
