"""``rlstream serve policy``: the current policy behind an OpenAI-compatible completions API.

What an editor backend calls in production, and what the LLM-as-judge rubric is tested
against. ``POST /v1/completions`` takes ``model``, ``prompt`` (a string), ``max_tokens``,
``temperature``, ``n`` and ``seed``, and answers in the OpenAI ``text_completion`` shape plus
``policy_version`` and ``request_id`` (what an editor sends back with its feedback).

Weights follow the run's weight stream through a subscriber in a background thread; a new
version is swapped in between requests (under the generation lock), so a completion is always
produced by exactly one complete, verified version. Bad requests get a 4xx naming the field.

Released versions only (``released_only``): the server follows the run's eval events
(``consumers.eval_log.ReleaseFollower``) and serves the newest version the eval role released
(``rollout.evaluator``: the recipe's release rule held on the held-out set), never a newer
unreleased one: the subscriber's ceiling is the newest released version, and a version is
swapped in only if it was released. Before the first release it answers 503. Every answer,
``/v1/models`` and ``/healthz`` say what is served (``policy_version``, ``following``:
``newest`` or ``released``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlstream.consumers.eval_log import ReleaseFollower
from rlstream.consumers.weights import WeightSubscriber
from rlstream.envs import tasks as task_family
from rlstream.producers.settings import KafkaSettings
from rlstream.rollout.model import PolicyConfig, build_policy, generate
from rlstream.schemas.deltacodec import to_torch


class CompletionRequest(BaseModel):
    """The subset of the OpenAI completions request the policy honours."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., min_length=1, max_length=128)
    prompt: str = Field(..., max_length=16_384)
    max_tokens: int = Field(32, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=0)


class PolicyServer:
    """Holds the model, swaps versions from the subscriber, serves completions."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        model: str,
        policy: PolicyConfig,
        *,
        released_only: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.run, self.model_name = run, model
        self.model = build_policy(policy).eval()
        self.version = -1
        self.lock = asyncio.Lock()
        self.releases = ReleaseFollower(settings, run, model) if released_only else None
        self.following = "released" if released_only else "newest"
        self.subscriber = WeightSubscriber(settings, run, model)
        self._raise_ceiling()
        self.subscriber.start(interval=0.5)
        self.swap_ms: list[float] = []
        self.log = log

    def _raise_ceiling(self) -> None:
        if self.releases is not None:
            newest = self.releases.newest
            self.subscriber.ceiling = -1 if newest is None else newest

    def _swap(self) -> None:
        self._raise_ceiling()
        snap = self.subscriber.current()
        if snap is None or snap.version <= self.version:
            return
        if self.releases is not None and not self.releases.released(snap.version):
            return
        started = time.perf_counter()
        with torch.no_grad():
            self.model.load_state_dict(to_torch(snap.state))
        self.version = snap.version
        self.swap_ms.append((time.perf_counter() - started) * 1000)
        if self.log is not None:
            rec = self.releases.record(snap.version) if self.releases is not None else None
            why = f" (released: {rec['release_rule']})" if rec is not None else ""
            self.log(f"serving version {snap.version} of {self.model_name!r}{why}")

    def complete(self, req: CompletionRequest) -> dict[str, Any]:
        self._swap()
        if self.version < 0:
            what = "released by the eval role" if self.releases is not None else "published"
            raise LookupError(f"no policy version has been {what} for this run yet")
        ids = [task_family.BOS, *task_family.encode(req.prompt)]
        room = self.model.cfg.max_seq_len - 1
        prompt = torch.tensor([ids[-room:]] * req.n)
        gen = torch.Generator().manual_seed(
            req.seed if req.seed is not None else time.time_ns() % 2**31
        )
        out = generate(
            self.model,
            prompt,
            req.max_tokens,
            max(req.temperature, 1e-3),
            gen,
            stop_ids=(task_family.EOS,),
        )
        choices = []
        for i in range(req.n):
            n = int(out.lengths[i])
            tokens = out.tokens[i, :n].tolist()
            stopped = bool(out.stopped[i])
            text = task_family.decode([t for t in tokens if t != task_family.EOS])
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "stop" if stopped else "length",
                }
            )
        completion_tokens = int(out.lengths.sum())
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(ids) * req.n + completion_tokens,
            },
            "policy_version": self.version,
            "following": self.following,
            "request_id": f"req-{uuid.uuid4().hex}",
            "run": self.run,
        }

    def close(self) -> None:
        self.subscriber.close()
        if self.releases is not None:
            self.releases.close()


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": field}}
    return web.json_response(body, status=status)


def make_app(server: PolicyServer) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        try:
            payload = await request.json()
        except ValueError:
            return _error(400, "body is not valid JSON")
        try:
            req = CompletionRequest.model_validate(payload)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            return _error(422, f"{field}: {first['msg']}", field)
        if req.model != server.model_name:
            return _error(
                404,
                f"model {req.model!r} is not served here (serving {server.model_name!r})",
                "model",
            )
        async with server.lock:
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    None, server.complete, req
                )
            except LookupError as exc:
                return web.json_response(
                    {"error": {"message": str(exc)}}, status=503, headers={"Retry-After": "2"}
                )
        return web.json_response(result)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "policy_version": server.version,
                        "following": server.following,
                    }
                ],
            }
        )

    async def healthz(request: web.Request) -> web.Response:
        server._swap()
        body = {"ok": True, "policy_version": server.version, "following": server.following}
        return web.json_response(body)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    return app
