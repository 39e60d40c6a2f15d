"""Inference engines: what the rollout harness generates through, chosen per worker by
``rollout.engine`` in the recipe.

An engine samples, for a batch of B rows after one context, up to ``max_new`` tokens per row and
gives back a :class:`rlstream.rollout.model.Generation`: the tokens, their behaviour logprobs
under the sampling temperature (float32), each row's length and whether it stopped, and the
experts that processed every token fed (prompt and generated) when it can report them. A
continuation (the turn after a tool call) names its ``Prior``: the generation it continues, the
row, and that row's tokens so far in the segment; the engine then feeds only the new context.

- ``torch`` (:class:`TorchEngine`): the reference, in-process ``rollout.model.generate`` with the
  KV cache of the earlier turns. Its behaviour and determinism are exactly the harness's before
  engines existed.
- ``openai`` (:class:`OpenAIEngine`): a remote OpenAI-compatible server the user already runs
  (vLLM's or SGLang's, or ``rlstream serve policy --weights push``). See the class for the
  request, how tokens, logprobs and routes are read back, and how weights are pushed.
- ``vllm`` (``rollout.vllm_engine.VllmEngine``): a vLLM server the worker starts and supervises,
  which takes each version in place.

Versions during generation: an engine given a :class:`VersionGate` asks it, before it runs the
model (a forward pass for ``torch``, a request for ``vllm``), to swap in the newest verified
version, and records per token which version processed it (``Generation.versions``): a rollout
then continues across versions (partial rollouts) instead of the new version waiting for it.
"""

from __future__ import annotations

import http.client
import json
import shutil
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import SecretStr

from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model import Generation, KVCache, PolicyModel, generate

GenerateFn = Callable[..., Generation]

UPDATE_PATH = "/update_weights_from_disk"
"""The weight-update endpoint (SGLang's native API, see :class:`OpenAIEngine`)."""
TOKEN_ID_PREFIX = "token_id:"
"""How a token is spelled with ``return_tokens_as_token_ids`` (vLLM's OpenAI server)."""


class EngineError(RuntimeError):
    """The engine could not generate or take a version (unreachable, refused, inconsistent)."""


class Unreachable(EngineError):
    """No answer at all from the server (refused connection, timeout)."""


class EngineRefused(EngineError):
    """The engine did not take a version and serves the one it had (the version is skipped)."""


@dataclass
class EngineStats:
    """What the worker reports of its engine (the demo's ``engine_*`` figures)."""

    engine: str = "torch"
    engine_version: str = ""
    swaps: int = 0
    restarts: int = 0
    refusals: int = 0
    aborts: int = 0
    swap_s: list[float] = field(default_factory=list)
    """Per swap, the pause generation saw (vLLM: paused to resumed; torch: the load)."""
    sync_s: list[float] = field(default_factory=list)
    """Per swap, the whole way in: the pause and what was prepared before it (vLLM: the
    changed tensors found and written to shared memory while generation went on)."""
    checks: int = 0
    """Canary checks of what the engine holds (``VllmConfig.check_every``)."""
    hash_checks: int = 0
    """Checks of the checkpoint hash the engine's backend reports holding."""
    check_failures: int = 0
    """Checks of either kind that failed (each repaired, or the worker gave up)."""
    repairs: int = 0
    """Engines that failed a check, were reloaded whole and passed it again."""
    check_gaps: list[float] = field(default_factory=list)
    """Per check, the largest |engine - worker model| canary logprob."""

    def figures(self) -> dict[str, Any]:
        return {
            "engine_checks": self.checks + self.hash_checks,
            "engine_check_failures": self.check_failures,
            "engine_repairs": self.repairs,
            "engine_check_gap_max": max(self.check_gaps) if self.check_gaps else None,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "engine_swaps": self.swaps,
            "engine_restarts": self.restarts,
            "engine_refusals": self.refusals,
            "engine_aborts": self.aborts,
            "swap_p50_s": statistics.median(self.swap_s) if self.swap_s else None,
            "swap_s": [round(s, 6) for s in self.swap_s[-1000:]],
            "sync_s": [round(s, 6) for s in self.sync_s[-1000:]],
        }


def percentile(values: list[float], q: int) -> float | None:
    """The ``q``-th percentile (1-99) of ``values``, None when there are none."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass(frozen=True)
class Prior:
    """What a continuation continues: row ``row`` of ``gen``, whose segment so far is
    ``history`` (the tokens already fed, in order)."""

    gen: Generation
    row: int
    history: list[int]


class VersionGate(Protocol):
    """The rollout worker's hand-over of verified versions to a generating engine."""

    def pending(self) -> int | None:
        """A newer verified version the engine could take (None: none); any thread may ask."""
        ...

    def take(self) -> int:
        """Swap the newest verified version in now (the generating thread only, between two
        model runs) and return the version that generates from here on."""
        ...


