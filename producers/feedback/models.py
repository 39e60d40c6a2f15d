"""What feedback-ingest accepts, and the pure rules it applies to a request's content.

The editor backend reports what a user did with a served completion. This module holds the
request and response models (pydantic, ``extra="forbid"``, strict types, bounded sizes), the
service config, and the rules on them, all without I/O so they are unit tested without a broker
or a socket:

- validation: every field has a type and bounds; per-token arrays must all have T entries,
  token ids are int32 >= 0, logprobs finite and <= 0, loss mask 0/1, experts < 256 with one
  [n_layers, top_k] shape for every token; ``edit`` is required exactly when action = edited.
  A failure names the field (``events.0.action``) and why;
- privacy: the user id is replaced by HMAC-SHA256(salt, user id) before the record is built; the
  raw id is never stored or logged.

Around them: ``producers.feedback.auth`` (bearer token or HMAC signature),
``producers.feedback.dedupe`` (the acknowledged-id cache that makes a retry a no-op),
``producers.feedback.openapi`` (the OpenAPI document, generated from these models so it cannot drift
from the validation), ``producers.feedback.service`` (the service).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from rlstream.schemas import arrays, topics
from rlstream.schemas.derive import derive
from rlstream.schemas.errors import RlstreamError

TOKENS_ENV = "RLSTREAM_FEEDBACK_TOKENS"
SALT_ENV = "RLSTREAM_FEEDBACK_SALT"
IDEMPOTENCY_HEADER = "Idempotency-Key"
FEEDBACK_PATH = "/v1/feedback"
MAX_TOKENS = 262_144
"""Hard cap on tokens per event; ``FeedbackServiceConfig.max_tokens`` may only lower it."""
MAX_TOKEN_ID = 2**31 - 1
Action = Literal["accepted", "rejected", "edited", "dissatisfied"]
_ID = r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$"

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Logprob = Annotated[float, Field(le=0.0, allow_inf_nan=False)]
MaskBit = Annotated[int, Field(ge=0, le=1)]
ExpertId = Annotated[int, Field(ge=0, le=255)]
EpochMs = Annotated[int, Field(ge=0, le=2**53)]


# --- config ---------------------------------------------------------------------------------


class FeedbackServiceConfig(BaseModel):
    """Config of the ``rlstream serve feedback`` service (feedback-ingest)."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="Run whose feedback stream (rl.RUN.feedback) receives events.")
    host: str = Field("127.0.0.1", max_length=255, description="Address to listen on.")
    port: int = Field(8088, ge=0, le=65535, description="TCP port; 0 picks a free port.")
    tokens: list[SecretStr] = Field(
        default_factory=list,
        max_length=256,
        description=f"Accepted bearer tokens; ${TOKENS_ENV} (comma-separated) adds more.",
    )
    hmac_keys: dict[str, SecretStr] = Field(
        default_factory=dict, description="HMAC-SHA256 signing keys by key id."
    )
    hmac_skew_s: int = Field(
        300, ge=1, le=3600, description="Largest |server time - X-Rlstream-Timestamp| accepted."
    )
    tls_cert_file: str | None = Field(
        None, description="PEM certificate chain: serve HTTPS (with tls_key_file); None: HTTP."
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    durable_dedupe: bool = Field(
        True,
        description="Learn stored feedback ids from the feedback stream (restarts and replicas "
        "share them); False: this process's memory only.",
    )
    user_id_salt: SecretStr | None = Field(
        None,
        description=f"Salt of the user id hash; None: ${SALT_ENV}, else a random salt per "
        "process (hashes then differ between replicas and restarts).",
    )
    max_body_bytes: int = Field(
        2 * 1024 * 1024, ge=1024, le=16 * 1024 * 1024, description="Largest request body (413)."
    )
    max_batch: int = Field(100, ge=1, le=1000, description="Most events in one request.")
    max_tokens: int = Field(
        65_536, ge=1, le=MAX_TOKENS, description="Most tokens in one event's token_ids."
    )
    idempotency_window_s: float = Field(
        3600.0, gt=0, le=7 * 24 * 3600, description="How long an acked feedback id is remembered."
    )
    idempotency_max_ids: int = Field(
        1_000_000, ge=1, le=50_000_000, description="Most feedback ids remembered (oldest go)."
    )
    message_timeout_ms: int = Field(
        5000, ge=500, le=300_000, description="Kafka delivery timeout; past it the answer is 503."
    )
    retry_after_s: int = Field(5, ge=1, le=3600, description="Retry-After of a 503 answer.")
    max_unhashed_body_bytes: int = Field(
        64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Largest body read for a signature over the body itself, which is only "
        "checked after reading it; a larger one must be signed by its digest "
        "(X-Rlstream-Content-SHA256: checked before the body is read).",
    )
    max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Open connections; a request beyond them gets 429."
    )
    rate_per_client_s: float = Field(
        5000.0, gt=0, le=1e7, description="Requests per second per client credential (429)."
    )
    rate_burst: int = Field(
        10_000, ge=1, le=10**8, description="Requests a client may send at once (bucket size)."
    )
    max_parse_queue: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Large bodies waiting for (or in) the parse threads; beyond: 503 before the "
        "body is read.",
    )

    @field_validator("run")
    @classmethod
    def _legal_run(cls, value: str) -> str:
        return topics.validate_name(value)

    def accepted_tokens(self, environ: Mapping[str, str] | None = None) -> list[bytes]:
        """Configured tokens plus those of ``$RLSTREAM_FEEDBACK_TOKENS`` (empty items ignored)."""
        env = (os.environ if environ is None else environ).get(TOKENS_ENV, "")
        values = [t.get_secret_value() for t in self.tokens] + env.split(",")
        return [v.strip().encode() for v in values if v.strip()]

    def salt(self, environ: Mapping[str, str] | None = None) -> tuple[bytes, bool]:
        """(salt, stable): the configured salt, else ``$RLSTREAM_FEEDBACK_SALT``, else random."""
        if self.user_id_salt is not None:
            return self.user_id_salt.get_secret_value().encode(), True
        env = (os.environ if environ is None else environ).get(SALT_ENV, "")
        if env:
            return env.encode(), True
        return secrets.token_bytes(32), False


