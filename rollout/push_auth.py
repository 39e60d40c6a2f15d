"""Who may push weights to ``serve policy --weights push``, and which pushes it takes.

``POST /update_weights_from_disk`` makes the server load a directory and serve it as a policy
version that training records are attributed to, so it is a privileged endpoint. Rules (pure
functions and one config; ``rollout.serve`` applies them, ``rollout.engines`` sends the token):

- authenticated (401): the request carries ``Authorization: Bearer <token>`` equal to the
  server's push token, compared in constant time (``producers.feedback.auth.check_bearer``). The
  token comes from a file (``--push-token-file`` or ``$RLSTREAM_POLICY_PUSH_TOKEN_FILE``; the file
  must be readable by its owner only) or from ``$RLSTREAM_POLICY_PUSH_TOKEN``, never from a
  command line, and is never logged or echoed. A server in push mode without a token does not
  start: the endpoint is never open by default. The same header is what vLLM's and SGLang's
  servers check with ``--api-key``;
- confined (403): ``model_path`` must resolve (symlinks followed) inside the server's push
  directory, the folder the rollout worker writes versions to; any other local directory is
  refused before it is opened;
- complete (422): ``state_hash`` is required, and the loaded state must hash to it;
- ordered and bounded (409): a pushed version is not older than the one served and at most
  ``max_version_jump`` ahead of it, so one bad request cannot raise the version so far that every
  later genuine push is refused. The first push after a start sets the base (nothing is served
  yet to compare with); a restarted server so follows a run already at version 5000.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from rlstream.producers.feedback.auth import check_bearer, presented_token
from rlstream.producers.feedback.dedupe import principal_of_token
from rlstream.producers.feedback.limits import RateLimiter
from rlstream.schemas.errors import Refused, SetupError

if TYPE_CHECKING:
    import torch

TOKEN_ENV = "RLSTREAM_POLICY_PUSH_TOKEN"
TOKEN_FILE_ENV = "RLSTREAM_POLICY_PUSH_TOKEN_FILE"
MIN_TOKEN_CHARS = 16


class PushRefused(Refused):
    """A request refused: the HTTP ``status`` to answer, the reason (said to the caller) and, for
    429, the seconds to wait."""

    def __init__(self, status: int, reason: str, retry_after_s: int | None = None) -> None:
        super().__init__(reason)
        self.status, self.retry_after_s = status, retry_after_s


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's shape, plus the required ``state_hash``)."""

    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(..., min_length=1, max_length=4096)
    weight_version: str = Field(..., pattern=r"^[0-9]{1,12}$")
    state_hash: str = Field(..., min_length=1, max_length=256)


def update_request(body: bytes) -> UpdateWeightsRequest:
    """The update request of ``body``; ``PushRefused(422)`` naming what is wrong."""
    try:
        return UpdateWeightsRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise PushRefused(422, f"bad update request: {where}: {first['msg']}") from None


class PushConfig(BaseModel):
    """What a server in push mode accepts (see the module rules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: SecretStr = Field(
        min_length=MIN_TOKEN_CHARS, description="The bearer token a push must carry."
    )
    weights_dir: Path = Field(description="Pushed model_path must lie inside this folder.")
    max_version_jump: int = Field(
        1000, ge=1, le=1_000_000, description="Most versions a push may move ahead of the served."
    )

    def authorize(self, authorization: str | None) -> None:
        """401 unless ``authorization`` is ``Bearer <the token>``."""
        if not authorization:
            raise PushRefused(401, "a push needs Authorization: Bearer <push token>")
        if not check_bearer(authorization, [self.token.get_secret_value().encode()]):
            raise PushRefused(401, "the push token is not this server's")

    def confine(self, model_path: str) -> Path:
        """The resolved ``model_path``; 403 unless it lies inside ``weights_dir``."""
        root = self.weights_dir.resolve()
        path = Path(model_path).resolve()
        if path != root and root not in path.parents:
            raise PushRefused(403, f"model_path must lie inside the push directory {root}")
        return path

    def check_version(self, version: int, served: int) -> None:
        """409 when ``version`` is older than ``served`` or too far ahead of it."""
        check_version(version, served, self.max_version_jump)

    def load(self, req: UpdateWeightsRequest, served: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The pushed version and its state, checked by every rule above while ``served`` is
        served; ``PushRefused`` with the status and the reason otherwise. Reads files only:
        the served model is not touched, so no lock is needed."""
        from rlstream.rollout.hf_policy import load_hf  # transformers imports slowly
        from rlstream.schemas.deltacodec.bits import from_torch, state_hash

        version = int(req.weight_version)
        self.check_version(version, served)
        path = self.confine(req.model_path)
        try:
            policy, _ = load_hf(str(path))
        except (OSError, ValueError) as exc:
            raise PushRefused(422, f"cannot load {req.model_path}: {exc}") from exc
        state = {k: v.detach() for k, v in policy.state_dict().items()}
        got = state_hash(from_torch(state))
        if got != req.state_hash:
            raise PushRefused(422, f"state hash {got} is not the pushed {req.state_hash}")
        return version, state


