"""The OpenAPI 3.1 document of feedback-ingest, generated from the pydantic request models.

Generated, not written: the document cannot drift from the validation it describes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from rlstream.producers.feedback.auth import (
    DIGEST_HEADER,
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
)
from rlstream.producers.feedback.models import (
    FEEDBACK_PATH,
    IDEMPOTENCY_HEADER,
    AcceptedResponse,
    ErrorResponse,
    FeedbackBatch,
    FeedbackEvent,
)


def _responses(*codes: int) -> dict[str, Any]:
    why = {
        200: "Every event was stored before (duplicate: true).",
        202: "Stored: the broker acknowledged every event.",
        400: "The body is not JSON.",
        401: "Missing or bad credentials.",
        413: "The body (or one event's record) is too large.",
        415: "Content-Type is not application/json.",
        422: "Invalid: details name each field and why.",
        429: "Over the client's rate or the open connections; retry after Retry-After seconds.",
        503: "Kafka is unavailable, or the parse queue is full; retry after Retry-After seconds.",
    }
    out: dict[str, Any] = {}
    for code in codes:
        model = "AcceptedResponse" if code in (200, 202) else "ErrorResponse"
        schema = {"$ref": f"#/components/schemas/{model}"}
        out[str(code)] = {
            "description": why[code],
            "content": {"application/json": {"schema": schema}},
        }
    for retry in ("429", "503"):
        out[retry]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 document of the service, schemas generated from the pydantic models."""
    models: list[type[BaseModel]] = [FeedbackEvent, FeedbackBatch, AcceptedResponse, ErrorResponse]
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    body = {"oneOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models[:2]]}
    header = {"in": "header", "required": False, "schema": {"type": "string"}}
    post = {
        "summary": "Store editor feedback (one event or a batch).",
        "security": [{"bearer": []}, {"hmac": []}],
        "parameters": [
            {**header, "name": IDEMPOTENCY_HEADER, "description": "feedback_id of a single event"},
            {**header, "name": KEY_ID_HEADER, "description": "HMAC key id"},
            {**header, "name": TIMESTAMP_HEADER, "description": "unix seconds, signed"},
            {
                **header,
                "name": SIGNATURE_HEADER,
                "description": "sha256=<hex HMAC-SHA256> of TIMESTAMP\\nMETHOD\\nPATH\\nRUN\\n"
                "IDEMPOTENCY-KEY\\n followed by the body, or (with the digest header) by "
                "content-sha256:<the digest>: then checked before the body is read",
            },
            {
                **header,
                "name": DIGEST_HEADER,
                "description": "lowercase hex SHA-256 of the body, signed instead of the body",
            },
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": _responses(200, 202, 400, 401, 413, 415, 422, 429, 503),
    }
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rlstream feedback-ingest", "version": "1"},
        "paths": {
            FEEDBACK_PATH: {"post": post},
            "/healthz": {"get": {"responses": {"200": {"description": "Alive."}}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus.", **text}}}},
            "/openapi.json": {"get": {"responses": {"200": {"description": "This document."}}}},
        },
        "components": {
            "schemas": top["$defs"],
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "hmac": {"type": "apiKey", "in": "header", "name": SIGNATURE_HEADER},
            },
        },
    }
