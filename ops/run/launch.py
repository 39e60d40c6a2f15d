"""The processes of a run: which ``rlstream run`` commands a recipe needs, in which region, and how
to write them down for hosts of one's own.

``plan`` turns a run config into ``Process`` records: the roles the recipe names (learner,
admission, one judge per ``[judges]`` entry, the rollout workers spread over the rollout regions,
feedback-rl when ``launch.feedback``, the scheduler, eval and tracker unless turned off; with
``launch.lent_workers``, each rollout region's capacity role and its lent workers), as many of
each as ``RunConfig.launch`` says.
``rlstream launch`` starts them supervised (each ``rlstream run`` restarts its role), ``rlstream
demo`` too; ``systemd_units`` and ``compose_file`` write the same processes for a user who places
them on several hosts (``docs/launch.md``).

Rules:

- every process gets the same recipe and ``--set`` values, so every role resolves the same
  config and its start-up check against the run's recorded config passes;
- a role reaches its region's cluster from the recipe (``[regions.clusters.R]``, with per-role
  credentials when the entry names ``{role}``) or the local cluster (``--home``): no address is
  passed on the command line, so what a process runs is what the written description says;
- the learner alone is given the signing key's file; every process gets the run's public key.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlstream.ops.run.config import RunConfig
    from rlstream.producers.weights.run_keys import RunKeys


@dataclass(frozen=True)
class Process:
    """One ``rlstream run ROLE`` process of a run."""

    name: str
    """Its name in logs and unit files: ``learner``, ``judge-tests``, ``rollout-eu-0``."""
    role: str
    region: str
    args: tuple[str, ...] = ()
    """Its own options (``--name``, ``--member``), before the run's shared ones."""

    def command(
        self, run: str, shared: list[str], home: str | None = None, python: str = "rlstream"
    ) -> list[str]:
        """The command line, with the run's shared options (recipe and ``--set`` values)."""
        where = ["--home", home] if home else []
        head = [python] if python == "rlstream" else [python, "-m", "rlstream"]
        return [*head, "run", self.role, "--run", run, "--region", self.region, *where,
                *self.args, *shared]  # fmt: skip


def plan(
    config: RunConfig, rollout_workers: int | None = None, feedback: bool | None = None
) -> list[Process]:
    """The processes of a run of ``config`` (see the module rules), in start order: the
    learner first (it makes the run's key and first version), the scheduler after the roles
    that consume what it releases."""
    launch = config.launch
    regions = config.regions.topology()
    here = regions.trainer
    procs = [Process("learner", "learner", here), Process("admission", "admission", here)]
    for name in config.judges:
        for m in range(launch.judge_members):
            label = f"judge-{name}" + (f"-{m}" if launch.judge_members > 1 else "")
            procs.append(Process(label, "judge", here, ("--name", name, "--member", str(m))))
    places = regions.rollout or (here,)
    for i in range(rollout_workers or launch.rollout_workers):
        where = places[i % len(places)]
        procs.append(Process(f"rollout-{where}-{i}", "rollout", where, ("--member", str(i))))
    for where in places if launch.lent_workers else ():  # tidal capacity: see docs/capacity.md
        procs.append(Process(f"capacity-{where}", "capacity", where))
        for slot in range(launch.lent_workers):
            lent = ("--member", str(slot), "--set", "rollout.lent=true")
            procs.append(Process(f"rollout-{where}-lent-{slot}", "rollout", where, lent))
    if launch.feedback if feedback is None else feedback:
        procs.append(Process("feedback-rl", "feedback-rl", here))
    procs.append(Process("scheduler", "scheduler", here))
    if launch.eval:
        procs.append(Process("eval", "eval", here))
    if launch.tracker:
        procs.append(Process("tracker", "tracker", here))
    return procs


def shared_args(recipe: str | None, sets: list[str]) -> list[str]:
    """The options every process of a run gets: its recipe and ``--set`` values."""
    out = ["--config", str(Path(recipe).resolve())] if recipe else []
    for item in sets:
        out += ["--set", item]
    return out


