"""feedback-ingest's containment rules without a socket or a broker, and its parse queue over
real HTTP (aiohttp's test server, an in-memory sink).

Properties: what the headers prove (``auth.identify``): a bearer token or a digest signature
proves the caller before the body; a known key id with no timestamp, a stale one or a bogus
digest signature is refused; a signature over the body is checked only with the body. Token
buckets refill at their rate and are per client; the parse queue is bounded and a request that
finds it full is answered 503 with Retry-After before its body is read. Dedupe keys keep clients
apart, and a record's headers give back its key.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from test_feedback_models import MemorySink, event

from rlstream.producers.feedback import auth as fa
from rlstream.producers.feedback import models as fm
from rlstream.producers.feedback.dedupe import (
    dedupe_key,
    key_of_headers,
    principal_of_key,
    principal_of_token,
    record_headers,
)
from rlstream.producers.feedback.limits import ParseSlots, RateLimiter
from rlstream.producers.feedback.service import INLINE_PARSE_BYTES, FeedbackService

TARGET = fa.Target("POST", "/v1/feedback", "r1")
KEYS = {"k1": b"k1-secret"}


def _signed(body: bytes, ts: int, digest: bool, key: bytes = b"k1-secret") -> dict[str, str]:
    stamp = str(ts)
    headers = {fa.KEY_ID_HEADER: "k1", fa.TIMESTAMP_HEADER: stamp}
    if digest:
        headers[fa.DIGEST_HEADER] = fa.body_digest(body)
        headers[fa.SIGNATURE_HEADER] = fa.sign_digest(key, stamp, TARGET, "", body)
    else:
        headers[fa.SIGNATURE_HEADER] = fa.sign(key, stamp, TARGET, "", body)
    return headers


def test_what_the_headers_prove_before_the_body() -> None:
    now, body = int(time.time()), b'{"a": 1}'

    def who(headers: dict[str, str]) -> Any:
        return fa.identify(headers, TARGET, [b"tok"], KEYS, now, 300)

    bearer = who({"Authorization": "Bearer tok"})
    assert bearer == fa.Caller(principal_of_token(b"tok"), proven=True, digest=False)
    assert who(_signed(body, now, digest=True)) == fa.Caller("key:k1", proven=True, digest=True)
    legacy = who(_signed(body, now, digest=False))
    assert legacy == fa.Caller("key:k1", proven=False, digest=False)
    forged = {fa.KEY_ID_HEADER: "k1", fa.SIGNATURE_HEADER: "sha256=" + "0" * 64}
    assert who(forged) == "missing credentials"  # no timestamp: refused before the body
    assert who({**forged, fa.TIMESTAMP_HEADER: str(now - 3600)}) == (
        "timestamp outside the allowed skew"
    )
    bogus = {**_signed(body, now, digest=True), fa.SIGNATURE_HEADER: "sha256=" + "0" * 64}
    assert who(bogus) == "bad signature"
    assert who({**_signed(body, now, digest=True), fa.DIGEST_HEADER: "XY"}) == "bad content digest"
    wrong_key = _signed(body, now, digest=True, key=b"other")
    assert who(wrong_key) == "bad signature"

    def after(caller: Any, headers: dict[str, str], data: bytes) -> str | None:
        return fa.check_body(caller, headers, TARGET, data, KEYS, now, 300)

    digest_headers = _signed(body, now, digest=True)
    assert after(who(digest_headers), digest_headers, body) is None
    assert after(who(digest_headers), digest_headers, body + b" ") == (
        "body does not match its signed digest"
    )
    legacy_headers = _signed(body, now, digest=False)
    assert after(legacy, legacy_headers, body) is None
    assert after(legacy, legacy_headers, body + b" ") == "bad signature"
    assert after(bearer, {}, b"anything") is None


def test_token_buckets_refill_at_their_rate_per_client() -> None:
    now = [0.0]
    rates = RateLimiter(rate_per_s=2.0, burst=3, max_clients=2, clock=lambda: now[0])
    assert [rates.take("a") for _ in range(4)] == [None, None, None, 1]
    assert rates.take("b") is None  # its own bucket
    now[0] = 0.5  # one token back for a
    assert rates.take("a") is None and rates.take("a") == 1
    rates.take("c")  # a third client: the least recently used bucket goes
    assert len(rates) == 2
    slow = RateLimiter(rate_per_s=0.1, burst=1, clock=lambda: 0.0)
    assert slow.take("x") is None and slow.take("x") == 10  # seconds until the next token


def test_the_parse_queue_is_bounded() -> None:
    slots = ParseSlots(2)
    assert slots.reserve() and slots.reserve() and not slots.reserve()
    slots.release()
    assert slots.reserve()


def test_a_full_parse_queue_answers_503_before_reading_the_body() -> None:
    cfg = fm.FeedbackServiceConfig(run="r1", tokens=["tok"], max_parse_queue=1, retry_after_s=4)
    large = json.dumps(event(feedback_id="fb-l", prompt="x" * (INLINE_PARSE_BYTES + 1))).encode()
    parsing, release = threading.Event(), threading.Event()

    async def main() -> list[Any]:
        service = FeedbackService(cfg, MemorySink(), environ={fm.SALT_ENV: "s"})
        decode = service._decode

        def slow_decode(body: bytes, key: str | None) -> Any:
            parsing.set()
            release.wait(10)
            return decode(body, key)

        service._decode = slow_decode  # type: ignore[method-assign]
        headers = {"Authorization": "Bearer tok", "Content-Type": "application/json"}
        async with TestClient(TestServer(service.application())) as c:
            first = asyncio.ensure_future(c.post("/v1/feedback", data=large, headers=headers))
            while not parsing.is_set():
                await asyncio.sleep(0.01)
            second = await c.post("/v1/feedback", data=large, headers=headers)
            answer = (second.status, second.headers.get("Retry-After"), await second.json())
            release.set()
            done = await first
            return [answer, done.status, service.parse_slots.used]

    (status, retry, body), first, used = asyncio.run(main())
    assert status == 503 and retry == "4" and body["error"] == "busy"
    assert first == 202 and used == 0


def test_dedupe_keys_keep_clients_apart() -> None:
    a, b = principal_of_key("a"), principal_of_token(b"secret-token")
    assert dedupe_key(a, "x") != dedupe_key(b, "x") and dedupe_key("", "x") == "x"
    assert "secret-token" not in b
    assert key_of_headers(record_headers(a, "x")) == dedupe_key(a, "x")
    assert key_of_headers([("feedback_id", b"x")]) == "x"  # no client header: the old namespace
    assert key_of_headers([]) is None
