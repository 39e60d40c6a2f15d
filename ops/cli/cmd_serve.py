"""``rlstream serve SERVICE``: long-running network services of a run.

``serve policy`` serves the run's current policy over an OpenAI-compatible completions API
(see ``rlstream.rollout.serve``). ``serve vllm --url URL`` keeps a vLLM server someone else runs
(with rlstream's weight-transfer backend) on the run's newest verified version
(``rlstream.rollout.vllm_follow``). ``serve feedback`` runs feedback-ingest, the HTTP endpoint the
editor backend posts user feedback to (see ``rlstream.producers.feedback.service``). Each service
registers itself with one ``_register_<service>`` function, so adding one is one function and
one line in ``register``. Heavy modules (aiohttp, confluent_kafka) are imported only when a
service starts.

``--config`` means what it means for ``rlstream run ROLE``: the run recipe. feedback-ingest does
not need the recipe; its own settings (credentials, limits) come from ``--service-config``.

Kafka is found as a role finds it (``ops.run.roles``): ``--bootstrap`` / ``RLSTREAM_BOOTSTRAP`` with
the ``RLSTREAM_KAFKA_*`` credentials as given, else the local cluster's region, where on a secured
cluster each service connects as its own user (``service_settings``: ``feedback-ingest``,
``policy-server``, ``vllm-follower``), never as ``admin``; ``rlstream acl apply --run RUN`` creates those users and
their least-privilege ACLs (``ops.run.acls``) with the run's topics, which the services cannot
create.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlstream.ops.run.kafka_env import add_kafka_args
from rlstream.ops.run.roles import SERVICES

if TYPE_CHECKING:
    from rlstream.producers.client.settings import KafkaSettings

FEEDBACK_USER = SERVICES["feedback"]  # the principals, as declared in ops.run.roles
POLICY_USER = SERVICES["policy"]
VLLM_USER = SERVICES["vllm"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="run a network service of a run (feedback, ...)")
    ssub = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    _register_feedback(ssub)
    _register_policy(ssub)
    _register_vllm(ssub)


# --- feedback -------------------------------------------------------------------------------


def _register_feedback(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "feedback",
        help="HTTP feedback ingestion: POST /v1/feedback -> rl.RUN.feedback",
        description="Editor feedback over HTTP into the run's feedback stream. Bearer tokens "
        "come from the service config's `tokens` or $RLSTREAM_FEEDBACK_TOKENS (comma-separated), "
        "never from the command line; HMAC keys from the service config's `hmac_keys`.",
    )
    p.add_argument("--run", required=True, help="run name (topic rl.RUN.feedback)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="TCP port, 0 = any free (default 8088)")
    p.add_argument(
        "--service-config",
        default=None,
        metavar="FILE",
        help="TOML with the feedback service's settings (tokens, HMAC keys, limits): its "
        "[serve.feedback] table, else the whole file",
    )
    add_kafka_args(p)
    p.set_defaults(func=_serve_feedback)


def feedback_service_config(args: argparse.Namespace) -> Any:
    """The service config: the --service-config file (if any) with --run/--host/--port on top."""
    from rlstream.producers.feedback.models import FeedbackServiceConfig

    data: dict[str, Any] = {}
    if args.service_config:
        data = tomllib.loads(Path(args.service_config).read_text())
        data = dict(data.get("serve", {}).get("feedback", data))
    data["run"] = args.run
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    return FeedbackServiceConfig.model_validate(data)


def _serve_feedback(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        cfg = feedback_service_config(args)
    except ValidationError as exc:
        raise SystemExit(f"error: invalid feedback service config: {exc}") from None
    from rlstream.consumers.feedback.seen import durable_dedupe
    from rlstream.producers.client.admin import admin_client, apply_topics, run_topic_wants
    from rlstream.producers.feedback.service import serve
    from rlstream.schemas import topics

    settings = service_settings(args, FEEDBACK_USER)
    try:
        apply_topics(admin_client(settings), run_topic_wants(cfg.run), timeout=10)
    except Exception as exc:  # Kafka down: serve anyway; writes answer 503 until it is back
        print(f"warning: could not check the run's topics: {exc}", file=sys.stderr)
    topic = topics.topic_name(cfg.run, "feedback")

    def started(url: str) -> None:
        print(
            f"feedback-ingest listening on {url} (POST /v1/feedback -> {topic}; "
            f"metrics {url}/metrics, API {url}/openapi.json)",
            file=sys.stderr,
            flush=True,
        )

    dedupe = durable_dedupe(cfg, settings)
    if dedupe is not None:
        print(f"feedback-ingest: {dedupe.loaded} stored ids read back", file=sys.stderr)
    try:
        serve(cfg, settings, on_start=started, dedupe=dedupe)
    except ValueError as exc:  # e.g. no credentials configured
        raise SystemExit(f"error: {exc}") from None
    finally:
        if dedupe is not None:
            dedupe.close()
    return 0


# --- policy ---------------------------------------------------------------------------------


def _register_policy(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "policy",
        help="the run's current policy behind POST /v1/completions (OpenAI-compatible)",
        description="Weights follow the run's weight stream and are hot-swapped between "
        "requests; every completion carries its policy_version and a request_id, returns token "
        "logprobs when the request asks (`logprobs`: N), and is recorded in rl.RUN.served "
        "before it is answered, so editor feedback naming the request id can be trained on.",
    )
    p.add_argument("--run", required=True, help="run whose weights to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0 = any free")
    p.add_argument(
        "--config",
        default=None,
        help="TOML run recipe, as for `rlstream run` (model name, policy shape)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--released-only",
        action="store_true",
        help="serve the newest version the eval role released (held-out release rule), "
        "never a newer unreleased one",
    )
    p.add_argument(
        "--weights",
        choices=("kafka", "push"),
        default="kafka",
        help="kafka: follow the run's weight stream (default); push: serve only versions "
        "pushed to POST /update_weights_from_disk (the rollout worker's openai engine), which "
        "needs a push token and --push-dir",
    )
    p.add_argument(
        "--push-token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token a push must carry (mode 0600); default "
        "$RLSTREAM_POLICY_PUSH_TOKEN_FILE, else $RLSTREAM_POLICY_PUSH_TOKEN",
    )
    p.add_argument(
        "--push-dir",
        default=None,
        metavar="DIR",
        help="pushed model_path must lie inside this folder (the rollout worker's "
        "rollout.engine_weights_dir)",
    )
    p.add_argument(
        "--max-version-jump",
        type=int,
        default=1000,
        help="refuse a pushed version more than this far ahead of the served one",
    )
    p.add_argument(
        "--api-token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token a completion request must carry (mode 0600); "
        "default $RLSTREAM_POLICY_API_TOKEN_FILE, else $RLSTREAM_POLICY_API_TOKEN; the push "
        "token is accepted too. Every completion is recorded for training, so there is no "
        "open default: without a token the server refuses to start unless --open",
    )
    p.add_argument(
        "--rate-per-token",
        type=float,
        default=20.0,
        help="completion requests per second each token may make (burst twice that); 429 over it",
    )
    p.add_argument(
        "--open",
        action="store_true",
        help="serve completions without a token (anyone who reaches the port can mint served "
        "completions that feedback trains on): for a local trial only",
    )
    add_kafka_args(p)
    p.set_defaults(func=_serve_policy)


def _serve_policy(args: argparse.Namespace) -> int:
    from rlstream.ops.run.config import load_run_config
    from rlstream.producers.client.admin import admin_client, apply_topics, run_topic_wants
    from rlstream.producers.runtime import aio
    from rlstream.rollout.serve import PolicyServer, make_app
    from rlstream.schemas import topics

    config = load_run_config(args.config, args.set)
    push = push_config(args) if args.weights == "push" else None
    gate = completions_gate(args, push)
    settings = service_settings(args, POLICY_USER)
    try:  # a run started before the served stream existed gets it here (not as its own user)
        apply_topics(admin_client(settings), run_topic_wants(args.run), timeout=10)
    except Exception as exc:  # Kafka down: serve anyway; completions answer 503 until it is back
        print(f"warning: could not check the run's topics: {exc}", file=sys.stderr)
    server = PolicyServer(
        settings,
        args.run,
        config.model,
        config.policy,
        released_only=args.released_only,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        region=args.region or "trainer",
        weights=args.weights,
        push=push,
        gate=gate,
    )
    following = "released versions only" if args.released_only else "the newest version"
    if args.weights == "push":
        following = "pushed versions only (POST /update_weights_from_disk)"
    print(
        f"policy server for run {args.run} on http://{args.host}:{args.port}/v1/completions "
        f"(model {config.model!r}, following {following}; "
        f"recording to {topics.topic_name(args.run, 'served')})",
        file=sys.stderr,
        flush=True,
    )
    try:
        aio.run_app(make_app(server), args.host, args.port)
    finally:
        server.close()
    return 0


def _register_vllm(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "vllm",
        help="keep a running vLLM server on the run's newest verified version",
        description="The server runs on this host with rlstream's weight-transfer backend "
        "(`pip install --no-deps rollout/vllm_server` into its venv; started with "
        'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{"backend": "rlstream"}\'). '
        "Each verified version is prepared while the server generates, loaded in place while "
        "it is paused (requests in flight finish on the old version first), and checked after "
        "the swap; one line per version, JSON with --json.",
    )
    p.add_argument("--run", required=True, help="run whose weights to follow")
    p.add_argument("--url", required=True, help="base URL of the vLLM server")
    p.add_argument(
        "--config", default=None, help="TOML run recipe, as for `rlstream run` (model, policy)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--max-versions", type=int, default=None, help="stop after this many versions taken"
    )
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per version, and at the end"
    )
    add_kafka_args(p)
    p.set_defaults(func=_serve_vllm)


def _serve_vllm(args: argparse.Namespace) -> int:
    import json
    import signal
    import time

    from rlstream.ops.run.config import load_run_config
    from rlstream.rollout.engines import EngineError
    from rlstream.rollout.vllm_follow import VllmFollower

    config = load_run_config(args.config, args.set)
    settings = service_settings(args, VLLM_USER)
    as_json = args.json

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    follower = VllmFollower(
        settings, args.run, config.model, config.policy, config.rollout.vllm, args.url, log=log
    )
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
    taken, code = 0, 0
    log(f"vllm: following run {args.run} ({config.model!r}) into {args.url}")
    try:
        while not stopping and time.monotonic() < deadline:
            if args.max_versions is not None and taken >= args.max_versions:
                break
            line = follower.step(1.0)
            if line is None:
                continue
            taken += "refused" not in line
            if as_json:
                print(json.dumps(line), flush=True)
    except KeyboardInterrupt:
        pass
    except EngineError as exc:
        log(f"vllm: giving up: {exc}")
        code = 1
    finally:
        summary = follower.summary()
        follower.close()
    if as_json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        log(f"vllm: {json.dumps(summary)}")
    return code


def completions_gate(args: argparse.Namespace, push: Any) -> Any:
    """Who may ask for completions (``rollout.push_auth.CompletionsGate``): the API token and
    the push token; None only with ``--open``. Exits with the reason when there is no token."""
    from rlstream.rollout.push_auth import (
        API_TOKEN_ENV,
        API_TOKEN_FILE_ENV,
        CompletionsGate,
        load_token,
    )
    from rlstream.schemas.errors import SetupError

    try:
        api = load_token(args.api_token_file, names=(API_TOKEN_FILE_ENV, API_TOKEN_ENV))
    except SetupError as exc:
        raise SystemExit(f"error: {exc}") from None
    tokens = [t for t in (api, push.token if push is not None else None) if t is not None]
    if not tokens:
        if args.open:
            print("warning: completions are open (--open): anyone who reaches the port can "
                  "mint served completions", file=sys.stderr)  # fmt: skip
            return None
        raise SystemExit(
            "error: serve policy needs an API token for /v1/completions: --api-token-file FILE, "
            f"${API_TOKEN_FILE_ENV} or ${API_TOKEN_ENV} (or --open for a local trial)"
        )
    if args.rate_per_token <= 0:
        raise SystemExit("error: --rate-per-token must be > 0")
    return CompletionsGate(tokens, args.rate_per_token, max(1, int(2 * args.rate_per_token)))


def push_config(args: argparse.Namespace) -> Any:
    """What a ``--weights push`` server accepts (``rollout.push_auth``); exits with the reason
    when the token or the folder is missing: the endpoint never opens unauthenticated."""
    from pydantic import ValidationError

    from rlstream.rollout.push_auth import PushConfig, load_token
    from rlstream.schemas.errors import SetupError

    try:
        token = load_token(args.push_token_file)
    except SetupError as exc:
        raise SystemExit(f"error: {exc}") from None
    if token is None:
        raise SystemExit(
            "error: --weights push needs a push token: --push-token-file FILE, "
            "$RLSTREAM_POLICY_PUSH_TOKEN_FILE or $RLSTREAM_POLICY_PUSH_TOKEN"
        )
    if args.push_dir is None:
        raise SystemExit("error: --weights push needs --push-dir (where pushed versions lie)")
    try:
        return PushConfig(
            token=token, weights_dir=args.push_dir, max_version_jump=args.max_version_jump
        )
    except ValidationError as exc:
        raise SystemExit(f"error: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None


def service_settings(args: argparse.Namespace, user: str) -> KafkaSettings:
    """How the service ``user`` reaches Kafka (see the module docstring): the given bootstrap and
    credentials, else the local cluster's ``--region`` (default the trainer region), as ``user``
    when it is secured."""
    from rlstream.ops.cluster import DEFAULT_REGION
    from rlstream.ops.run.regions import local_settings
    from rlstream.producers.client.settings import KafkaSettings

    given = KafkaSettings.from_env(getattr(args, "bootstrap", None))
    if given is not None:
        return given
    region = getattr(args, "region", None) or DEFAULT_REGION
    return local_settings(region, getattr(args, "home", None), user=user)
