"""feedback-ingest authentication: a bearer token, or an HMAC-SHA256 signature of the body.

Rules:
- a bearer token (``Authorization: Bearer <t>``) must be one of the configured tokens;
- OR an HMAC-SHA256 signature of ``"<timestamp>." + raw body`` under a configured key id, with
  the timestamp (unix seconds) within a skew window, so a captured request cannot be replayed
  later (inside the window the idempotency key makes a replay a no-op);
- comparisons are constant-time. Pure functions: unit tested without a socket.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

KEY_ID_HEADER = "X-Rlstream-Key-Id"
SIGNATURE_HEADER = "X-Rlstream-Signature"
TIMESTAMP_HEADER = "X-Rlstream-Timestamp"


def sign(key: bytes, timestamp: str, body: bytes) -> str:
    """The ``X-Rlstream-Signature`` value: ``sha256=`` + hex HMAC-SHA256(key, ts + "." + body)."""
    digest = hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


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
    headers: Mapping[str, str], body: bytes, keys: Mapping[str, bytes], now_s: float, skew_s: int
) -> str | None:
    """None if the HMAC headers authenticate ``body``, else why not.

    Rule: the key id must be configured, the timestamp an integer (unix seconds) within
    ``skew_s`` of ``now_s``, and the signature equal to ``sign(key, timestamp, body)``.
    """
    key_id, ts = headers.get(KEY_ID_HEADER), headers.get(TIMESTAMP_HEADER)
    signature = headers.get(SIGNATURE_HEADER)
    if not key_id or not ts or not signature:
        return "missing credentials"
    key = keys.get(key_id)
    if key is None:
        return "unknown key id"
    if not ts.isdigit() or len(ts) > 12:
        return "bad timestamp"
    if abs(now_s - int(ts)) > skew_s:
        return "timestamp outside the allowed skew"
    if not hmac.compare_digest(signature.encode(), sign(key, ts, body).encode()):
        return "bad signature"
    return None


def authenticate(
    headers: Mapping[str, str],
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
        return check_signature(headers, body, keys, now_s, skew_s)
    return "bad bearer token" if headers.get("Authorization") else "missing credentials"