class Engine(Protocol):
    """Generates for the harness (see the module docstring)."""

    def generate(
        self,
        context: torch.Tensor,
        *,
        max_new: int,
        temperature: float,
        generator: torch.Generator,
        stop_ids: tuple[int, ...],
        prior: Prior | None,
    ) -> Generation: ...


class TorchEngine:
    """The reference engine: ``generate_fn`` (``rollout.model.generate``) on ``model`` in this
    process, continuing from the prior's KV cache. With a ``gate`` the weights may be swapped
    between two forward passes (the gate loads them into ``model`` in place) and generation goes
    on with the KV cache it has: the tokens already fed keep the keys and values the older
    version gave them. With ``stop`` (a reclaim of the worker's capacity) a generation may end
    between two sampling steps, its unfinished rows marked ``cut`` (``rollout.checkpoint``)."""

    def __init__(
        self,
        model: PolicyModel,
        generate_fn: GenerateFn = generate,
        gate: VersionGate | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.model, self.generate_fn, self.gate, self.stop = model, generate_fn, gate, stop

    def generate(
        self,
        context: torch.Tensor,
        *,
        max_new: int,
        temperature: float,
        generator: torch.Generator,
        stop_ids: tuple[int, ...],
        prior: Prior | None,
    ) -> Generation:
        cache = None if prior is None else prior.gen.cache.select(prior.row, len(prior.history))
        gated: dict[str, Any] = {} if self.gate is None else {"gate": self.gate.take}
        if self.stop is not None:
            gated["stop"] = self.stop
        return self.generate_fn(
            self.model,
            context,
            max_new=max_new,
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
            cache=cache,
            **gated,
        )


def post_json(
    url: str, body: Mapping[str, Any], timeout: float, token: SecretStr | None = None
) -> dict[str, Any]:
    """``POST url`` with a JSON body (and ``token`` as a bearer token); the JSON answer (an empty
    one is ``{}``). ``Unreachable`` when no answer came (refused, reset, timed out),
    ``EngineError`` for an HTTP error."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:  # the header only: never in a message, a log line or the URL
        headers["Authorization"] = f"Bearer {token.get_secret_value()}"
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read() or b"{}"))
    except urllib.error.HTTPError as err:
        raise EngineError(f"{url}: HTTP {err.code}: {err.read()[:500]!r}") from err
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise Unreachable(f"{url}: {err}") from err
    except ValueError as err:
        raise EngineError(f"{url}: the answer is not JSON: {err}") from err


def token_id(text: str) -> int:
    """The id of a token answered as ``token_id:N`` (``return_tokens_as_token_ids``)."""
    if not text.startswith(TOKEN_ID_PREFIX):
        raise EngineError(
            f"token {text!r} is not spelled {TOKEN_ID_PREFIX}N: the server does "
            "not honour return_tokens_as_token_ids"
        )
    return int(text.removeprefix(TOKEN_ID_PREFIX))


@dataclass
class OpenAIEngine:
    """A remote OpenAI-compatible completions server.

    One ``POST {url}/v1/completions`` per turn, with the prompt as token ids and the non-standard
    fields vLLM's server reads; the server keeps no state, so a continuation sends the row's whole
    segment. Routes are recorded when the server returns them, else none; every answer's
    ``policy_version`` is collected in ``served_versions``.

    Weights (``push``): the verified state is written as an HF directory and loaded through
    SGLang's ``POST /update_weights_from_disk``, with ``state_hash`` added; a version counts as
    pushed only when the server answered success. With a ``token`` every request carries it as a
    bearer token; a refused push raises ``EngineError`` with the server's reason.

    Details: docs/engines.md (The openai engine).
    """

    url: str
    model: str
    policy: PolicyConfig
    weights_dir: Path
    timeout_s: float = 120.0
    return_routes: bool = True
    served_versions: list[int] = field(default_factory=list)
    pushed: int = -1
    token: SecretStr | None = field(default=None, repr=False)
    tools: list[dict[str, Any]] | None = None  # the harness's tool schemas, when it offers them

    def generate(
        self,
        context: torch.Tensor,
        *,
        max_new: int,
        temperature: float,
        generator: torch.Generator,
        stop_ids: tuple[int, ...],
        prior: Prior | None,
    ) -> Generation:
        fed = context[0].tolist()
        prompt = [*prior.history, *fed] if prior is not None else fed
        body = {
            "model": self.model,
            "prompt": prompt,
            "n": int(context.shape[0]),
            "temperature": temperature,
            "max_tokens": max_new,
            "logprobs": 0,
            "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=generator)),
            "stop_token_ids": list(stop_ids),
            "return_tokens_as_token_ids": True,
            "return_routes": self.return_routes,
        }
        if self.tools:  # the OpenAI field; the templated prompt already lists them
            body["tools"] = self.tools
        answer = post_json(
            f"{self.url.rstrip('/')}/v1/completions", body, self.timeout_s, self.token
        )
        if "policy_version" in answer:
            self.served_versions.append(int(answer["policy_version"]))
        skip = len(prompt) - len(fed)  # routes of the history were recorded with it
        return generation_of(answer, len(fed), skip)

    def push(self, version: int, state: Mapping[str, torch.Tensor], state_hash: str) -> None:
        """Write ``state`` (version ``version``) for the server and have it load it; raises
        ``EngineError`` unless the server confirms (see the class docstring)."""
        from rlstream.rollout.hf_policy import save_state_hf  # transformers imports slowly

        path = self.weights_dir / f"v{version}"
        save_state_hf(self.policy, state, path)
        body = {
            "model_path": str(path),
            "weight_version": str(version),
            "state_hash": state_hash,
        }
        deadline = time.monotonic() + self.timeout_s
        while True:  # a server still starting (or restarting) is waited for, up to timeout_s
            try:
                url = f"{self.url.rstrip('/')}{UPDATE_PATH}"
                answer = post_json(url, body, self.timeout_s, self.token)
                break
            except Unreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        if not answer.get("success"):
            raise EngineError(f"the server refused version {version}: {answer.get('message')}")
        if int(answer.get("policy_version", version)) != version:
            raise EngineError(f"pushed version {version}, the server serves {answer}")
        self.pushed = version
        for old in sorted(self.weights_dir.glob("v*"), key=lambda p: int(p.name[1:]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)


@dataclass
class Choice:
    """One choice of a completions answer: its token ids and their logprobs, why it ended
    (``stop``, ``length``, or ``abort`` when it was cut short), its routes if any."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routes: np.ndarray | None = None


def choices_of(answer: Mapping[str, Any]) -> list[Choice]:
    """The choices of a completions answer in index order (see :class:`OpenAIEngine`)."""
    out = []
    for c in sorted(answer["choices"], key=lambda c: int(c["index"])):
        lp = c.get("logprobs") or {}
        if "tokens" not in lp or "token_logprobs" not in lp:
            raise EngineError("the answer has no token logprobs (the request asked logprobs=0)")
        routes = c.get("routes")
        out.append(
            Choice(
                [token_id(t) for t in lp["tokens"]],
                [float(x) for x in lp["token_logprobs"]],
                c.get("finish_reason"),
                None if routes is None else np.asarray(routes, dtype=np.int64),
            )
        )
    return out


def generation_of(answer: Mapping[str, Any], fed: int, skip: int = 0) -> Generation:
    """A ``Generation`` from a completions answer whose prompt ended with ``fed`` new tokens
    after ``skip`` earlier ones (see :class:`OpenAIEngine`); rows padded with 0."""
    return assemble(choices_of(answer), fed, skip)


def assemble(
    rows: list[Choice], fed: int, skip: int = 0, versions: list[list[int]] | None = None
) -> Generation:
    """A ``Generation`` of ``rows`` (each row's whole output) after ``fed`` new context tokens;
    a row stopped when it ended with ``stop``; routes kept only when every row has them (their
    first ``skip`` positions dropped); ``versions`` per row covers its fed and generated tokens.
    Rows are padded with 0."""
    b, n = len(rows), max((len(r.ids) for r in rows), default=0)
    tokens, logprobs = torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n)
    for i, row in enumerate(rows):
        tokens[i, : len(row.ids)] = torch.tensor(row.ids, dtype=torch.long)
        logprobs[i, : len(row.logprobs)] = torch.tensor(row.logprobs, dtype=torch.float32)
    routes = [r.routes[skip:] for r in rows if r.routes is not None]
    if len(routes) == b and b:
        width = fed + n
        padded = np.zeros((b, width, *routes[0].shape[1:]), dtype=np.int64)
        for i, r in enumerate(routes):
            padded[i, : min(width, len(r))] = r[:width]
        route_t = torch.from_numpy(padded)
    else:
        route_t = torch.zeros(b, fed + n, 0, 0, dtype=torch.long)
    version_t = None
    if versions is not None:
        version_t = torch.full((b, fed + n), -1, dtype=torch.long)
        for i, v in enumerate(versions):
            version_t[i, : len(v)] = torch.tensor(v, dtype=torch.long)
    return Generation(
        tokens=tokens,
        logprobs=logprobs,
        routes=route_t,
        lengths=torch.tensor([len(r.ids) for r in rows], dtype=torch.long),
        stopped=torch.tensor([r.finish_reason == "stop" for r in rows], dtype=torch.bool),
        cache=KVCache.empty(0),
        prompt_len=fed,
        versions=version_t,
    )
