"""``rlstream serve policy``: the current policy behind an OpenAI-compatible completions API.

What an editor backend calls in production: ``POST /v1/completions`` in the OpenAI shape plus
``policy_version`` and ``request_id``, with logprobs from the rollout sampler (there is no second
sampler).

Rules a maintainer must keep:
- every completion is recorded in the run's ``served`` stream before it is answered (else 503):
  nothing is served that feedback could not be trained on;
- a new version is swapped in only under the generation lock, so a completion comes from exactly
  one complete, verified version;
- pushed weights (``--weights push``) need the token, a path inside the push directory, and a
  ``state_hash`` the learner signed for that version; every refusal says why;
- with ``released_only`` only versions the eval role released are served.

Details: docs/roles.md (The policy server).
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from aiohttp import web
from confluent_kafka import KafkaException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlstream.consumers.eval_log import ReleaseFollower
from rlstream.consumers.weights.manifest_log import ManifestLog
from rlstream.consumers.weights.subscriber import WeightSubscriber
from rlstream.producers.client.producer import DeliveryError, EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import Generation, build_policy, generate
from rlstream.rollout.push_auth import (
    CompletionsGate,
    PushConfig,
    PushRefused,
    UpdateWeightsRequest,
    update_request,
)
from rlstream.schemas import arrays, topics
from rlstream.schemas.deltacodec import to_torch
from rlstream.schemas.errors import RlstreamError

MIN_TEMPERATURE = 1e-3
"""A requested temperature of 0 samples at this temperature (and is recorded so)."""
MAX_LOGPROBS = 20
LOGPROB_FLOOR = -1e30


class CompletionRequest(BaseModel):
    """The subset of the OpenAI completions request the policy honours."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., min_length=1, max_length=128)
    prompt: str | list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(..., max_length=16_384)
    max_tokens: int = Field(32, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each token's logprob and this many most likely alternatives.",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        default_factory=list, max_length=64, description="Token ids that stop a choice too."
    )
    return_tokens_as_token_ids: bool = Field(
        False, description="Spell logprobs tokens as token_id:N (as vLLM's server does)."
    )
    return_routes: bool = Field(False, description="Answer each choice's routed experts.")
    task_class: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The request's kind (tab, agent, chat; non-standard): recorded, and the "
        "class its feedback's baseline is kept in (a feedback cannot name another).",
    )


class NotRecorded(RlstreamError, RuntimeError):
    """The completion could not be written to the served stream; it is not answered."""


