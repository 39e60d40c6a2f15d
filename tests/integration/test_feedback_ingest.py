"""feedback-ingest against a real broker over real HTTP on a free port.

Properties: no request (fuzzed from the service's own OpenAPI document) gets a 5xx; every event
answered ``stored`` is in the feedback topic exactly once and nothing else is; a retried request
is stored once; unauthenticated or tampered requests get 401 and store nothing; with Kafka
unreachable the answer is 503 with Retry-After.

Containment: a forged signature is refused from the headers before its body is read (a body
signed without its digest is read only up to a small bound); a client over its rate, or a
request over the open connections, gets 429 with Retry-After, and forged requests cannot spend
another client's rate; feedback ids are per client, durably, so no client can pre-claim another's.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import read_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.consumers.feedback.seen import FeedbackIdLog
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.feedback import auth as fa
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.dedupe import dedupe_key, principal_of_token
from rlstream.producers.feedback.service import running_service
from rlstream.schemas import events, topics

TOKEN = "it-token"
TOKEN2 = "it-token-2"
KEY = b"it-hmac-key"
UNHASHED = 16 * 1024  # the service fixture reads a body signed without its digest up to this


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(f"{url}/v1/feedback", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def post_json(url: str, payload: Any, **headers: str) -> tuple[int, dict[str, str], Any]:
    body = json.dumps(payload).encode()
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    return post(url, body, {**auth, **headers})


def stored_ids(kafka: KafkaSettings, run: str) -> collections.Counter[str]:
    values = read_all(kafka, topics.topic_name(run, "feedback"))
    return collections.Counter(events.decode(v).record["feedback_id"] for _, v, _ in values)


def good_event(fid: str, request: str = "q1", **over: Any) -> dict[str, Any]:
    return {
        "feedback_id": fid,
        "request_id": request,
        "policy_version": 1,
        "model": "policy",
        "action": "accepted",
        "token_ids": [1, 2, 3],
        "logprobs": [-0.1, -0.2, -0.3],
        "prompt_tokens": 1,
        "user_id": "u1",
        **over,
    }


@pytest.fixture(scope="module")
def service(kafka: KafkaSettings) -> Iterator[tuple[str, str]]:
    run = f"t-ingest-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(
        run=run,
        port=0,
        tokens=[TOKEN],
        hmac_keys={"k1": KEY.decode()},
        max_body_bytes=65536,
        max_unhashed_body_bytes=UNHASHED,
    )
    with running_service(cfg, settings=kafka, environ={fm.SALT_ENV: "salt"}) as running:
        yield running.url, run


# --- fuzzing from the OpenAPI document -------------------------------------------------------


def from_schema(
    schema: dict[str, Any], defs: dict[str, Any], depth: int = 0
) -> st.SearchStrategy[Any]:
    """Values for the subset of JSON Schema that pydantic emits (enough to reach every field)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs, depth) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, defs, depth)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        return st.lists(items, max_size=min(schema.get("maxItems", 6), 6))
    if kind == "integer":
        low, high = schema.get("minimum", -(2**40)), schema.get("maximum", 2**40)
        return st.integers(low - 1, high + 1) | st.sampled_from([low, high])
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False, width=32) | st.just(0.0)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= 128)
        return st.text(max_size=min(schema.get("maxLength", 20), 20))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none() | st.integers() | st.text(max_size=5)


def _object(schema: dict[str, Any], defs: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    props = schema.get("properties", {})
    if not props:
        values = from_schema(schema.get("additionalProperties") or {"type": "string"}, defs, depth)
        return st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=3)
    required = set(schema.get("required", ()))
    fields = {
        name: from_schema(sub, defs, depth + 1) if depth < 4 else st.none()
        for name, sub in props.items()
    }
    mandatory = st.fixed_dictionaries({k: v for k, v in fields.items() if k in required})
    optional = st.fixed_dictionaries(
        {}, optional={k: v for k, v in fields.items() if k not in required}
    )
    extra = st.dictionaries(st.sampled_from(["surprise", "x"]), st.integers(), max_size=1)
    return st.builds(lambda a, b, c: {**a, **b, **c}, mandatory, optional, extra)


