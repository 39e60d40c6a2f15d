"""The feedback ingest service (feedback-ingest): the HTTP service that turns editor feedback
into records of ``rl.RUN.feedback`` (``service``), its request and event models (``models``), its
authentication (``auth``), idempotency (``dedupe``) and OpenAPI document (``openapi``). What
consumes the feedback is ``consumers.feedback``."""