def systemd_units(
    run: str, procs: list[Process], shared: list[str], keys: RunKeys, home: str | None
) -> dict[str, str]:
    """One systemd unit per process (file name -> text): restart on failure, never on a refused
    configuration (exit status 2), the run's public key in every unit, the signing key's file
    in the learner's alone. Copy each to the host that runs it (``docs/launch.md``)."""
    units = {}
    for p in procs:
        env = keys.env(p.role)
        lines = [
            "[Unit]",
            f"Description=rlstream run {run}: {p.name} ({p.role}, region {p.region})",
            "After=network-online.target",
            "",
            "[Service]",
            *(f"Environment={k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            "Environment=PYTHONUNBUFFERED=1",
            f"ExecStart={shlex.join(p.command(run, shared, home))} --once",
            "Restart=on-failure",
            "RestartSec=5",
            "RestartPreventExitStatus=2",
            "KillSignal=SIGTERM",
            "TimeoutStopSec=60",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
        units[f"rlstream-{run}-{p.name}.service"] = "\n".join(lines)
    return units


#: Where the learner's container finds the signing key (a read-only bind mount of the host's).
CONTAINER_KEY = "/run/secrets/rlstream-weights-signing-key.pem"


def compose_file(
    run: str, procs: list[Process], shared: list[str], keys: RunKeys, image: str
) -> str:
    """A Docker Compose file of the same processes (one service each, ``image`` holding
    rlstream); JSON is valid YAML, so it is written as JSON. The signing key file is mounted,
    read-only, into the learner's container alone (``CONTAINER_KEY``), and its variable names
    it there."""
    import json

    from rlstream.producers.weights.run_keys import SIGNING_KEY_ENV

    services = {}
    for p in procs:
        env = {**keys.env(p.role), "PYTHONUNBUFFERED": "1"}
        service: dict[str, object] = {
            "image": image,
            "command": p.command(run, shared)[1:],
            "environment": env,
            "restart": "on-failure",
            "stop_signal": "SIGTERM",
            "stop_grace_period": "60s",
        }
        if SIGNING_KEY_ENV in env:  # a host path: the container sees it at CONTAINER_KEY
            service["volumes"] = [f"{env[SIGNING_KEY_ENV]}:{CONTAINER_KEY}:ro"]
            env[SIGNING_KEY_ENV] = CONTAINER_KEY
        services[p.name] = service
    return json.dumps({"name": f"rlstream-{run}", "services": services}, indent=2) + "\n"


def prepare_regions(
    config: RunConfig,
    run: str,
    home: str | None,
    brokers: int | None = None,
    secure: bool | None = None,
    authorize=None,
) -> dict:
    """Every region of the run reachable, its topics made, and the run's config recorded
    (``recorded.create_run``: ``ConfigMismatch`` when the run exists with another config).
    Local regions (those the recipe gives no cluster) are started with their MirrorMaker 2
    links (``brokers`` each unless ``regions.brokers`` names them; None: as they are, 1 when
    new; a count a region was not created with is refused; ``secure`` None: as they were). ``authorize(state, settings)``, when given, applies the run's users and ACLs (a
    secured demo); otherwise the links are given the run's streams. Returns each region's
    admin settings."""
    from rlstream.ops import cluster
    from rlstream.ops.run import recorded
    from rlstream.producers.client.admin import ensure_run_topics

    regions = config.regions.topology()
    local = [r for r in regions.names if r not in config.regions.clusters]
    state = None
    if local:
        named = config.regions.brokers
        counts = {r: named[r] for r in local if r in named} | (
            {r: brokers for r in local if r not in named} if brokers is not None else {}
        )
        where = Path(home) if home else None
        state = cluster.up(
            local, home=where, trainer=regions.trainer, secure=secure, brokers=counts
        )
    settings = {r: config.regions.settings(r, home) for r in regions.names}  # admin's
    if authorize is not None:
        authorize(state, settings)
    elif state is not None:
        cluster.authorize_links(state, run)
    for name, region_settings in settings.items():
        ensure_run_topics(region_settings, run, regions=regions, here=name)
    recorded.create_run(settings[regions.trainer], run, config, list(regions.names))
    return settings
