"""``rlstream run ROLE``: one role's process, from its declaration (``ops.run.roles``).

Starting a role resolves the run config (recipe + ``--set``), prints the role's part, makes sure the
run's topics exist (idempotent), installs SIGTERM/SIGINT handling, and hands the role a
``RoleContext`` to run until stopped; librdkafka's own log lines go to the role's stderr (its log)
through the role's logger (``producers.client.settings.LIBRDKAFKA_LOGGER``). A learner of several
ranks (``--ranks N`` or ``learner.ranks``) whose environment names no ranks yet is started as N rank
processes instead (``ops.run.ranks.launch``), each of which comes back here with its rank in its
environment. A role runs in one region (``--region``, default the recipe's trainer region) and
reaches that region's cluster only (``ops.run.regions``); its topics there include the mirrored
copies the region receives.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlstream.ops.run.os_users import OS_USER_ENV
from rlstream.ops.run.roles import HUNG_TRANSACTION_S, ROLES

if TYPE_CHECKING:
    from rlstream.consumers.consumer import RoleContext
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.producers.weights.run_keys import RunKeys


def start(args: argparse.Namespace) -> int:
    """Run the role ``args.role`` of run ``args.run`` until it stops; returns the exit code."""
    ctx = prepare(args)
    if isinstance(ctx, int):
        return ctx
    result = importlib.import_module(ROLES[args.role].module).run_role(ctx)
    print(f"{args.role}: stopped, {json.dumps(result)}", file=sys.stderr)
    return 0


def prepare(args: argparse.Namespace) -> RoleContext[Any] | int:
    """Everything ``start`` does before the role runs (config, region, settings, keys, topics,
    the config check); the role's context, or the exit code when it must not run (its ranks
    ran as processes of their own, or its config was refused)."""
    from rlstream.consumers.consumer import RoleContext, Stopper
    from rlstream.consumers.weights.trust import key_folder_keys
    from rlstream.ops.run.config import load_run_config
    from rlstream.ops.run.recorded import ConfigMismatch, check_config
    from rlstream.producers.client.admin import ensure_run_topics
    from rlstream.producers.client.settings import KafkaSettings, log_librdkafka_to
    from rlstream.producers.weights.run_keys import RunKeys
    from rlstream.schemas.derive import derive
    from rlstream.schemas.errors import CONFIG_EXIT

    log_librdkafka_to(logging.StreamHandler(sys.stderr))  # the role's log, as its own lines
    # the role's own warnings, timed like librdkafka's: a fault's story reads across the logs
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    role = args.role
    if ROLES[role].named and not args.name:
        raise SystemExit(f"error: the {role} role needs --name (e.g. --name {ROLES[role].example})")
    ranks = getattr(args, "ranks", None)
    sets = [*args.set, *([f"learner.ranks={ranks}"] if ranks else [])]
    config = load_run_config(args.config, sets)
    cfg = config.role(role, args.name)
    world = int(getattr(cfg, "ranks", 1))
    if role == "learner" and world > 1 and "WORLD_SIZE" not in os.environ:
        from rlstream.ops.run.ranks import launch

        return launch([sys.executable, "-m", "rlstream", *sys.argv[1:]], world)
    region = args.region or config.regions.trainer
    if role == "rollout":
        cfg = derive(cfg, region=region)  # recorded in every sample
    print(
        f"{role}: run {args.run}, config {json.dumps(cfg.model_dump(mode='json'))}",
        file=sys.stderr,
        flush=True,
    )
    regions = config.regions.topology()
    try:
        regions.check(region)
    except ValueError as exc:
        raise SystemExit(f"error: --region: {exc}") from None
    # on a secured local cluster the role connects as its own user (ops.run.acls)
    settings = KafkaSettings.from_env(args.bootstrap) or config.regions.settings(
        region, args.home, user=role
    )
    if getattr(args, "once", False):  # supervised: a hung transaction ends in a restart
        hung = float(os.environ.get("RLSTREAM_HUNG_TRANSACTION_S", HUNG_TRANSACTION_S))
        settings = derive(settings, hung_call_exit_s=hung)
    keys = (
        RunKeys.from_env()
        .or_else(_secured_run_keys(args.home, args.run, role))
        .or_else(key_folder_keys(Path(config.learner.state_dir) / args.run, role))
    )
    if user := os.environ.get(OS_USER_ENV):  # its own OS user from here on (ops.run.os_users)
        settings, keys = _become(settings, keys, role, user)
    report = ensure_run_topics(settings, args.run, regions=regions, here=region)
    if report.drift:
        print(f"warning: topic drift {report.drift}", file=sys.stderr)
    try:
        line = check_config(settings, args.run, config, region=region, trainer=regions.trainer)
    except ConfigMismatch as exc:
        print(f"{role}: refused: {exc}", file=sys.stderr, flush=True)
        return CONFIG_EXIT
    print(f"{role}: {line}", file=sys.stderr, flush=True)
    return RoleContext(
        settings,
        args.run,
        cfg,
        Stopper().install(),
        member=args.member or "0",
        name=args.name,
        region=region,
        regions=regions,
        keys=keys,
    )


def _become(
    settings: KafkaSettings, keys: RunKeys, role: str, user: str
) -> tuple[KafkaSettings, RunKeys]:
    """Drop to ``user`` (``os_users.become``) with what the role read as root kept: its
    credentials are in ``settings`` already; the files it reads later (the CA of its client,
    the learner's signing key, the compiled kernels) are read now and written into the user's
    home, 0600, once it is that user. Refused (exit with the reason) when this process cannot
    switch users."""
    import pwd

    from rlstream.ops.run import os_users
    from rlstream.producers.weights.run_keys import RunKeys
    from rlstream.schemas.derive import derive

    try:
        found = pwd.getpwnam(user)
    except KeyError:
        raise SystemExit(f"error: ${OS_USER_ENV} names {user!r}, no user of this host") from None
    if os.geteuid() == found.pw_uid:
        return settings, keys
    if os.geteuid() != 0:
        raise SystemExit(f"error: ${OS_USER_ENV}={user}: only root starts a role as another user")
    home = Path(found.pw_dir)
    carry = os_users.compiled(found)
    if settings.ssl_ca_location:
        carry[home / "ca.pem"] = Path(settings.ssl_ca_location).read_bytes()
        settings = derive(settings, ssl_ca_location=str(home / "ca.pem"))
    if role == "learner" and keys.signing_key and Path(keys.signing_key).exists():
        carry[home / "weights-signing-key.pem"] = Path(keys.signing_key).read_bytes()
        keys = RunKeys(keys.verify_hex, str(home / "weights-signing-key.pem"), keys.insecure)
    os_users.become(user, sandboxed=role in os_users.SANDBOXED, carry=carry)
    print(f"{role}: running as {user} (uid {os.getuid()})", file=sys.stderr, flush=True)
    return settings, keys


def _secured_run_keys(home: str | None, run: str, role: str) -> RunKeys:
    """On a local cluster whose secrets hold the run's weight key (a secured run, made by
    ``acl apply``): its public key for this role, its key file's path for the learner alone."""
    from rlstream.consumers.weights.trust import key_folder_keys
    from rlstream.ops.cluster import default_home, security

    folder = security.weights_key_file(Path(home) if home else default_home(), run).parent
    return key_folder_keys(folder, role)
