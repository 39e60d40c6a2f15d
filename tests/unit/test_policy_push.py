"""``serve policy --weights push`` over real HTTP (aiohttp's test server), without a broker: the
update endpoint is privileged (``rollout.push_auth``).

Properties: a push without the bearer token, or with another token, is refused 401 and nothing
is loaded; a ``model_path`` outside the push directory (a symlink out of it included) is refused
403 before it is opened; a body without ``state_hash`` 422; an older version, or one more than
``max_version_jump`` ahead, 409; each refusal says why and the served version stays; a good push
is served, and the token appears in no answer and no log line. The ``openai`` engine sends the
token it was given (file or environment), and only in the header.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from rlstream.producers.client.settings import KafkaSettings
from rlstream.rollout import push_auth
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.engines import OpenAIEngine
from rlstream.rollout.hf_policy import save_state_hf
from rlstream.rollout.model import build_policy
from rlstream.rollout.push_auth import PushConfig, PushRefused
from rlstream.rollout.serve import PolicyServer, make_app
from rlstream.schemas.deltacodec.bits import from_torch, state_hash
from rlstream.schemas.errors import SetupError

POLICY = PolicyConfig(vocab_size=128, d_model=32, n_heads=2, d_expert=32, max_seq_len=64)
TOKEN = "push-token-0123456789abcdef"
NOWHERE = KafkaSettings(bootstrap_servers="127.0.0.1:1")  # pushing needs no broker


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _version_dir(root: Path, seed: int) -> tuple[Path, str]:
    """An HF directory of a policy under ``root`` and the hash of its state."""
    state = {
        k: v.detach().bfloat16()
        for k, v in build_policy(POLICY.model_copy(update={"seed": seed})).state_dict().items()
    }
    path = root / f"v{seed}"
    save_state_hf(POLICY, state, path)
    return path, state_hash(from_torch(state))


def _serve(
    root: Path, calls: Any, signed: dict[int, str], max_jump: int = 5
) -> tuple[Any, PolicyServer, list[str]]:
    """A push-mode server whose run signed ``signed`` (version -> state hash)."""
    lines: list[str] = []
    push = PushConfig(token=TOKEN, weights_dir=root, max_version_jump=max_jump)
    server = PolicyServer(
        NOWHERE,
        "r1",
        "policy",
        POLICY,
        weights="push",
        push=push,
        record_timeout_s=0.1,
        log=lines.append,
        signed_hash=signed.get,
    )

    async def main() -> Any:
        async with TestClient(TestServer(make_app(server))) as client:
            return await calls(client)

    try:
        return asyncio.run(main()), server, lines
    finally:
        server.close()


async def _push(c: TestClient, body: dict[str, Any], token: str | None = TOKEN) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    r = await c.post("/update_weights_from_disk", json=body, headers=headers)
    return r.status, await r.json(), r.headers.get("WWW-Authenticate")


def test_a_push_needs_the_token_and_is_confined_complete_and_bounded(tmp_path: Path) -> None:
    root = tmp_path / "pushed"
    v1, h1 = _version_dir(root, 1)
    v2, h2 = _version_dir(root, 2)
    outside, h_out = _version_dir(tmp_path / "elsewhere", 3)
    (root / "link").symlink_to(outside)

    async def calls(c: TestClient) -> list[Any]:
        good = {"model_path": str(v1), "weight_version": "1", "state_hash": h1}
        return [
            await _push(c, good, token=None),
            await _push(c, good, token="not-the-push-token-at-all"),
            await _push(c, {**good, "model_path": str(outside), "state_hash": h_out}),
            await _push(c, {**good, "model_path": str(root / "link"), "state_hash": h_out}),
            await _push(c, {"model_path": str(v1), "weight_version": "1"}),
            await _push(c, {**good, "state_hash": h2}),
            await _push(c, good),
            await _push(c, {"model_path": str(v2), "weight_version": "0", "state_hash": h2}),
            await _push(c, {"model_path": str(v2), "weight_version": "7", "state_hash": h2}),
            await _push(c, {"model_path": str(v2), "weight_version": "6", "state_hash": h2}),
            await (await c.get("/healthz")).json(),
        ]

    (*answers, health), server, lines = _serve(root, calls, {1: h1, 6: h2})
    statuses = [a[0] for a in answers]
    assert statuses == [401, 401, 403, 403, 422, 422, 200, 409, 409, 200], answers
    assert answers[0][2] and answers[1][2], "a 401 names its scheme (WWW-Authenticate)"
    why = [a[1]["message"] for a in answers]
    assert "Authorization" in why[0] and "push directory" in why[2] and "push directory" in why[3]
    assert "state_hash" in why[4] and "hash" in why[5]
    assert "older" in why[7] and "jumps more than 5" in why[8]
    assert all(a[1]["success"] is False for a in answers if a[0] != 200)
    assert health["policy_version"] == 6 and server.version == 6
    served = {k: v.bfloat16() for k, v in server.model.state_dict().items()}
    assert state_hash(from_torch(served)) == h2
    assert lines == ["serving pushed version 1 of 'policy'", "serving pushed version 6 of 'policy'"]
    assert all(TOKEN not in str(a) for a in answers) and all(TOKEN not in line for line in lines)


def test_push_mode_does_not_start_without_a_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="push token"):
        PolicyServer(NOWHERE, "r1", "policy", POLICY, weights="push", record_timeout_s=0.1)
    with pytest.raises(ValueError):
        PushConfig(token="short", weights_dir=tmp_path)


def test_the_token_comes_from_a_private_file_or_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    file.chmod(0o644)
    with pytest.raises(SetupError, match="chmod 600"):
        push_auth.load_token(file, {})
    file.chmod(0o600)
    assert push_auth.load_token(file, {}).get_secret_value() == TOKEN  # type: ignore[union-attr]
    env = {push_auth.TOKEN_FILE_ENV: str(file)}
    assert push_auth.load_token(None, env).get_secret_value() == TOKEN  # type: ignore[union-attr]
    assert push_auth.load_token(None, {push_auth.TOKEN_ENV: TOKEN}) is not None
    assert push_auth.load_token(None, {}) is None
    with pytest.raises(SetupError, match="shorter"):
        push_auth.load_token(None, {push_auth.TOKEN_ENV: "short"})


def test_version_rule() -> None:
    push_auth.check_version(10**11, -1, 5)  # the first push sets the base
    push_auth.check_version(3, 3, 5)  # the same version again: a retried push
    push_auth.check_version(8, 3, 5)
    for version in (2, 9):
        with pytest.raises(PushRefused) as refused:
            push_auth.check_version(version, 3, 5)
        assert refused.value.status == 409


def test_the_engine_sends_its_token_in_the_header_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[str, dict[str, str], bytes]] = []

    class Answer:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def __enter__(self) -> Answer:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read(self) -> bytes:
            return self.body

    def urlopen(req: Any, timeout: float) -> Answer:
        seen.append((req.full_url, dict(req.header_items()), req.data))
        return Answer(b'{"success": true, "policy_version": 4}')

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    monkeypatch.setenv(push_auth.TOKEN_ENV, TOKEN)
    engine = OpenAIEngine(
        "http://127.0.0.1:1", "policy", POLICY, tmp_path, token=push_auth.load_token()
    )
    state = {k: v.detach().bfloat16() for k, v in build_policy(POLICY).state_dict().items()}
    engine.push(4, state, state_hash(from_torch(state)))
    [(url, headers, data)] = seen
    assert headers["Authorization"] == f"Bearer {TOKEN}" and TOKEN not in url
    assert TOKEN.encode() not in data and TOKEN not in repr(engine)
    assert engine.pushed == 4 and os.path.isdir(tmp_path / "v4")


def test_completions_need_a_token_and_keep_to_its_rate(tmp_path: Path) -> None:
    """Every completion becomes a served record that feedback trains on: without the API token
    (or with another) it is refused 401 before the body is read; over a token's rate, 429 with
    Retry-After; with the token it goes on (here to 503: nothing pushed is served yet)."""
    api = "api-token-0123456789abcdef"
    gate = push_auth.CompletionsGate([SecretStr(api)], rate_per_s=0.01, burst=2)
    server = PolicyServer(NOWHERE, "r1", "policy", POLICY, weights="push", gate=gate,
                          push=PushConfig(token=TOKEN, weights_dir=tmp_path), record_timeout_s=0.1)  # fmt: skip
    body = {"model": "policy", "prompt": "x", "max_tokens": 1}

    async def calls(c: TestClient) -> list[tuple[int, str | None]]:
        out = []
        for token in (None, "not-the-api-token-at-all", api, api, api):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            r = await c.post("/v1/completions", json=body, headers=headers)
            out.append((r.status, r.headers.get("Retry-After")))
        return out

    async def main() -> Any:
        async with TestClient(TestServer(make_app(server))) as client:
            return await calls(client)

    try:
        answers = asyncio.run(main())
    finally:
        server.close()
    assert [a[0] for a in answers] == [401, 401, 503, 503, 429], answers
    assert answers[-1][1] is not None and int(answers[-1][1]) >= 1


def test_a_push_is_served_only_as_the_learner_signed_it(tmp_path: Path) -> None:
    """The pushed state_hash is the pusher's claim: a state that hashes to it but is not the one
    the run's signed manifest names for that version is refused 422, and a version with no
    signed manifest known 409; the served version stays."""
    root = tmp_path / "pushed"
    v1, h1 = _version_dir(root, 1)
    v2, h2 = _version_dir(root, 2)

    async def calls(c: TestClient) -> list[Any]:
        return [
            await _push(c, {"model_path": str(v1), "weight_version": "1", "state_hash": h1}),
            await _push(c, {"model_path": str(v2), "weight_version": "2", "state_hash": h2}),
            await _push(c, {"model_path": str(v2), "weight_version": "3", "state_hash": h2}),
        ]

    answers, server, _ = _serve(root, calls, {1: h1, 2: "a-hash-the-learner-signed"})
    assert [a[0] for a in answers] == [200, 422, 409], answers
    assert "signed for version 2" in answers[1][1]["message"]
    assert "no signed manifest of version 3" in answers[2][1]["message"]
    assert server.version == 1
