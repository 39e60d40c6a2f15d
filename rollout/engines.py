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
"""

from __future__ import annotations

import json
import shutil
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


@dataclass(frozen=True)
class Prior:
    """What a continuation continues: row ``row`` of ``gen``, whose segment so far is
    ``history`` (the tokens already fed, in order)."""

    gen: Generation
    row: int
    history: list[int]


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
    process, continuing from the prior's KV cache."""

    def __init__(self, model: PolicyModel, generate_fn: GenerateFn = generate) -> None:
        self.model, self.generate_fn = model, generate_fn

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
        return self.generate_fn(
            self.model,
            context,
            max_new=max_new,
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
            cache=cache,
        )


def _post(
    url: str, body: Mapping[str, Any], timeout: float, token: SecretStr | None = None
) -> dict[str, Any]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:  # the header only: never in a message, a log line or the URL
        headers["Authorization"] = f"Bearer {token.get_secret_value()}"
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        raise EngineError(f"{url}: HTTP {err.code}: {err.read()[:500]!r}") from err
    except (urllib.error.URLError, OSError) as err:
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

    Generation: one ``POST {url}/v1/completions`` per turn with ``model``, ``prompt`` as a list of
    token ids (the OpenAI API accepts one), ``n`` (the batch rows; a continuation is one row),
    ``temperature``, ``max_tokens``, ``logprobs: 0``, ``seed`` (drawn from the harness's
    generator, so a task's samples are reproducible where the server honours seeds), and the
    non-standard fields vLLM's OpenAI server reads: ``stop_token_ids`` and
    ``return_tokens_as_token_ids`` (each ``logprobs.tokens`` entry is then ``token_id:N``),
    plus ``return_routes``. The server keeps no state: a continuation sends the row's whole
    segment (``Prior.history``) followed by the new context.
    Read back per choice: the token ids, ``logprobs.token_logprobs`` (the behaviour logprobs under
    the sampling temperature, as the trajectory records them) and ``finish_reason``.

    Routes: if a choice carries ``routes`` (``[prompt + generated, n_layers, top_k]`` expert ids:
    ``rlstream serve policy`` answers them when asked with ``return_routes``), they are recorded
    and router replay works as with ``torch``. Otherwise the engine reports none (``n_layers`` =
    ``top_k`` = 0): the trajectory records no routes and the learner routes freely for it.

    Version: every answer's ``policy_version`` (``serve policy`` adds it) is collected in
    ``served_versions``, so the worker can record the version the server generated with.

    Weights (``push``): the state, already applied and verified locally by the worker's weight
    subscriber, is written as an HF directory (``rollout.hf_policy.save_state_hf``, in the
    state's dtype, so it has the published bits) under ``weights_dir`` (a folder the server reads
    at the same path), and the server is told to load it with SGLang's documented native
    endpoint ``POST /update_weights_from_disk`` (body ``model_path``, ``weight_version``;
    ``load_format`` left out; answer ``success``, ``message``), the one RL frameworks use to
    reload weights. rlstream adds ``state_hash`` to the body (the server checks what it loaded
    against it) and reads ``policy_version`` from the answer when it is there: a version counts
    as pushed only when the server answered success (and, if it says, that version); an
    unreachable server is retried for up to ``timeout_s`` (it may still be starting). Older
    version directories are removed; the newest two are kept.

    Authentication: with a ``token`` (``rollout.push_auth.load_token``: a file or the
    environment) every request carries ``Authorization: Bearer <token>``, which ``serve policy
    --weights push`` requires of a push and vLLM's and SGLang's servers check with ``--api-key``.
    A refused push (401, 403, 409, 422) raises ``EngineError`` with the server's reason.
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
        answer = _post(f"{self.url.rstrip('/')}/v1/completions", body, self.timeout_s, self.token)
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
                answer = _post(url, body, self.timeout_s, self.token)
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


def generation_of(answer: Mapping[str, Any], fed: int, skip: int = 0) -> Generation:
    """A ``Generation`` from a completions answer whose prompt ended with ``fed`` new tokens
    after ``skip`` earlier ones (see :class:`OpenAIEngine`); rows padded with 0."""
    choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
    ids, lps, stopped, routes = [], [], [], []
    for c in choices:
        lp = c.get("logprobs") or {}
        if "tokens" not in lp or "token_logprobs" not in lp:
            raise EngineError("the answer has no token logprobs (the request asked logprobs=0)")
        ids.append([token_id(t) for t in lp["tokens"]])
        lps.append([float(x) for x in lp["token_logprobs"]])
        stopped.append(c.get("finish_reason") == "stop")
        if c.get("routes") is not None:
            routes.append(np.asarray(c["routes"], dtype=np.int64)[skip:])
    b, n = len(choices), max((len(x) for x in ids), default=0)
    tokens, logprobs = torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n)
    for i, (row, lp_row) in enumerate(zip(ids, lps, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        logprobs[i, : len(lp_row)] = torch.tensor(lp_row, dtype=torch.float32)
    if len(routes) == b and b:
        width = fed + n
        shape = routes[0].shape[1:]
        padded = np.zeros((b, width, *shape), dtype=np.int64)
        for i, r in enumerate(routes):
            padded[i, : min(width, len(r))] = r[:width]
        route_t = torch.from_numpy(padded)
    else:
        route_t = torch.zeros(b, fed + n, 0, 0, dtype=torch.long)
    return Generation(
        tokens=tokens,
        logprobs=logprobs,
        routes=route_t,
        lengths=torch.tensor([len(x) for x in ids], dtype=torch.long),
        stopped=torch.tensor(stopped, dtype=torch.bool),
        cache=KVCache.empty(0),
        prompt_len=fed,
    )