def valid_events() -> st.SearchStrategy[dict[str, Any]]:
    """Events that pass validation, so the fuzz also exercises the storing path."""

    def build(t: int, fid: str, req: str, action: str, cls: str | None) -> dict[str, Any]:
        event = good_event(fid, req, action=action, token_ids=list(range(t)))
        event.update(logprobs=[-0.5] * t, prompt_tokens=min(1, t))
        event["task_class"] = cls
        if action == "edited":
            event["edit"] = "fixed"
        return event

    ids = st.text("abcdef0123", min_size=1, max_size=6)
    actions = st.sampled_from(["accepted", "rejected", "edited", "dissatisfied"])
    return st.builds(build, st.integers(0, 20), ids, ids, actions, st.none() | st.just("tab"))


def test_fuzzed_requests_never_5xx_and_every_stored_event_is_in_the_topic_once(
    kafka: KafkaSettings, service: tuple[str, str]
) -> None:
    url, run = service
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    defs = doc["components"]["schemas"]
    body = doc["paths"]["/v1/feedback"]["post"]["requestBody"]["content"]["application/json"]
    fuzzed = from_schema(body["schema"], defs)
    batches = st.lists(valid_events(), min_size=1, max_size=4).map(lambda e: {"events": e})
    stored: collections.Counter[str] = collections.Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(fuzzed, valid_events(), batches))
    def check(payload: Any) -> None:
        status, _, answer = post_json(url, payload)
        assert status < 500, (status, answer)
        assert status in (200, 202, 413, 422), (status, answer)
        if status in (200, 202):
            stored.update(r["feedback_id"] for r in answer["results"] if r["status"] == "stored")

    check()
    assert stored, "the fuzz never reached the storing path"
    assert max(stored.values()) == 1  # the service never answered stored twice for one id
    assert stored_ids(kafka, run) == stored


# --- properties one by one ------------------------------------------------------------------


def test_retried_and_concurrent_requests_are_stored_once(
    kafka: KafkaSettings, service: tuple[str, str]
) -> None:
    url, run = service
    fid = f"retry-{uuid.uuid4().hex[:8]}"
    statuses = [post_json(url, good_event(fid))[0]]
    with ThreadPoolExecutor(8) as pool:
        statuses += list(pool.map(lambda _: post_json(url, good_event(fid))[0], range(8)))
    header_fid = f"hdr-{uuid.uuid4().hex[:8]}"
    event = {k: v for k, v in good_event("x").items() if k != "feedback_id"}
    statuses += [post_json(url, event, **{"Idempotency-Key": header_fid})[0] for _ in range(2)]
    assert statuses[0] == 202 and set(statuses[1:9]) == {200}
    assert statuses[9:] == [202, 200]
    ids = stored_ids(kafka, run)
    assert ids[fid] == 1 and ids[header_fid] == 1


