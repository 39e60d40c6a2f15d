"""feedback-ingest authentication: a bearer token, or an HMAC-SHA256 signature of the request.

Rules:
- a bearer token (``Authorization: Bearer <t>``) must be one of the configured tokens;
- OR an HMAC-SHA256 signature under a configured key id of the *request*, not only its body:
  ``signed_message`` joins the timestamp, the method, the path, the run, the Idempotency-Key
  and the body, so a captured request cannot be replayed later (the timestamp must lie within a
  skew window), elsewhere (another path or run) or under a new idempotency key (which would make
  it a new event); inside the window the same key makes a replay a stored-once duplicate;
- the signature may cover the body's SHA-256 instead of the body (``X-Rlstream-Content-SHA256``,
  ``signed_digest_message``): then it is verified from the headers alone, before a byte of the
  body is read, and the body read afterwards must hash to the signed digest. Only a key holder
  can make the service read a body that way (HMAC-SHA256 unforgeable without the key, SHA-256
  second-preimage resistant); a signature over the body itself can only be checked after the
  body, so the service reads such a body only up to a small bound (``service``);
- what is checked before the body (``check_headers``): a good bearer token, or a known key id
  with a well-formed timestamp inside the skew window (and, with a digest, the signature);
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
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rlstream.producers.feedback.dedupe import principal_of_key, principal_of_token
from rlstream.producers.feedback.models import IDEMPOTENCY_HEADER

KEY_ID_HEADER = "X-Rlstream-Key-Id"
SIGNATURE_HEADER = "X-Rlstream-Signature"
TIMESTAMP_HEADER = "X-Rlstream-Timestamp"
DIGEST_HEADER = "X-Rlstream-Content-SHA256"
DEFAULT_SKEW_S = 300


#: The one answer to every authentication failure.
UNAUTHORIZED = "authentication failed"
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


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


def signed_digest_message(
    timestamp: str, target: Target, idempotency_key: str, digest: str
) -> bytes:
    """The bytes a digest signature covers: the head of ``signed_message``, then
    ``content-sha256:`` and the lowercase hex SHA-256 of the body."""
    return _signed_head(timestamp, target, idempotency_key) + b"content-sha256:" + digest.encode()


def body_digest(body: bytes) -> str:
    """The ``X-Rlstream-Content-SHA256`` value of ``body``: its SHA-256, lowercase hex."""
    return hashlib.sha256(body).hexdigest()


def sign_digest(
    key: bytes, timestamp: str, target: Target, idempotency_key: str, body: bytes
) -> str:
    """The ``X-Rlstream-Signature`` value of a request that sends ``X-Rlstream-Content-SHA256``
    (``body_digest(body)``): ``sha256=`` + hex HMAC-SHA256 of ``signed_digest_message``."""
    mac = _keyed(key).copy()
    mac.update(signed_digest_message(timestamp, target, idempotency_key, body_digest(body)))
    return "sha256=" + mac.hexdigest()


def signed_headers(
    key: bytes, key_id: str, target: Target, body: bytes, now_s: float | None = None
) -> dict[str, str]:
    """A client's headers for a JSON ``body`` signed with the digest scheme (the service can
    refuse a bad signature before it reads the body): key id, timestamp, digest, signature."""
    ts = str(int(time.time() if now_s is None else now_s))
    return {
        "Content-Type": "application/json",
        KEY_ID_HEADER: key_id,
        TIMESTAMP_HEADER: ts,
        DIGEST_HEADER: body_digest(body),
        SIGNATURE_HEADER: sign_digest(key, ts, target, "", body),
    }


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


def presented_token(authorization: str | None) -> bytes | None:
    """The token of ``Authorization: Bearer <t>`` (None for another scheme or none)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return given.strip().encode()


def check_bearer(authorization: str | None, tokens: list[bytes]) -> bool:
    """True if ``Authorization: Bearer <t>`` names an accepted token (constant-time compare)."""
    candidate = presented_token(authorization)
    if candidate is None or not tokens:
        return False
    matches = [hmac.compare_digest(candidate, token) for token in tokens]  # no early exit
    return any(matches)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as its headers tell (``identify``)."""

    principal: str
    """The client's namespace (``dedupe.principal_of_*``): its rate limit and its ids."""
    proven: bool
    """Proven from the headers alone: a good bearer token, or a good signature of the digest."""
    digest: bool
    """The body must hash to the signed ``X-Rlstream-Content-SHA256``."""


