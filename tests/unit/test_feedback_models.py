"""Feedback ingestion without a broker: validation, authentication, idempotency, user hashing,
the HTTP answers (with an in-memory sink). The feedback-rl rules: ``test_feedback_rules.py``."""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import hmac
import json
import threading
import time
from typing import Any

import pydantic_core
import pytest
from aiohttp.test_utils import TestClient, TestServer

from rlstream.producers.feedback import auth as fa
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.dedupe import IdempotencyLRU
from rlstream.producers.feedback.openapi import openapi_document
from rlstream.producers.feedback.service import INLINE_PARSE_BYTES, FeedbackService
from rlstream.producers.feedback.sink import Delivery, Unavailable
from rlstream.schemas import arrays, events


def event(**over: Any) -> dict[str, Any]:
    base = {
        "feedback_id": "fb-1",
        "request_id": "req-1",
        "policy_version": 3,
        "model": "policy",
        "action": "accepted",
        "token_ids": [5, 6, 7, 8],
        "logprobs": [-0.5, -0.25, -1.0, -2.0],
        "prompt_tokens": 2,
        "task_class": "tab",
        "user_id": "alice@example.com",
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def problems(body: Any, header: str | None = None, max_batch: int = 10) -> list[tuple[str, str]]:
    with pytest.raises(fm.RequestError) as info:
        fm.parse_events(body, header, max_batch, max_tokens=100)
    assert info.value.status == 422
    return [(d.field, d.message) for d in info.value.body.details]


# --- validation -----------------------------------------------------------------------------


def test_a_valid_event_becomes_a_valid_feedback_record_with_the_user_hashed() -> None:
    [parsed] = fm.parse_events(event(), None, 10, 100)
    record = fm.to_record(parsed, "r1", 1234, b"salt")
    events.validate("feedback", record)
    assert record["user_id_hash"] == fm.hash_user("alice@example.com", b"salt")
    assert "alice" not in json.dumps({k: v for k, v in record.items() if isinstance(v, str)})
    tokens = arrays.unpack_tokens(record)
    assert tokens.token_ids.tolist() == [5, 6, 7, 8]
    assert tokens.loss_mask.tolist() == [0, 0, 1, 1]  # derived from prompt_tokens
    assert fm.hash_user("alice@example.com", b"other") != record["user_id_hash"]
    reference = hmac.new(b"salt", b"alice@example.com", hashlib.sha256).hexdigest()
    assert record["user_id_hash"] == reference  # HMAC-SHA256(salt, user id), hex
    assert fm.hash_user("alice@example.com", b"salt") == reference  # again: nothing carried over


def test_every_shape_of_valid_event_becomes_a_record_the_schema_accepts() -> None:
    # The service encodes to_record's output without walking it against the schema again
    # (serializer(validate=False)); this pins that every optional field lands in a valid record.
    fuller = event(
        action="edited",
        edit="x = 2",
        prompt="p",
        completion="c",
        loss_mask=[0, 1, 1, 1],
        prompt_tokens=None,
        routed_experts=[[[1, 2], [3, 4]]] * 4,
        trajectory_ref={"topic": "rl.r1.trajectories", "partition": 2, "offset": 2**40},
        client_created_ms=1_700_000_000_000,
        client_sent_ms=1_700_000_000_500,
        metadata={"editor": "vscode", "lang": ""},
    )
    bare = event(token_ids=None, logprobs=None, prompt_tokens=None, task_class=None)
    serialize = events.serializer("feedback", validate=False)
    for body in (event(), fuller, bare):
        [parsed] = fm.parse_events(body, None, 10, 100)
        record = fm.to_record(parsed, "r1", 1234, b"salt")
        events.validate("feedback", record)
        checked = events.encode("feedback", record)
        assert events.decode(serialize(record, None)) == events.decode(checked)
    [parsed] = fm.parse_events(fuller, None, 10, 100)
    experts = arrays.unpack_tokens(fm.to_record(parsed, "r1", 1234, b"salt")).routed_experts
    assert experts.tolist() == [[[1, 2], [3, 4]]] * 4


def test_errors_name_the_field_and_why() -> None:
    assert problems(event(action="liked"))[0][0] == "action"
    assert problems({"events": [event(), event(action="x")]})[0][0] == "events.1.action"
    assert problems(event(surprise=1)) == [("surprise", "Extra inputs are not permitted")]
    assert problems(event(token_ids=[1, -1, 2, 3]))[0][0] == "token_ids.1"
    assert problems(event(token_ids=[1, 2**31, 2, 3]))[0][0] == "token_ids.1"
    assert problems(event(token_ids=[1, True, 2, 3]))[0][0] == "token_ids.1"
    assert problems(event(logprobs=[-1.0, -1.0]))[0] == (
        "logprobs",
        "Value error, has 2 entries, token_ids has 4",
    )
    assert problems(event(logprobs=None))[0][0] == "logprobs"
    assert problems(event(logprobs=[0.5, 0, 0, 0]))[0][0] == "logprobs.0"
    assert problems(event(loss_mask=[0, 1, 2, 1]))[0][0] == "loss_mask.2"
    assert problems(event(token_ids=None, logprobs=[-1.0], prompt_tokens=None))[0][0] == "logprobs"
    assert problems(event(prompt_tokens=9))[0][0] == "prompt_tokens"
    assert problems(event(prompt_tokens=None))[0][0] == "prompt_tokens"  # mask unknowable
    ragged = [[[1, 2]], [[1]], [[3, 4]], [[5, 6]]]
    assert problems(event(routed_experts=ragged))[0][0] == "routed_experts"
    assert problems(event(routed_experts=[[[1, 256]]] * 4))[0][0] == "routed_experts.0.0.1"


def test_edit_is_required_exactly_when_the_action_is_edited() -> None:
    assert problems(event(action="edited"))[0][0] == "edit"
    assert problems(event(edit="x"))[0][0] == "edit"
    assert fm.parse_events(event(action="edited", edit="better"), None, 10, 100)[0].edit == "better"


def test_batches_sizes_and_idempotency_keys() -> None:
    assert problems([event()]) == [("", "expected a JSON object")]
    assert problems({"events": []})[0][0] == "events"
    assert problems({"events": [event(feedback_id=f"f{i}") for i in range(11)]})[0][0] == "events"
    assert problems({"events": [event(feedback_id=None)]})[0][0] == "events.0.feedback_id"
    assert problems(event(feedback_id=None))[0][0] == "feedback_id"
    assert problems(event(token_ids=list(range(101)), logprobs=[-1.0] * 101))[0][0] == "token_ids"
    assert fm.parse_events(event(feedback_id=None), "key-9", 10, 100)[0].feedback_id == "key-9"
    assert problems(event(), header="other")[0][0] == "feedback_id"  # disagrees with the body
    assert problems(event(feedback_id=None), header="bad key!")[0][0] == "header Idempotency-Key"


def _single(**over: Any) -> bytes:
    return json.dumps(event(**over)).encode()


_VALID = _single()
BODIES: list[tuple[bytes, str | None]] = [
    (_VALID, None),
    (_VALID, "fb-1"),  # the header agrees
    (_VALID, "fb-2"),  # disagrees
    (_single(feedback_id=None), "key-9"),
    (_single(feedback_id=None), "bad key!"),
    (_single(feedback_id=None), None),
    (_single(logprobs=[-1, 0, -2, -3]), None),  # ints for floats
    (_single(token_ids=[5.0, 6, 7, 8]), None),  # a float for an int
    (_single(policy_version=True), None),
    (_single(logprobs=[float("nan"), -1.0, -1.0, -1.0]), None),  # NaN literal
    (_single(logprobs=[float("-inf"), -1.0, -1.0, -1.0]), None),
    (_single(logprobs=[0.5, -1.0, -1.0, -1.0]), None),
    (_single(token_ids=[2**31, 6, 7, 8]), None),
    (_single(token_ids=[10**30, 6, 7, 8]), None),
    (_single(token_ids=list(range(101)), logprobs=[-1.0] * 101), None),  # over max_tokens
    (_single(action="edited"), None),
    (_single(action="edited", edit="better"), None),
    (_single(extra=1), None),
    (
        _single(
            trajectory_ref={"topic": "t", "partition": 0, "offset": 9},
            token_ids=None,
            logprobs=None,
            prompt_tokens=None,
        ),
        None,
    ),
    (_single(metadata={"events": "x", "k": "\u00e9\U0001f600"}), None),  # "events": slow path
    (_single(user_id="\ud800"), None),  # a lone surrogate
    (_VALID.replace(b'"action": "accepted"', b'"action": "rejected", "action": "accepted"'), None),
    (_VALID.replace(b'"action": "accepted"', b'"action": "accepted", "action": "nope"'), None),
    (_VALID + b" x", None),  # trailing data
    (b"\xef\xbb\xbf" + _VALID, None),  # a byte order mark
    (json.dumps({"events": [event(), event(feedback_id="fb-2")]}).encode(), None),
    (json.dumps({"events": [event(feedback_id=None)]}).encode(), "k"),
    (b"[1, 2]", None),
    (b'"a string"', None),
    (b"{nope", None),
    (b"[" * 5000, None),
    (b"", None),
]


def _outcome(parse: Any) -> Any:
    try:
        return "ok", [e.model_dump() for e in parse()]
    except fm.RequestError as exc:
        if exc.status == 400:
            return 400  # the parser's message
        return exc.status, exc.body.model_dump()


@pytest.mark.parametrize(("raw", "header"), BODIES)
def test_a_body_parses_as_its_json_parsed_first_would(raw: bytes, header: str | None) -> None:
    """parse_body (one event straight from its bytes when it can) answers exactly as the
    general path: JSON to Python objects, then parse_events."""

    def general() -> list[fm.FeedbackEvent]:
        try:
            data = pydantic_core.from_json(raw)
        except ValueError:
            raise fm.RequestError(400, fm.ErrorResponse(error="bad_json")) from None
        return fm.parse_events(data, header, 10, 100)

    fast = _outcome(lambda: fm.parse_body(raw, header, 10, 100)[0])
    assert fast == _outcome(general)


def test_parse_body_says_whether_the_body_was_a_batch() -> None:
    batch = json.dumps({"events": [event()]}).encode()
    assert fm.parse_body(batch, None, 10, 100)[1] is True
    assert fm.parse_body(_VALID, None, 10, 100)[1] is False


def test_config_tokens_come_from_config_and_environment() -> None:
    cfg = fm.FeedbackServiceConfig(run="r1", tokens=["s3cret"])
    assert cfg.accepted_tokens({fm.TOKENS_ENV: " b, ,c"}) == [b"s3cret", b"b", b"c"]
    assert "s3cret" not in repr(cfg)  # secrets never print
    with pytest.raises(ValueError):
        fm.FeedbackServiceConfig(run="r1", surprise=1)
    with pytest.raises(ValueError):
        fm.FeedbackServiceConfig(run="bad.run")
    assert cfg.salt({fm.SALT_ENV: "s"}) == (b"s", True)
    assert cfg.salt({})[1] is False


# --- authentication -------------------------------------------------------------------------


TARGET = fa.Target("POST", "/v1/feedback", "r1")


def signed(
    body: bytes,
    key: bytes = b"k1-secret",
    ts: float | None = None,
    target: fa.Target = TARGET,
    idempotency_key: str = "",
) -> dict[str, str]:
    stamp = str(int(time.time() if ts is None else ts))
    headers = {
        fa.KEY_ID_HEADER: "k1",
        fa.TIMESTAMP_HEADER: stamp,
        fa.SIGNATURE_HEADER: fa.sign(key, stamp, target, idempotency_key, body),
    }
    return {**headers, fm.IDEMPOTENCY_HEADER: idempotency_key} if idempotency_key else headers


def test_signature_is_hmac_sha256_of_the_signed_message() -> None:
    target = fa.Target("POST", "/v1/feedback", "r1")
    message = fa.signed_message("1700000000", target, "k-1", b'{"a": 1}')
    assert message == b'1700000000\nPOST\n/v1/feedback\nr1\nk-1\n{"a": 1}'
    for key in (b"key-1", b"key-2", b"key-1"):  # a remembered key schedule changes nothing
        expected = "sha256=" + hmac.new(key, message, hashlib.sha256).hexdigest()
        assert fa.sign(key, "1700000000", target, "k-1", b'{"a": 1}') == expected


def test_hmac_signature_covers_body_and_timestamp() -> None:
    keys, body, now = {"k1": b"k1-secret"}, b'{"a": 1}', time.time()
    check = functools.partial(fa.check_signature, target=TARGET, keys=keys, now_s=now, skew_s=300)
    assert check(signed(body), body=body) is None
    assert check(signed(body), body=body + b" ") == "bad signature"
    assert check(signed(body, b"wrong"), body=body) == "bad signature"
    old = signed(body, ts=now - 301)
    assert check(old, body=body) == "timestamp outside the allowed skew"
    moved = {**signed(body), fa.TIMESTAMP_HEADER: str(int(now) + 1)}  # replayed with a new time
    assert check(moved, body=body) == "bad signature"
    assert check({**signed(body), fa.KEY_ID_HEADER: "k2"}, body=body)
    assert check({}, body=body) == "missing credentials"


def test_hmac_signature_covers_method_path_run_and_idempotency_key() -> None:
    keys, body, now = {"k1": b"k1-secret"}, b'{"a": 1}', time.time()
    headers = signed(body, idempotency_key="fb-1")
    ok = fa.check_signature(headers, TARGET, body, keys, now, 300)
    assert ok is None
    elsewhere = [
        fa.Target("PUT", "/v1/feedback", "r1"),
        fa.Target("POST", "/v1/other", "r1"),
        fa.Target("POST", "/v1/feedback", "r2"),  # the same request replayed into another run
    ]
    for target in elsewhere:
        assert fa.check_signature(headers, target, body, keys, now, 300) == "bad signature"
    new_key = {**headers, fm.IDEMPOTENCY_HEADER: "fb-2"}  # replayed as a new event
    assert fa.check_signature(new_key, TARGET, body, keys, now, 300) == "bad signature"
    dropped = {k: v for k, v in headers.items() if k != fm.IDEMPOTENCY_HEADER}
    assert fa.check_signature(dropped, TARGET, body, keys, now, 300) == "bad signature"


@pytest.mark.parametrize("stamp", ["\u00b2", "1e9", " 17", "-1", "1" * 13, "\u0661\u0662"])
def test_a_timestamp_that_is_not_ascii_digits_is_refused_not_parsed(stamp: str) -> None:
    headers = {**signed(b"x"), fa.TIMESTAMP_HEADER: stamp}
    why = fa.check_signature(headers, TARGET, b"x", {"k1": b"k1-secret"}, time.time(), 300)
    assert why == "bad timestamp"


def test_bearer_or_signature_authenticates() -> None:
    tokens, keys, now = [b"tok"], {"k1": b"k1-secret"}, time.time()
    auth = functools.partial(
        fa.authenticate, target=TARGET, tokens=tokens, keys=keys, now_s=now, skew_s=300
    )
    assert auth({"Authorization": "Bearer tok"}, body=b"") is None
    assert auth({"Authorization": "bearer tok"}, body=b"") is None
    assert auth({"Authorization": "Bearer tok2"}, body=b"")
    assert auth({"Authorization": "Basic tok"}, body=b"")
    assert auth({}, body=b"") == "missing credentials"
    assert auth(signed(b"x"), body=b"x") is None
    assert not fa.check_bearer("Bearer tok", [])


def test_headers_alone_refuse_what_needs_no_body() -> None:
    tokens, keys = [b"tok"], {"k1": b"k1-secret"}
    assert fa.check_headers({"Authorization": "Bearer tok"}, tokens, keys) is None
    assert fa.check_headers(signed(b"x"), tokens, keys) is None  # the body decides later
    assert fa.check_headers({}, tokens, keys) == "missing credentials"
    assert fa.check_headers({"Authorization": "Bearer no"}, tokens, keys) == "bad bearer token"
    unknown = {**signed(b"x"), fa.KEY_ID_HEADER: "k9"}
    assert fa.check_headers(unknown, tokens, keys) == "unknown key id"


# --- idempotency ----------------------------------------------------------------------------


def test_idempotency_lru_forgets_after_the_window_and_past_its_size() -> None:
    now = [0.0]
    lru = IdempotencyLRU(window_s=10, max_ids=3, clock=lambda: now[0])
    lru.add("a")
    now[0] = 5
    lru.add("b")
    assert "a" in lru and "b" in lru and "c" not in lru
    now[0] = 10.5
    assert "a" not in lru and "b" in lru  # a is older than the window
    for name in "cde":
        lru.add(name)
    assert len(lru) == 3 and "b" not in lru and "e" in lru  # bounded: the oldest went


# --- the HTTP service with an in-memory sink ------------------------------------------------


class MemorySink:
    """Acknowledges after a short delay, or fails every record when ``down``."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.down = False

    def submit(
        self, topic: str, key: bytes, value: bytes, headers: Any
    ) -> asyncio.Future[Delivery]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivery] = loop.create_future()
        if self.down:
            loop.call_later(0.01, future.set_result, Delivery(False, error="broker down"))
        else:
            self.records.append(value)
            loop.call_later(0.01, future.set_result, Delivery(True, 0, len(self.records) - 1))
        return future

    async def ready(self) -> Delivery:
        return Delivery(True)

    def close(self) -> None:
        pass


def http(calls: Any, sink: MemorySink | None = None) -> tuple[list[Any], MemorySink]:
    sink = sink or MemorySink()
    cfg = fm.FeedbackServiceConfig(run="r1", tokens=["tok"], max_body_bytes=4096, retry_after_s=7)

    async def main() -> list[Any]:
        service = FeedbackService(cfg, sink, environ={fm.SALT_ENV: "s"})
        async with TestClient(TestServer(service.application())) as client:
            return await calls(client)

    return asyncio.run(main()), sink


AUTH = {"Authorization": "Bearer tok"}


def test_http_answers_for_each_kind_of_refusal() -> None:
    async def calls(c: TestClient) -> list[Any]:
        out = []
        for kwargs in (
            {"json": event()},
            {"json": event(feedback_id="fb-2", action="x"), "headers": AUTH},
            {"data": b"{nope", "headers": {**AUTH, "Content-Type": "application/json"}},
            {"data": b"{}", "headers": {**AUTH, "Content-Type": "text/plain"}},
            {"data": b"[" * 5000, "headers": {**AUTH, "Content-Type": "application/json"}},
            {
                "data": b"[" * 2000 + b"]" * 2000,
                "headers": {**AUTH, "Content-Type": "application/json"},
            },
        ):
            r = await c.post("/v1/feedback", **kwargs)
            out.append((r.status, await r.json()))
        return out

    (unauth, invalid, bad_json, media, too_big, deep), sink = http(calls)
    assert unauth[0] == 401 and invalid[0] == 422 and bad_json[0] == 400 and media[0] == 415
    assert too_big[0] == 413 and deep[0] == 400  # deep nesting is bad JSON, not a crash
    assert invalid[1]["details"][0]["field"] == "action"
    assert sink.records == []


def test_http_stores_once_and_answers_duplicates() -> None:
    async def calls(c: TestClient) -> list[Any]:
        first = await c.post("/v1/feedback", json=event(), headers=AUTH)
        concurrent = await asyncio.gather(
            *[
                c.post("/v1/feedback", json=event(feedback_id="fb-2"), headers=AUTH)
                for _ in range(5)
            ]
        )
        again = await c.post("/v1/feedback", json=event(), headers=AUTH)
        batch = {"events": [event(), event(feedback_id="fb-3"), event(feedback_id="fb-3")]}
        mixed = await c.post("/v1/feedback", json=batch, headers=AUTH)
        metrics = await (await c.get("/metrics")).text()
        responses = [first, *concurrent, again, mixed]
        return [(r.status, await r.json()) for r in responses] + [metrics]

    (*answers, metrics), sink = http(calls)
    assert answers[0][0] == 202 and answers[0][1]["results"][0]["status"] == "stored"
    assert sorted(a[0] for a in answers[1:6]) == [200, 200, 200, 200, 202]
    assert answers[6] == (200, {**answers[6][1], "duplicate": True})
    statuses = [r["status"] for r in answers[7][1]["results"]]
    assert answers[7][0] == 202 and statuses == ["duplicate", "stored", "duplicate"]
    stored = [events.decode(v).record["feedback_id"] for v in sink.records]
    assert sorted(stored) == ["fb-1", "fb-2", "fb-3"]
    assert 'rlstream_feedback_events_total{outcome="stored"} 3' in metrics
    assert "rlstream_feedback_request_seconds_count 8" in metrics


def test_a_large_body_is_parsed_off_the_event_loop_and_a_small_one_on_it() -> None:
    cfg = fm.FeedbackServiceConfig(run="r1", tokens=["tok"])
    small = event(feedback_id="fb-small")
    large = event(feedback_id="fb-large", prompt="x" * (INLINE_PARSE_BYTES + 1))
    threads: list[str] = []

    async def main() -> list[int]:
        service = FeedbackService(cfg, MemorySink(), environ={fm.SALT_ENV: "s"})
        decode = service._decode

        def spy(body: bytes, key: str | None) -> Any:
            threads.append(threading.current_thread().name)
            return decode(body, key)

        service._decode = spy  # type: ignore[method-assign]
        async with TestClient(TestServer(service.application())) as client:
            answers = [
                await client.post("/v1/feedback", json=b, headers=AUTH) for b in (small, large)
            ]
            return [r.status for r in answers]

    loop_thread = threading.current_thread().name
    assert asyncio.run(main()) == [202, 202]
    assert threads[0] == loop_thread and threads[1].startswith("feedback-parse")


def test_http_answers_503_with_retry_after_when_kafka_fails() -> None:
    sink = MemorySink()
    sink.down = True

    async def calls(c: TestClient) -> list[Any]:
        r = await c.post("/v1/feedback", json=event(), headers=AUTH)
        sink.down = False
        again = await c.post("/v1/feedback", json=event(), headers=AUTH)
        return [(r.status, r.headers.get("Retry-After")), again.status]

    [(status, retry), again], _ = http(calls, sink)
    assert (status, retry, again) == (503, "7", 202)  # the failed id was not remembered


def test_http_survives_a_sink_that_refuses_at_once() -> None:
    class Full(MemorySink):
        def submit(self, *args: Any) -> asyncio.Future[Delivery]:
            raise Unavailable("queue full")

    async def calls(c: TestClient) -> list[Any]:
        r = await c.post("/v1/feedback", json=event(), headers=AUTH)
        return [r.status, (await c.get("/healthz")).status]

    assert http(calls, Full())[0] == [503, 200]


def test_openapi_document_is_generated_from_the_models() -> None:
    doc = openapi_document()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    assert schemas["FeedbackEvent"]["additionalProperties"] is False
    assert set(schemas["FeedbackEvent"]["required"]) >= {"request_id", "action", "user_id"}
    assert set(doc["paths"]["/v1/feedback"]["post"]["responses"]) >= {"202", "401", "422", "503"}


def test_serve_command_reads_config_table_and_flags(tmp_path: Any) -> None:
    from rlstream.ops.cli import cmd_serve

    path = tmp_path / "svc.toml"
    path.write_text('[serve.feedback]\nport = 9000\ntokens = ["x"]\nmax_batch = 7\n')
    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "feedback", "--run", "r9", "--service-config", str(path), "--port", "0"]
    )
    cfg = cmd_serve.feedback_service_config(args)
    assert (cfg.run, cfg.port, cfg.max_batch) == ("r9", 0, 7)
    # --config is the run recipe everywhere; feedback-ingest takes none, so it is refused
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "feedback", "--run", "r9", "--config", str(path)])
    recipe = parser.parse_args(["serve", "policy", "--run", "r9", "--config", "run.toml"])
    assert recipe.config == "run.toml"