def test_unauthenticated_and_tampered_requests_get_401_and_store_nothing(
    kafka: KafkaSettings, service: tuple[str, str]
) -> None:
    url, run = service
    tag = uuid.uuid4().hex[:8]
    body = json.dumps(good_event(f"signed-{tag}")).encode()
    typed = {"Content-Type": "application/json"}
    ts = str(int(time.time()))
    target = fa.Target("POST", fm.FEEDBACK_PATH, run)
    signature = {
        fa.KEY_ID_HEADER: "k1",
        fa.TIMESTAMP_HEADER: ts,
        fa.SIGNATURE_HEADER: fa.sign(KEY, ts, target, "", body),
    }
    tampered = body.replace(b'"accepted"', b'"rejected"')
    old_ts = str(int(time.time()) - 3600)
    replayed = {
        **signature,
        fa.TIMESTAMP_HEADER: old_ts,
        fa.SIGNATURE_HEADER: fa.sign(KEY, old_ts, target, "", body),
    }
    other_run = fa.sign(KEY, ts, fa.Target("POST", fm.FEEDBACK_PATH, "another-run"), "", body)
    refused = [
        post(url, json.dumps(good_event(f"none-{tag}")).encode(), typed),
        post(
            url,
            json.dumps(good_event(f"bad-{tag}")).encode(),
            {**typed, "Authorization": "Bearer nope"},
        ),
        post(url, tampered, {**typed, **signature}),
        post(url, body, {**typed, **signature, fa.SIGNATURE_HEADER: "sha256=" + "0" * 64}),
        post(url, body, {**typed, **replayed}),
        post(url, body, {**typed, **signature, fa.SIGNATURE_HEADER: other_run}),
        post(url, body, {**typed, **signature, fa.KEY_ID_HEADER: "k9"}),  # unknown key id
        post(url, body, {**typed, **signature, fa.TIMESTAMP_HEADER: "\u00b2"}),  # not a 500
        post(url, body, {**typed, **signature, fm.IDEMPOTENCY_HEADER: f"new-{tag}"}),
    ]
    assert [status for status, _, _ in refused] == [401] * 9
    assert all(answer["error"] == "unauthorized" for _, _, answer in refused)
    # one answer for every failure: a client learns nothing about which check refused it
    assert {answer["message"] for _, _, answer in refused} == {fa.UNAUTHORIZED}
    assert post(url, body, {**typed, **signature})[0] == 202
    ids = stored_ids(kafka, run)
    assert ids[f"signed-{tag}"] == 1
    assert not [i for i in ids if i in (f"none-{tag}", f"bad-{tag}")]


def test_health_metrics_and_size_limits(service: tuple[str, str]) -> None:
    url, _ = service
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    status, _, answer = post_json(url, good_event("big", completion="x" * 70_000))
    assert status == 413 and answer["error"] == "too_large"
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'rlstream_feedback_requests_total{path="/v1/feedback",status="413"}' in text
    assert "rlstream_feedback_request_seconds_bucket" in text


def test_kafka_unreachable_answers_503_with_retry_after() -> None:
    dead = KafkaSettings(bootstrap_servers="127.0.0.1:1")
    cfg = fm.FeedbackServiceConfig(
        run="t-dead", port=0, tokens=[TOKEN], message_timeout_ms=1000, retry_after_s=3
    )
    with running_service(cfg, settings=dead, environ={fm.SALT_ENV: "s"}) as running:
        started = time.monotonic()
        status, headers, answer = post_json(running.url, good_event("lost"))
        assert time.monotonic() - started < 10
        with urllib.request.urlopen(f"{running.url}/healthz", timeout=10) as r:
            health = json.loads(r.read())
    assert status == 503 and headers.get("Retry-After") == "3"
    assert answer["error"] == "unavailable" and health["kafka"] == "unavailable"