def identify(
    headers: Mapping[str, str],
    target: Target,
    tokens: list[bytes],
    keys: Mapping[str, bytes],
    now_s: float,
    skew_s: int,
) -> Caller | str:
    """Before the body: the caller, or why the request is refused (see the module rules).
    A signature over the body itself leaves the caller unproven until ``check_body``."""
    token = presented_token(headers.get("Authorization"))
    if token is not None and check_bearer(headers.get("Authorization"), tokens):
        return Caller(principal_of_token(token), proven=True, digest=False)
    why = check_headers(headers, tokens, keys, now_s, skew_s)
    if why is not None:
        return why
    principal = principal_of_key(headers.get(KEY_ID_HEADER, ""))
    if headers.get(DIGEST_HEADER) is None:
        return Caller(principal, proven=False, digest=False)
    why = check_digest_signature(headers, target, keys)
    return why if why is not None else Caller(principal, proven=True, digest=True)


def check_body(
    caller: Caller,
    headers: Mapping[str, str],
    target: Target,
    body: bytes,
    keys: Mapping[str, bytes],
    now_s: float,
    skew_s: int,
) -> str | None:
    """After the body: None if ``caller``'s request is authenticated with it, else why not."""
    if caller.digest:
        return check_body_digest(headers, body)
    if caller.proven:
        return None
    return check_signature(headers, target, body, keys, now_s, skew_s)


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
    stale = _timestamp_refusal(ts, now_s, skew_s)
    if stale is not None:
        return stale
    expected = sign(key, ts, target, headers.get(IDEMPOTENCY_HEADER, ""), body)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return "bad signature"
    return None


def check_headers(
    headers: Mapping[str, str],
    tokens: list[bytes],
    keys: Mapping[str, bytes],
    now_s: float | None = None,
    skew_s: int = DEFAULT_SKEW_S,
) -> str | None:
    """What can be refused before the body is read: None if the request may go on (a good
    bearer token, or signature headers naming a known key with a well-formed timestamp inside
    the skew window of ``now_s``, default now), else why not."""
    if check_bearer(headers.get("Authorization"), tokens):
        return None
    if headers.get(SIGNATURE_HEADER) is None:
        return "bad bearer token" if headers.get("Authorization") else "missing credentials"
    if headers.get(KEY_ID_HEADER) not in keys:
        return "unknown key id"
    return _timestamp_refusal(headers.get(TIMESTAMP_HEADER), now_s, skew_s)


def _timestamp_refusal(ts: str | None, now_s: float | None, skew_s: int) -> str | None:
    if not ts:
        return "missing credentials"
    if not _TIMESTAMP.fullmatch(ts):
        return "bad timestamp"
    if abs((time.time() if now_s is None else now_s) - int(ts)) > skew_s:
        return "timestamp outside the allowed skew"
    return None


def check_digest_signature(
    headers: Mapping[str, str], target: Target, keys: Mapping[str, bytes]
) -> str | None:
    """None if the signature covers the request head and its ``X-Rlstream-Content-SHA256``
    (call after ``check_headers`` passed for a signed request), else why not."""
    digest, key = headers.get(DIGEST_HEADER, ""), keys.get(headers.get(KEY_ID_HEADER, ""))
    if key is None:
        return "unknown key id"
    if not _DIGEST.fullmatch(digest):
        return "bad content digest"
    mac = _keyed(key).copy()
    ts, idem = headers.get(TIMESTAMP_HEADER, ""), headers.get(IDEMPOTENCY_HEADER, "")
    mac.update(signed_digest_message(ts, target, idem, digest))
    expected = "sha256=" + mac.hexdigest()
    if not hmac.compare_digest(headers.get(SIGNATURE_HEADER, "").encode(), expected.encode()):
        return "bad signature"
    return None


def check_body_digest(headers: Mapping[str, str], body: bytes) -> str | None:
    """None if ``body`` hashes to the signed ``X-Rlstream-Content-SHA256``, else why not."""
    if not hmac.compare_digest(body_digest(body).encode(), headers.get(DIGEST_HEADER, "").encode()):
        return "body does not match its signed digest"
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