@dataclass(frozen=True, slots=True)
class Served:
    """One choice as generated: the prompt fed and the generated tokens with their facts."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routes: np.ndarray
    """``[len(prompt_ids) + len(token_ids), n_layers, top_k]`` expert ids, uint8 or uint16 (the
    policy's width, ``schemas.arrays.expert_bytes_for``)."""
    stopped: bool
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def served_choice(
    out: Generation, row: int, prompt_ids: list[int], expert_bytes: int = 1
) -> Served:
    """Row ``row`` of a batch generated after ``prompt_ids``, cut at its length.

    Routes are kept as expert ids ``expert_bytes`` wide, the width of the policy that generated
    them; an id that does not fit is ``ArrayError``, never wrapped.
    """
    n = int(out.lengths[row])
    fed = len(prompt_ids) + n
    tops = None
    if out.top_ids is not None and out.top_logprobs is not None:
        tops = (out.top_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist())
    return Served(
        prompt_ids=list(prompt_ids),
        token_ids=out.tokens[row, :n].tolist(),
        logprobs=out.logprobs[row, :n].tolist(),
        routes=arrays.expert_ids(out.routes[row, :fed].numpy(), expert_bytes),
        stopped=bool(out.stopped[row]),
        top_ids=tops[0] if tops else None,
        top_logprobs=tops[1] if tops else None,
    )


def _finite(x: float) -> float:
    """JSON has no infinities: a logprob below ``LOGPROB_FLOOR`` (-inf) is answered as the floor."""
    return x if math.isfinite(x) and x > LOGPROB_FLOOR else LOGPROB_FLOOR


def choice_logprobs(choice: Served, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """The OpenAI completions ``logprobs`` object of one choice (see the module rules).

    Rule: ``top_logprobs[i]`` maps the sampled token's text to its logprob first, then each
    alternative's text (most likely first; a text already listed keeps its first value).
    """
    texts = [decode([t]) for t in choice.token_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops: list[dict[str, float]] = []
    for i, (text, lp) in enumerate(zip(texts, choice.logprobs, strict=True)):
        listed = {text: _finite(lp)}
        if choice.top_ids is not None and choice.top_logprobs is not None:
            for tid, alt in zip(choice.top_ids[i], choice.top_logprobs[i], strict=True):
                listed.setdefault(decode([tid]), _finite(alt))
        tops.append(listed)
    return {
        "tokens": texts,
        "token_logprobs": [_finite(lp) for lp in choice.logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@dataclass(frozen=True, slots=True)
class ServedContext:
    """What every choice of one served request shares in its record."""

    run: str
    request_id: str
    model: str
    policy_version: int
    worker_id: str
    region: str
    temperature: float
    settings: dict[str, str]
    """Sampling settings and serving facts for ``outcome.details`` (strings)."""
    received_ms: int
    started_ms: int
    finished_ms: int
    swap_ms: int


def served_record(
    ctx: ServedContext, index: int, n: int, choice: Served, text: str
) -> dict[str, Any]:
    """The Trajectory record of choice ``index`` of ``n`` (see the module rule "Recorded")."""
    p, generated = len(choice.prompt_ids), len(choice.token_ids)
    mask = [0] * p + [1] * generated
    generate_ms = ctx.finished_ms - ctx.started_ms
    return {
        "run": ctx.run,
        "group_id": ctx.request_id,
        "task_id": ctx.request_id,
        "sample_index": index,
        "group_size": n,
        "policy_version": ctx.policy_version,
        "model": ctx.model,
        "worker_id": ctx.worker_id,
        "region": ctx.region,
        "engine": "serve",
        "temperature": ctx.temperature,
        "top_p": 1.0,
        **arrays.pack_tokens(
            [*choice.prompt_ids, *choice.token_ids],
            [0.0] * p + choice.logprobs,
            mask,
            choice.routes,
            choice.routes.dtype.itemsize,
        ),
        "prompt_tokens": p,
        "completion": text,
        "turns": [
            {
                "index": 0,
                "token_start": p,
                "token_end": p + generated,
                "generated_tokens": generated,
                "generate_ms": generate_ms,
            }
        ],
        "outcome": {
            "status": "completed" if choice.stopped else "max_tokens",
            "tool_calls": 0,
            "summarised": False,
            "details": {**ctx.settings, "source": "serve", "choice": str(index)},
        },
        "timings": {
            "queued_ms": ctx.received_ms,
            "started_ms": ctx.started_ms,
            "finished_ms": ctx.finished_ms,
            "generate_ms": generate_ms,
            "env_ms": 0,
            "weights_wait_ms": ctx.swap_ms,
        },
    }


def sampling_settings(req: CompletionRequest, seed: int, prompt_truncated: bool) -> dict[str, str]:
    """The request's sampling settings as recorded (``outcome.details``; strings)."""
    return {
        "seed": str(seed),
        "max_tokens": str(req.max_tokens),
        "n": str(req.n),
        "requested_temperature": repr(req.temperature),
        "logprobs": "" if req.logprobs is None else str(req.logprobs),
        "prompt_truncated": "true" if prompt_truncated else "false",
        "task_class": req.task_class or "",
    }


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
        region: str = "trainer",
        record_timeout_s: float = 10.0,
        weights: str = "kafka",
        push: PushConfig | None = None,
        gate: CompletionsGate | None = None,
        signed_hash: Callable[[int], str | None] | None = None,
    ) -> None:
        if weights == "push" and push is None:
            raise ValueError("a server that takes pushed weights needs a push token and folder")
        self.run, self.model_name, self.region = run, model, region
        self.worker_id = f"serve-{socket.gethostname()}-{os.getpid()}"
        self.served_topic = topics.topic_name(run, "served")
        # A record not acknowledged in time fails (and is not retried later), so one stuck
        # record never holds up the answers after it.
        timeout_ms = str(int(record_timeout_s * 1000))
        self.recorder = EventProducer.connect(settings, **{"message.timeout.ms": timeout_ms})
        self.record_timeout_s = record_timeout_s
        self.model = build_policy(policy).eval()
        self.version = -1
        self.lock = asyncio.Lock()
        self.releases = ReleaseFollower(settings, run, model) if released_only else None
        self.following = "released" if released_only else "newest"
        self.subscriber: WeightSubscriber | None = None
        self.push_config = push if weights == "push" else None
        self.gate = gate  # None: completions are open (a library caller's own choice)
        # push mode: the state hash the learner signed for a version (the run's manifests)
        self.signed_hash = signed_hash
        if weights == "push" and signed_hash is None:
            self.signed_hash = SignedHashes(settings, run, model)
        if weights == "push":
            self.following = "pushed"
        else:
            self.subscriber = WeightSubscriber(settings, run, model)
            self._raise_ceiling()
            self.subscriber.start(interval=0.5)
        self.swap_ms: list[float] = []
        self.log = log

    def _raise_ceiling(self) -> None:
        if self.releases is not None and self.subscriber is not None:
            newest = self.releases.newest
            self.subscriber.ceiling = -1 if newest is None else newest

    def _swap(self) -> None:
        if self.subscriber is None:
            return
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

    def swap_push(self, version: int, state: dict[str, torch.Tensor]) -> int:
        """Serve ``state`` as ``version`` (call under the generation lock); the version is
        checked again, since another push may have been swapped in meanwhile."""
        assert self.push_config is not None
        started = time.perf_counter()
        self.push_config.check_version(version, self.version)
        with torch.no_grad():
            self.model.load_state_dict(state)
        self.version = version
        self.swap_ms.append((time.perf_counter() - started) * 1000)
        if self.log is not None:
            self.log(f"serving pushed version {version} of {self.model_name!r}")
        return version

    def push(self, req: UpdateWeightsRequest) -> int:
        """Load, check and swap one push, for a caller that holds the model."""
        assert self.push_config is not None
        made = self.push_config.load(req, self.version)
        self.check_signed(made[0], req.state_hash)
        return self.swap_push(*made)

    def check_signed(self, version: int, state_hash: str) -> None:
        """A pushed version is served only as the learner signed it: ``PushRefused`` (409) when
        no verified manifest of ``version`` is known here, (422) when its state hash is not
        ``state_hash`` (which the loaded state already matched)."""
        assert self.signed_hash is not None
        signed = self.signed_hash(version)
        if signed is None:
            raise PushRefused(409, f"no signed manifest of version {version} is known here")
        if signed != state_hash:
            raise PushRefused(
                422, f"state hash {state_hash} is not the one signed for version {version}"
            )

    def complete(self, req: CompletionRequest) -> dict[str, Any]:
        """Generate, record (see the module rule "Recorded"), then answer."""
        return self.record_and_answer(req, *self.sample(req))

    def record_and_answer(
        self, req: CompletionRequest, ctx: ServedContext, choices: Sequence[Served]
    ) -> dict[str, Any]:
        """Record what ``sample`` made, then the answer (needs no model: outside the lock)."""
        texts = [self.model.text.decode(c.token_ids) for c in choices]
        self._record(ctx, choices, texts)
        return self._answer(req, ctx, choices, texts)

    def sample(self, req: CompletionRequest) -> tuple[ServedContext, list[Served]]:
        """Swap in a newer version if any, then sample the request's choices (under the
        generation lock: the model is used)."""
        received_ms = int(time.time() * 1000)
        swaps = len(self.swap_ms)
        self._swap()
        if self.version < 0:
            what = "released by the eval role" if self.releases is not None else "published"
            raise LookupError(f"no policy version has been {what} for this run yet")
        if isinstance(req.prompt, str):
            ids = self.model.text.prompt(req.prompt)
        else:
            ids = list(req.prompt)
            if any(t >= self.model.cfg.vocab_size for t in ids):
                raise ValueError(f"prompt: a token id is not below {self.model.cfg.vocab_size}")
        fed = ids[-(self.model.cfg.max_seq_len - 1) :]
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        temperature = max(req.temperature, MIN_TEMPERATURE)
        started_ms = int(time.time() * 1000)
        out = generate(
            self.model,
            torch.tensor([fed] * req.n),
            req.max_tokens,
            temperature,
            torch.Generator().manual_seed(seed),
            stop_ids=(*self.model.text.eos_ids, *req.stop_token_ids),
            top_n=req.logprobs or 0,
        )
        width = arrays.expert_bytes_for(self.model.cfg.n_experts)
        choices = [served_choice(out, i, fed, width) for i in range(req.n)]
        ctx = ServedContext(
            run=self.run,
            request_id=f"req-{uuid.uuid4().hex}",
            model=self.model_name,
            policy_version=self.version,
            worker_id=self.worker_id,
            region=self.region,
            temperature=temperature,
            settings=sampling_settings(req, seed, len(fed) < len(ids)),
            received_ms=received_ms,
            started_ms=started_ms,
            finished_ms=int(time.time() * 1000),
            swap_ms=int(sum(self.swap_ms[swaps:])),
        )
        return ctx, choices

    def _record(self, ctx: ServedContext, choices: Sequence[Served], texts: Sequence[str]) -> None:
        """Write one record per choice (split if large) and wait until the broker has them."""
        limit = topics.STREAMS["served"].max_value_bytes
        try:
            for i, (choice, text) in enumerate(zip(choices, texts, strict=True)):
                record = served_record(ctx, i, len(choices), choice, text)
                for part in arrays.split_segments(record, limit):
                    self.recorder.produce(self.served_topic, "trajectory", part, ctx.request_id)
            self.recorder.flush(self.record_timeout_s + 5)
        except (DeliveryError, KafkaException, BufferError) as exc:
            raise NotRecorded(f"the completion could not be recorded: {exc}") from exc

    def _answer(
        self,
        req: CompletionRequest,
        ctx: ServedContext,
        choices: Sequence[Served],
        texts: Sequence[str],
    ) -> dict[str, Any]:
        """The OpenAI ``text_completion`` body, plus what rlstream adds (see the module)."""
        body = []
        for i, (choice, text) in enumerate(zip(choices, texts, strict=True)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = choice_logprobs(choice, self.model.text.decode)
                if req.return_tokens_as_token_ids:
                    logprobs["tokens"] = [f"token_id:{t}" for t in choice.token_ids]
            answer = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": "stop" if choice.stopped else "length",
            }
            if req.return_routes:
                answer["routes"] = choice.routes.tolist()
            body.append(answer)
        prompt_tokens = len(choices[0].prompt_ids)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {
            "id": f"cmpl-{ctx.request_id.removeprefix('req-')}",
            "object": "text_completion",
            "created": ctx.finished_ms // 1000,
            "model": self.model_name,
            "choices": body,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens * req.n + completion_tokens,
            },
            "policy_version": ctx.policy_version,
            "following": self.following,
            "request_id": ctx.request_id,
            "run": self.run,
        }

    def close(self) -> None:
        try:
            if isinstance(self.signed_hash, SignedHashes):
                self.signed_hash.close()
            if self.subscriber is not None:
                self.subscriber.close()
            if self.releases is not None:
                self.releases.close()
        finally:
            self.recorder.wait(self.record_timeout_s)


class SignedHashes:
    """The state hash of each version of a run's model as its verified, signed manifests say
    (``ManifestLog``: the run's trust applies), read on demand, waiting up to ``wait_s`` for a
    version not read yet. Thread-safe: pushes are checked off the event loop."""

    def __init__(self, settings: KafkaSettings, run: str, model: str, wait_s: float = 15.0):
        self.settings, self.run, self.model, self.wait_s = settings, run, model, wait_s
        self._log: ManifestLog | None = None
        self._lock = threading.Lock()

    def __call__(self, version: int) -> str | None:
        with self._lock:
            if self._log is None:
                self._log = ManifestLog.of_run(self.settings, self.run, self.model)
            deadline = time.monotonic() + self.wait_s
            while True:
                found = [rec["state_hash"] for (v, _), rec in self._log.items() if v == version]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found[0] if found else None
                self._log.wait(min(left, 1.0))

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": field}}
    return web.json_response(body, status=status)


#: Upper bounds (seconds) of the served-request latency histogram.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class ServingLoad:
    """What the server is doing, at ``GET /metrics`` in vLLM's terms (a capacity role reads it,
    ``rollout.capacity``): requests generating now, waiting for the model, and the latency of
    each answered completion, in a registry of the app's own."""

    def __init__(self) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        self.running = prom.Gauge(
            "rlstream_serve_requests_running", "Completions generating now.", registry=self.registry
        )
        self.waiting = prom.Gauge(
            "rlstream_serve_requests_waiting",
            "Completions waiting for the model.",
            registry=self.registry,
        )
        self.latency = prom.Histogram(
            "rlstream_serve_request_seconds",
            "Seconds from a completion's arrival to its answer.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        import prometheus_client as prom

        return bytes(prom.generate_latest(self.registry))


def make_app(server: PolicyServer) -> web.Application:
    load = ServingLoad()

    async def completions(request: web.Request) -> web.Response:
        arrived = time.perf_counter()
        try:
            return await answer(request)
        finally:
            load.latency.observe(time.perf_counter() - arrived)

    async def generate_counted(req: CompletionRequest) -> Any:
        """``server.sample`` under the model lock, counted waiting, then running."""
        loop, waiting = asyncio.get_running_loop(), True
        load.waiting.inc()
        try:
            async with server.lock:  # the model: one generation at a time
                load.waiting.dec()
                waiting = False
                with load.running.track_inprogress():
                    return await loop.run_in_executor(None, server.sample, req)
        finally:
            if waiting:  # the request went away before its turn
                load.waiting.dec()

    async def answer(request: web.Request) -> web.Response:
        if server.gate is not None:
            try:
                server.gate.admit(request.headers.get("Authorization"))  # before the body
            except PushRefused as exc:
                response = _error(exc.status, exc.reason)
                if exc.retry_after_s is not None:
                    response.headers["Retry-After"] = str(exc.retry_after_s)
                if exc.status == 401:
                    response.headers["WWW-Authenticate"] = 'Bearer realm="rlstream-policy"'
                return response
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
        loop = asyncio.get_running_loop()
        try:
            made = await generate_counted(req)
            # recording waits on the broker, not on the model: other requests generate meanwhile
            result = await loop.run_in_executor(None, server.record_and_answer, req, *made)
        except (LookupError, NotRecorded) as exc:
            return web.json_response(
                {"error": {"message": str(exc)}}, status=503, headers={"Retry-After": "2"}
            )
        except ValueError as exc:  # e.g. a prompt token id outside the vocabulary
            return _error(422, str(exc), "prompt")
        return web.json_response(result)

    async def update_weights(request: web.Request) -> web.Response:
        gate = server.push_config
        if gate is None:
            return _error(
                409,
                "this server follows the weight stream (start it with --weights "
                "push to push weights)",
            )
        loop = asyncio.get_running_loop()
        try:
            gate.authorize(request.headers.get("Authorization"))  # before the body is read
            req = update_request(await request.read())
            made = await loop.run_in_executor(None, gate.load, req, server.version)
            await loop.run_in_executor(None, server.check_signed, made[0], req.state_hash)
            async with server.lock:  # never while a completion is generated
                version = await loop.run_in_executor(None, server.swap_push, *made)
        except PushRefused as exc:
            body = {"success": False, "message": exc.reason, "policy_version": server.version}
            auth = {"WWW-Authenticate": 'Bearer realm="rlstream-push"'}
            return web.json_response(
                body, status=exc.status, headers=auth if exc.status == 401 else None
            )
        body = {
            "success": True,
            "message": f"serving version {version}",
            "num_paused_requests": 0,
            "policy_version": version,
        }
        return web.json_response(body)

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
        if not server.lock.locked():  # a probe never waits behind a generation
            async with server.lock:
                await asyncio.get_running_loop().run_in_executor(None, server._swap)
        body = {"ok": True, "policy_version": server.version, "following": server.following}
        return web.json_response(body)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=load.exposition(), content_type="text/plain")

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/update_weights_from_disk", update_weights)
    return app