def _answer_to_head(url: str, headers: str) -> str:
    """The status line the service sends to a request head whose body never comes."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {fm.FEEDBACK_PATH} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        return sock.recv(4096).decode(errors="replace")


def test_a_body_over_the_limit_is_refused_before_it_is_read(service: tuple[str, str]) -> None:
    """Content-Length over the limit: 413 at once, though the body never arrives."""
    headers = (
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {1 << 30}\r\n"
    )
    answer = _answer_to_head(service[0], headers)
    assert answer.startswith("HTTP/1.1 413"), answer[:80]


def test_an_unauthenticated_body_is_never_read(service: tuple[str, str]) -> None:
    """Without credentials the answer is 401 before the (promised, never sent) body."""
    headers = "Content-Type: application/json\r\nContent-Length: 60000\r\n"
    answer = _answer_to_head(service[0], headers)
    assert answer.startswith("HTTP/1.1 401"), answer[:80]


def test_stored_ids_survive_a_restart_and_are_shared_by_replicas(kafka: KafkaSettings) -> None:
    run = f"t-dedupe-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN])
    environ = {fm.SALT_ENV: "salt"}

    def replica() -> FeedbackIdLog:
        return FeedbackIdLog(kafka, run, cfg.idempotency_window_s, cfg.idempotency_max_ids)

    with contextlib.ExitStack() as stack:
        seen_a, seen_b = stack.enter_context(replica()), stack.enter_context(replica())
        a = stack.enter_context(running_service(cfg, kafka, environ=environ, dedupe=seen_a))
        b = stack.enter_context(running_service(cfg, kafka, environ=environ, dedupe=seen_b))
        assert post_json(a.url, good_event("fb-1"))[0] == 202
        deadline = time.monotonic() + 15
        seen = dedupe_key(principal_of_token(TOKEN.encode()), "fb-1")  # ids are per client
        while seen not in seen_b and time.monotonic() < deadline:
            time.sleep(0.05)  # replica b learns the id from the stream
        status, _, answer = post_json(b.url, good_event("fb-1"))
        assert status == 200 and answer["duplicate"] is True
    with (
        replica() as restarted,
        running_service(cfg, kafka, environ=environ, dedupe=restarted) as again,
    ):
        assert restarted.loaded >= 1
        status, _, answer = post_json(again.url, good_event("fb-1"))
        assert status == 200 and answer["duplicate"] is True
    assert stored_ids(kafka, run)["fb-1"] == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_tls_serves_https_only(kafka: KafkaSettings, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    run = f"t-tls-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(
        run=run, port=0, tokens=[TOKEN], tls_cert_file=str(cert), tls_key_file=str(key)
    )
    with running_service(cfg, kafka, environ={fm.SALT_ENV: "s"}) as running:
        assert running.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        body = json.dumps(good_event("tls-1")).encode()
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        request = urllib.request.Request(f"{running.url}{fm.FEEDBACK_PATH}", body, headers)
        with urllib.request.urlopen(request, timeout=30, context=trusted) as r:
            assert r.status == 202
        plain = running.url.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"{plain}/healthz", timeout=10)


# --- containment: forged signatures, rates, connections, per-client ids ----------------------


def test_a_forged_signature_is_refused_before_the_body_is_read(
    kafka: KafkaSettings, service: tuple[str, str]
) -> None:
    """A known key id with a bogus signature and no timestamp, a stale one, or a bogus digest
    signature: 401 from the headers, though the promised body never comes. A body signed without
    its digest over the unhashed bound: 413 at once. A digest-signed body: verified before it is
    read, then stored; one that does not hash to its signed digest: 401."""
    url, run = service
    now = int(time.time())
    forged = (
        f"Content-Type: application/json\r\nContent-Length: 60000\r\n"
        f"{fa.KEY_ID_HEADER}: k1\r\n{fa.SIGNATURE_HEADER}: sha256={'0' * 64}\r\n"
    )
    answers = [
        _answer_to_head(url, forged),
        _answer_to_head(url, forged + f"{fa.TIMESTAMP_HEADER}: {now - 3600}\r\n"),
        _answer_to_head(
            url, forged + f"{fa.TIMESTAMP_HEADER}: {now}\r\n{fa.DIGEST_HEADER}: {'ab' * 32}\r\n"
        ),
        _answer_to_head(url, forged + f"{fa.TIMESTAMP_HEADER}: {now}\r\n"),
    ]
    assert [a[:12] for a in answers] == ["HTTP/1.1 401"] * 3 + ["HTTP/1.1 413"], answers

    target, fid = fa.Target("POST", fm.FEEDBACK_PATH, run), f"digest-{uuid.uuid4().hex[:8]}"
    body = json.dumps(good_event(fid, completion="x" * (2 * UNHASHED))).encode()
    ts = str(int(time.time()))
    signed = {
        "Content-Type": "application/json",
        fa.KEY_ID_HEADER: "k1",
        fa.TIMESTAMP_HEADER: ts,
        fa.DIGEST_HEADER: fa.body_digest(body),
        fa.SIGNATURE_HEADER: fa.sign_digest(KEY, ts, target, "", body),
    }
    altered = body.replace(b'"accepted"', b'"rejected"')
    assert post(url, altered, signed)[0] == 401
    assert post(url, body, signed)[0] == 202
    assert stored_ids(kafka, run)[fid] == 1


def test_a_client_over_its_rate_gets_429_and_forgeries_spend_nothing(kafka: KafkaSettings) -> None:
    run = f"t-rate-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(
        run=run,
        port=0,
        tokens=[TOKEN, TOKEN2],
        hmac_keys={"k1": KEY.decode()},
        rate_per_client_s=0.2,
        rate_burst=2,
    )
    target = fa.Target("POST", fm.FEEDBACK_PATH, run)

    def hmac_post(url: str, fid: str, key: bytes) -> int:
        body, ts = json.dumps(good_event(fid)).encode(), str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            fa.KEY_ID_HEADER: "k1",
            fa.TIMESTAMP_HEADER: ts,
            fa.SIGNATURE_HEADER: fa.sign(key, ts, target, "", body),
        }
        return post(url, body, headers)[0]

    with running_service(cfg, kafka, environ={fm.SALT_ENV: "s"}) as running:
        url = running.url
        first = [post_json(url, good_event(f"a-{i}"))[0] for i in range(2)]
        status, headers, answer = post_json(url, good_event("a-2"))
        other = post_json(url, good_event("b-0"), Authorization=f"Bearer {TOKEN2}")[0]
        forged = [hmac_post(url, f"f-{i}", b"not-the-key") for i in range(5)]
        genuine = [hmac_post(url, f"k-{i}", KEY) for i in range(2)]
    assert first == [202, 202] and status == 429 and answer["error"] == "rate_limited"
    assert int(headers["Retry-After"]) >= 1
    assert other == 202  # another client's budget is its own
    assert forged == [401] * 5 and genuine == [202, 202]  # forgeries spent none of k1's
    assert set(stored_ids(kafka, run)) == {"a-0", "a-1", "b-0", "k-0", "k-1"}


def test_a_request_over_the_open_connections_gets_429(kafka: KafkaSettings) -> None:
    run = f"t-conns-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN], max_connections=2)
    with running_service(cfg, kafka, environ={fm.SALT_ENV: "s"}) as running:
        host, port = running.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        time.sleep(0.3)  # both accepted by the server
        status, headers, answer = post_json(running.url, good_event("over"))
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 10
        while (after := post_json(running.url, good_event("after"))[0]) == 429:
            assert time.monotonic() < deadline, "still refused after the connections closed"
            time.sleep(0.2)
    assert status == 429 and answer["error"] == "too_many_connections"
    assert headers.get("Retry-After") and after == 202
    assert set(stored_ids(kafka, run)) == {"after"}


def test_feedback_ids_are_per_client_and_durably_so(kafka: KafkaSettings) -> None:
    """Client B may use an id client A used (both stored); A's retry is a duplicate; after a
    restart the stream-backed dedupe still tells them apart."""
    run = f"t-ns-{uuid.uuid4().hex[:8]}"
    ensure_run_topics(kafka, run)
    cfg = fm.FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN, TOKEN2])
    environ, as_b = {fm.SALT_ENV: "salt"}, {"Authorization": f"Bearer {TOKEN2}"}

    def replica() -> FeedbackIdLog:
        return FeedbackIdLog(kafka, run, cfg.idempotency_window_s, cfg.idempotency_max_ids)

    with replica() as seen, running_service(cfg, kafka, environ=environ, dedupe=seen) as svc:
        a = post_json(svc.url, good_event("same-id"))[0]
        b = post_json(svc.url, good_event("same-id", request="q2"), **as_b)[0]
        again = post_json(svc.url, good_event("same-id"))[0]
    with replica() as seen, running_service(cfg, kafka, environ=environ, dedupe=seen) as svc:
        later = [
            post_json(svc.url, good_event("same-id"))[0],
            post_json(svc.url, good_event("same-id", request="q2"), **as_b)[0],
        ]
    assert (a, b, again) == (202, 202, 200) and later == [200, 200]
    values = read_all(kafka, topics.topic_name(run, "feedback"))
    clients = {dict(m.headers() or [])["feedback_client"] for _, _, m in values}
    assert stored_ids(kafka, run)["same-id"] == 2 and len(clients) == 2
    assert all(TOKEN not in c.decode() and TOKEN2 not in c.decode() for c in clients)