# --- request and response models ------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TrajectoryRefIn(_Strict):
    """Position of a trajectory record that holds the served sample's tokens."""

    topic: str = Field(min_length=1, max_length=249, description="Topic of the record.")
    partition: int = Field(ge=0, le=2**31 - 1, description="Partition, 0-based.")
    offset: int = Field(ge=0, le=2**63 - 1, description="Offset in the partition.")


class FeedbackEvent(_Strict):
    """One user reaction to one served completion.

    Field order matters: cross-field rules run on the fields declared before them.
    """

    feedback_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=_ID,
        description="Idempotency key; may come from the Idempotency-Key header for one event.",
    )
    request_id: str = Field(min_length=1, max_length=256, description="Served request id.")
    policy_version: int = Field(ge=0, le=2**62, description="Policy version that served it.")
    model: str = Field(min_length=1, max_length=128, description="Model name that served it.")
    action: Action = Field(description="What the user did.")
    edit: str | None = Field(
        None, max_length=200_000, validate_default=True, description="Edited text (edited only)."
    )
    prompt: str | None = Field(None, max_length=1_000_000, description="Prompt text, optional.")
    completion: str | None = Field(None, max_length=1_000_000, description="Served text.")
    token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_TOKENS, description="Served tokens, prompt + completion, [T]."
    )
    logprobs: list[Logprob] | None = Field(
        None, max_length=MAX_TOKENS, validate_default=True, description="Serving logprobs [T]."
    )
    loss_mask: list[MaskBit] | None = Field(
        None, max_length=MAX_TOKENS, validate_default=True, description="1 = generated, [T]."
    )
    routed_experts: list[list[list[ExpertId]]] | None = Field(
        None,
        max_length=MAX_TOKENS,
        validate_default=True,
        description="Experts routed at serving, [T][n_layers][top_k].",
    )
    prompt_tokens: int | None = Field(
        None, ge=0, le=MAX_TOKENS, validate_default=True, description="Prompt tokens in [T]."
    )
    trajectory_ref: TrajectoryRefIn | None = Field(
        None, description="Where the tokens were logged instead, if not sent here."
    )
    task_class: str | None = Field(
        None, min_length=1, max_length=64, pattern=_ID, description="e.g. tab, agent, chat."
    )
    user_id: str = Field(min_length=1, max_length=256, description="User id; stored hashed.")
    client_created_ms: EpochMs | None = Field(None, description="Reaction time, client clock.")
    client_sent_ms: EpochMs | None = Field(None, description="Send time, client clock.")
    metadata: dict[
        Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=1024)]
    ] = Field(default_factory=dict, max_length=32, description="Client facts for analytics.")

    @field_validator("edit")
    @classmethod
    def _edit_iff_edited(cls, value: str | None, info: ValidationInfo) -> str | None:
        action = info.data.get("action")
        if action == "edited" and value is None:
            raise ValueError("required when action is 'edited'")
        if action is not None and action != "edited" and value is not None:
            raise ValueError("only allowed when action is 'edited'")
        return value

    @field_validator("logprobs", "loss_mask")
    @classmethod
    def _same_length(cls, value: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        _check_per_token(value, info, required=info.field_name == "logprobs")
        return value

    @field_validator("routed_experts")
    @classmethod
    def _expert_shape(cls, value: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        _check_per_token(value, info, required=False)
        if value:
            shapes = {(len(layers), len(layers[0]) if layers else 0) for layers in value}
            shapes |= {(len(layers), len(k)) for layers in value for k in layers}
            if len(shapes) != 1:
                raise ValueError("every token needs the same [n_layers][top_k] shape")
        return value

    @field_validator("prompt_tokens")
    @classmethod
    def _prompt_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        tokens = info.data.get("token_ids")
        if tokens is not None and value is not None and value > len(tokens):
            raise ValueError(f"{value} exceeds the {len(tokens)} token_ids")
        if tokens is not None and value is None and info.data.get("loss_mask") is None:
            raise ValueError("required with token_ids unless loss_mask is given")
        return value


def _check_per_token(value: list[Any] | None, info: ValidationInfo, required: bool) -> None:
    """Rule: a per-token array exists only with token_ids and has exactly T entries."""
    if "token_ids" not in info.data:
        return  # token_ids itself failed; that error is the one to report
    tokens = info.data["token_ids"]
    if tokens is None and value is not None:
        raise ValueError("only allowed together with token_ids")
    if tokens is not None and value is None and required:
        raise ValueError("required with token_ids")
    if tokens is not None and value is not None and len(value) != len(tokens):
        raise ValueError(f"has {len(value)} entries, token_ids has {len(tokens)}")


class FeedbackBatch(_Strict):
    """Several events in one request; each must carry its own feedback_id."""

    events: list[FeedbackEvent] = Field(min_length=1, max_length=1000, description="Events.")


class EventResult(BaseModel):
    """What happened to one event of the request."""

    feedback_id: str
    status: Literal["stored", "duplicate", "failed"] = Field(
        description="stored: acknowledged by Kafka now; duplicate: stored by an earlier request; "
        "failed: not stored, retry."
    )
    partition: int | None = Field(None, description="Partition it was stored in (stored only).")
    offset: int | None = Field(None, description="Offset it was stored at (stored only).")


class ErrorDetail(BaseModel):
    """One problem of a request: the field (dotted path) and why."""

    field: str = Field(description="Dotted path of the field, e.g. events.0.action; '' = body.")
    message: str = Field(description="What is wrong with it.")


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer."""

    error: str = Field(description="validation, bad_json, unauthorized, ... , unavailable.")
    message: str | None = Field(None, description="Human-readable explanation.")
    details: list[ErrorDetail] = Field(default_factory=list, description="Per-field problems.")
    results: list[EventResult] = Field(
        default_factory=list, description="On 503: events stored before the failure."
    )


class AcceptedResponse(BaseModel):
    """Body of a 202 (something stored) or 200 (all duplicates) answer."""

    accepted: int = Field(description="Events stored by this request.")
    duplicates: int = Field(description="Events already stored before (not stored again).")
    duplicate: bool = Field(description="True when every event of the request was a duplicate.")
    results: list[EventResult] = Field(description="One result per event, in request order.")


# --- parsing --------------------------------------------------------------------------------


class RequestError(RlstreamError):
    """A request refused before Kafka: HTTP ``status`` and the ``ErrorResponse`` to send."""

    def __init__(
        self, status: int, body: ErrorResponse, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(body.message or body.error)
        self.status, self.body, self.headers = status, body, headers


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def validation_details(exc: ValidationError, prefix: tuple[Any, ...] = ()) -> list[ErrorDetail]:
    """Pydantic errors as (dotted field, message), at most 20, input values never echoed."""
    return [
        ErrorDetail(field=_field(prefix + tuple(e["loc"])), message=e["msg"])
        for e in exc.errors(include_url=False, include_input=False)[:20]
    ]


def _invalid(details: list[ErrorDetail], message: str = "the request is invalid") -> RequestError:
    return RequestError(422, ErrorResponse(error="validation", message=message, details=details))


def parse_events(
    body: Any, idempotency_key: str | None, max_batch: int, max_tokens: int
) -> list[FeedbackEvent]:
    """The events of a decoded JSON body, or ``RequestError(422)`` naming each bad field.

    Rules: the body is one event (a JSON object) or ``{"events": [...]}`` (1..max_batch events);
    a single event takes ``Idempotency-Key`` as its feedback_id when the body has none (both,
    if present, must agree); every event ends up with a feedback_id and <= max_tokens tokens.
    """
    if not isinstance(body, dict):
        raise _invalid([ErrorDetail(field="", message="expected a JSON object")])
    batch = "events" in body
    if batch and isinstance(body["events"], list) and len(body["events"]) > max_batch:
        # refused before any event is validated
        raise _invalid([ErrorDetail(field="events", message=f"more than {max_batch} events")])
    try:
        if batch:
            parsed = FeedbackBatch.model_validate(body).events
        else:
            parsed = [FeedbackEvent.model_validate(body)]
    except ValidationError as exc:
        raise _invalid(validation_details(exc)) from None
    return _complete(parsed, batch, idempotency_key, max_tokens)


def parse_body(
    body: bytes, idempotency_key: str | None, max_batch: int, max_tokens: int
) -> tuple[list[FeedbackEvent], bool]:
    """(events, is a batch) of a request body, or ``RequestError``: 400 when it is not JSON,
    else as ``parse_events``.

    Rule: the same answer as ``parse_events(pydantic_core.from_json(body), ...)``. A body that
    validates as one event straight from its bytes (the common case) skips building the Python
    objects of the JSON first; anything else (a batch, an invalid or malformed body) takes that
    general path, which names every problem exactly as before.
    """
    if b'"events"' not in body:  # surely no batch: try the one-event fast path
        try:
            event = FeedbackEvent.model_validate_json(body)
        except (ValueError, RecursionError):  # ValidationError is a ValueError
            pass
        else:
            return _complete([event], False, idempotency_key, max_tokens), False
    try:
        data = pydantic_core.from_json(body)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, ErrorResponse(error="bad_json", message=str(exc)[:200])) from None
    batch = isinstance(data, dict) and "events" in data
    return parse_events(data, idempotency_key, max_batch, max_tokens), batch


def _complete(
    parsed: list[FeedbackEvent], batch: bool, idempotency_key: str | None, max_tokens: int
) -> list[FeedbackEvent]:
    """The rules past the models': the Idempotency-Key of a single event, a feedback_id for
    every event, at most ``max_tokens`` tokens each."""
    if not batch and idempotency_key is not None:
        parsed = [_with_header_key(parsed[0], idempotency_key)]
    problems = []
    for i, event in enumerate(parsed):
        where = f"events.{i}." if batch else ""
        if event.feedback_id is None:
            why = "required (in the body, or the Idempotency-Key header for a single event)"
            problems.append(ErrorDetail(field=where + "feedback_id", message=why))
        if event.token_ids is not None and len(event.token_ids) > max_tokens:
            why = f"{len(event.token_ids)} tokens, at most {max_tokens}"
            problems.append(ErrorDetail(field=where + "token_ids", message=why))
    if problems:
        raise _invalid(problems)
    return parsed


class _HeaderKey(_Strict):
    feedback_id: str = Field(min_length=1, max_length=128, pattern=_ID)


def _with_header_key(event: FeedbackEvent, key: str) -> FeedbackEvent:
    if event.feedback_id is not None and event.feedback_id != key:
        why = "the Idempotency-Key header and feedback_id disagree"
        raise _invalid([ErrorDetail(field="feedback_id", message=why)])
    try:
        _HeaderKey(feedback_id=key)
    except ValidationError as exc:
        details = [
            ErrorDetail(field=f"header {IDEMPOTENCY_HEADER}", message=d.message)
            for d in validation_details(exc)
        ]
        raise _invalid(details) from None
    return derive(event, feedback_id=key)


# --- records --------------------------------------------------------------------------------


def hash_user(user_id: str, salt: bytes) -> str:
    """HMAC-SHA256(salt, user id), hex: stable for one salt, not reversible without it."""
    mac = _keyed(salt).copy()  # the key schedule is done once per salt, not per event
    mac.update(user_id.encode())
    return mac.hexdigest()


@functools.lru_cache(maxsize=8)
def _keyed(salt: bytes) -> hmac.HMAC:
    return hmac.new(salt, digestmod=hashlib.sha256)


def _token_fields(event: FeedbackEvent) -> dict[str, Any]:
    if event.token_ids is None:
        return {}
    # The validated lists go straight into the wire dtypes (ids already lie in int32, mask
    # bits in 0/1): no int64/float64 arrays in between, nothing for pack_tokens to re-cast.
    t = len(event.token_ids)
    tokens = np.fromiter(event.token_ids, arrays.TOKEN_DTYPE, t)
    logprobs = np.fromiter(event.logprobs or [], arrays.LOGPROB_DTYPE)
    if event.loss_mask is not None:
        mask = np.fromiter(event.loss_mask, arrays.MASK_DTYPE, len(event.loss_mask))
    else:  # the validator guarantees prompt_tokens then: completion tokens are trained
        mask = np.ones(t, arrays.MASK_DTYPE)
        mask[: event.prompt_tokens or 0] = 0
    experts = event.routed_experts if event.routed_experts else None
    return arrays.pack_tokens(tokens, logprobs, mask, experts)


def to_record(event: FeedbackEvent, run: str, received_ms: int, salt: bytes) -> dict[str, Any]:
    """The Feedback record of a validated event (user id hashed, arrays packed little-endian)."""
    ref = event.trajectory_ref.model_dump() if event.trajectory_ref else None
    return {
        "feedback_id": event.feedback_id or "",
        "request_id": event.request_id,
        "run": run,
        "policy_version": event.policy_version,
        "model": event.model,
        "action": event.action,
        "edit": event.edit,
        "prompt": event.prompt,
        "completion": event.completion,
        "token_ids": None,
        "logprobs": None,
        "loss_mask": None,
        "routed_experts": None,
        "n_layers": 0,
        "top_k": 0,
        **_token_fields(event),
        "prompt_tokens": event.prompt_tokens,
        "trajectory_ref": ref,
        "task_class": event.task_class,
        "user_id_hash": hash_user(event.user_id, salt),
        "client_created_ms": event.client_created_ms,
        "client_sent_ms": event.client_sent_ms,
        "received_ms": received_ms,
        "metadata": dict(event.metadata),
    }