def check_version(version: int, served: int, max_jump: int) -> None:
    """409 unless ``served <= version <= served + max_jump`` (any version while nothing is
    served: the first push sets the base)."""
    if served < 0:
        return
    if version < served:
        raise PushRefused(409, f"version {version} is older than the one served ({served})")
    if version > served + max_jump:
        raise PushRefused(
            409, f"version {version} jumps more than {max_jump} past the one served ({served})"
        )


def read_token_file(path: str | Path) -> SecretStr:
    """The token in ``path`` (its first line); the file must be readable by its owner only."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text()
    except OSError as exc:
        raise SetupError(f"cannot read the push token file {file}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SetupError(f"the push token file {file} is readable by others: chmod 600 it")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise SetupError(f"the push token in {file} is shorter than {MIN_TOKEN_CHARS} characters")
    return SecretStr(token)


def load_token(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    names: tuple[str, str] = (TOKEN_FILE_ENV, TOKEN_ENV),
) -> SecretStr | None:
    """A token: the file ``path``, else the file the first of ``names`` names, else the second
    variable's value (by default the push token's); None when none is given."""
    env = os.environ if environ is None else environ
    file_env, value_env = names
    path = path or env.get(file_env)
    if path:
        return read_token_file(path)
    value = env.get(value_env, "").strip()
    if not value:
        return None
    if len(value) < MIN_TOKEN_CHARS:
        raise SetupError(f"${value_env} is shorter than {MIN_TOKEN_CHARS} characters")
    return SecretStr(value)


API_TOKEN_ENV = "RLSTREAM_POLICY_API_TOKEN"
API_TOKEN_FILE_ENV = "RLSTREAM_POLICY_API_TOKEN_FILE"


class CompletionsGate:
    """Who may ask ``serve policy`` for completions, and how often: every completion becomes a
    served record that feedback can train on, so the endpoint takes a bearer token (401, as
    vLLM's and SGLang's ``--api-key``) and each token has a rate (429 with ``Retry-After``,
    ``producers.feedback.limits``), checked before the body is read."""

    def __init__(self, tokens: list[SecretStr], rate_per_s: float = 20.0, burst: int = 40) -> None:
        if not tokens:
            raise ValueError("a completions gate needs at least one token")
        self.tokens = [t.get_secret_value().encode() for t in tokens]
        self.rates = RateLimiter(rate_per_s, burst)

    def admit(self, authorization: str | None) -> None:
        """Nothing when the request may go on; ``PushRefused`` (401 or 429) saying why."""
        if not authorization:
            raise PushRefused(401, "completions need Authorization: Bearer <API token>")
        if not check_bearer(authorization, self.tokens):
            raise PushRefused(401, "the API token is not this server's")
        wait = self.rates.take(principal_of_token(presented_token(authorization) or b""))
        if wait is not None:
            raise PushRefused(429, f"over this token's rate; retry in {wait} s", wait)
