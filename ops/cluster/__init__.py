"""The embedded default: real Apache Kafka on loopback, KRaft nodes per region, MirrorMaker 2.

A region is one KRaft node, or with ``brokers=3`` a replicated 3-node cluster (``broker``).
``up`` is idempotent: a region whose brokers still run is reused, a stopped one is restarted on
its data. With more than one region, the first named (or ``trainer``) is the trainer region and
every other is a rollout region linked to it by MirrorMaker 2, whose flows are derived from the
stream catalog (``mirror.link_flows``): one process per link, or across a WAN two, each in the
region it writes to (``_link_processes``); a link whose process died is restarted by the next
``up``. ``down`` stops exactly the processes ``up`` recorded, by pid. All state lives
in one directory (``--home``, ``$RLSTREAM_HOME``, default ``~/.local/state/rlstream/cluster``)
holding ``cluster.json``, each region's config, data and logs, and each link's MirrorMaker's.
``up(secure=True)`` starts every region secured (``ops.cluster.security``: SASL/SCRAM over TLS,
ACLs enforced); whether a region is secured is decided at its first start and kept, and a cluster
is secured everywhere or nowhere. A secured link's MirrorMaker 2 connects to both of its clusters
as its own user (``acls.mirror_user``), created there with its run-independent ACLs before it
starts; ``authorize_links(cluster, run)`` (``acl apply``) adds the ACLs of a run's streams.
``up(link=LinkSpec(rtt_ms, mbit))`` puts a WAN between the trainer region and every rollout
region (``ops.cluster.wan``): each link's MirrorMakers then reach the other region only through
it; a later ``up`` with another spec changes the link in place, and ``cut_link`` /
``heal_link`` partition one rollout region and bring it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.ops.cluster import broker, mirror, procs, wan
from rlstream.ops.cluster.broker import Region
from rlstream.ops.cluster.mirror import Flow, Mirror, link_flows, parse_flow
from rlstream.ops.cluster.wan import LinkSpec, Wan
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas.errors import SetupError

__all__ = [
    "Cluster",
    "Flow",
    "LinkSpec",
    "authorize_links",
    "cut_link",
    "default_home",
    "down",
    "heal_link",
    "link_flows",
    "load",
    "parse_flow",
    "stop_mirror",
    "trainer_of",
    "up",
]

DEFAULT_REGION = "trainer"
#: The name of a WAN link's second MirrorMaker, which runs in the trainer region
HOME_SUFFIX = "-home"


def default_home() -> Path:
    env = os.environ.get("RLSTREAM_HOME")
    return Path(env) if env else Path.home() / ".local" / "state" / "rlstream" / "cluster"


@dataclass
class Cluster:
    home: Path
    regions: dict[str, Region] = field(default_factory=dict)
    # by name: a link's is its rollout region's, and across a WAN also ``REGION-home``
    mirrors: dict[str, Mirror] = field(default_factory=dict)
    trainer: str = DEFAULT_REGION
    wan: Wan | None = None  # the WAN's proxy server, when the regions are linked through one
    mirror_settings: dict[str, str] = field(default_factory=dict)  # every link's extra settings

    @property
    def state_file(self) -> Path:
        return self.home / "cluster.json"

    def save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        doc = {
            "trainer": self.trainer,
            "regions": {n: r.to_dict() for n, r in self.regions.items()},
            "mirrors": {n: m.to_dict() for n, m in self.mirrors.items()},
            "wan": self.wan.to_dict() if self.wan else None,
            "mirror_settings": self.mirror_settings,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(self.state_file)

    def bootstrap(self, region: str = DEFAULT_REGION) -> str:
        if region not in self.regions:
            raise SetupError(
                f"region {region!r} is not in the local cluster at {self.home} "
                f"(regions: {sorted(self.regions) or 'none'}); "
                f"start it with `rlstream cluster up --regions {region}`"
            )
        return self.regions[region].bootstrap

    def settings(self, region: str = DEFAULT_REGION, user: str = "admin") -> KafkaSettings:
        """How ``user`` reaches ``region``: its bootstrap alone, or when the region is secured
        the user's SCRAM credential and the cluster's CA (``security.client_settings``)."""
        self.bootstrap(region)  # a clear error for an unknown region
        return self.regions[region].settings(user)

    def running_regions(self) -> list[str]:
        """Regions that serve: every node of a one-broker region, a majority of a replicated
        one (a region that lost one broker of 3 still serves, degraded)."""
        return [n for n, r in self.regions.items() if r.serving()]

    def rollout_regions(self) -> list[str]:
        return [n for n in self.regions if n != self.trainer]

    def link_mirrors(self, region: str) -> list[Mirror]:
        """The MirrorMaker processes recorded for ``region``'s link."""
        names = (region, region + HOME_SUFFIX)
        return [self.mirrors[n] for n in names if n in self.mirrors]

    def link_running(self, region: str) -> bool:
        """Whether every process ``region``'s link should have runs."""
        wanted = {name for name, _, _, _ in _link_processes(self, region)}
        return all(n in self.mirrors and self.mirrors[n].running() for n in wanted)


def load(home: Path | None = None) -> Cluster:
    home = Path(home or default_home())
    cluster = Cluster(home=home)
    if cluster.state_file.exists():
        doc = json.loads(cluster.state_file.read_text())
        cluster.regions = {n: Region.from_dict(r) for n, r in doc.get("regions", {}).items()}
        cluster.mirrors = {n: Mirror(**m) for n, m in (doc.get("mirrors") or {}).items()}
        cluster.trainer = doc.get("trainer", DEFAULT_REGION)
        cluster.wan = Wan(**doc["wan"]) if doc.get("wan") else None
        cluster.mirror_settings = doc.get("mirror_settings") or {}
    return cluster


def trainer_of(regions: list[str]) -> str:
    """The trainer region of a region list: ``trainer`` if named, else the first."""
    return DEFAULT_REGION if DEFAULT_REGION in regions or not regions else regions[0]


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def up(
    regions: list[str] | None = None,
    mirror_links: bool = True,
    home: Path | None = None,
    heap: str | None = None,
    log=print,
    trainer: str | None = None,
    secure: bool | None = None,
    brokers: int | dict[str, int] | None = None,
    link: LinkSpec | None = None,
    mirror_settings: dict[str, str] | None = None,
) -> Cluster:
    """Start (or reuse) the brokers of each region, then one MirrorMaker 2 per rollout region's
    link (unless ``mirror_links`` is False); ``secure`` True for secured regions, None to keep
    the cluster as it was started (a new cluster unsecured); ``brokers`` per region (one number
    for all, or by name; None or unnamed: as it is, 1 for a new region): a region keeps the
    count it was created with, and a count asked of a region created with another is refused
    (``SetupError`` naming both);
    ``heap`` per broker (default ``broker.default_heap``); ``link``: the WAN between the trainer
    region and each rollout region (None keeps the cluster's, or none); ``mirror_settings``:
    MirrorMaker 2 settings every link gets last (None keeps the cluster's); a link whose
    settings changed restarts."""
    home = Path(home or default_home())
    names = regions or [DEFAULT_REGION]
    with _locked(home):
        cluster = load(home)
        secure = _check_secure(cluster, names, secure)
        if cluster.regions and trainer is None:
            trainer = cluster.trainer  # a cluster keeps its trainer region
        cluster.trainer = trainer or trainer_of(names)
        if mirror_settings is not None:
            cluster.mirror_settings = dict(mirror_settings)
        for name in names:
            asked = brokers.get(name) if isinstance(brokers, dict) else brokers
            region = cluster.regions.get(name)
            if region is not None and asked is not None and asked != region.brokers:
                raise SetupError(
                    f"region {name} at {home} was created with {region.brokers} broker(s), not "
                    f"the {asked} asked: a region keeps its brokers. Use another --home, or "
                    "`rlstream cluster down --purge` first (its topics are lost)"
                )
            cluster.regions[name] = region or broker.new_region(name, home, secure, asked or 1)
        if link is not None or cluster.wan is not None:
            _plan_links(cluster, names, link)
        for name in names:
            region = cluster.regions[name]
            pids = ", ".join(str(n.pid) for n in region.nodes())
            if region.running():
                log(f"region {name}: running at {region.bootstrap} (pid {pids})")
                continue
            log(f"region {name}: starting Kafka ({region.brokers} broker(s)) ...")
            broker.start(region, heap=heap or broker.default_heap(region.brokers))
            cluster.save()
            pids = ", ".join(str(n.pid) for n in region.nodes())
            log(f"region {name}: ready at {region.bootstrap} (pid {pids}, log {region.log})")
        _create_cluster_topics(cluster, names)
        if cluster.wan is not None:
            _ensure_wan(cluster, link or cluster.wan.spec, log)
        if mirror_links:
            for name in cluster.rollout_regions():
                if cluster.regions[name].running() and cluster.regions[cluster.trainer].running():
                    _ensure_link(cluster, name, log)
        cluster.save()
        return cluster


def _check_secure(cluster: Cluster, names: list[str], secure: bool | None) -> bool:
    """Whether the regions start secured; refuses a region started the other way: a cluster
    is secured everywhere or nowhere (a link joins two clusters alike)."""
    if secure is None:
        secure = any(r.secure for r in cluster.regions.values())
    for name, region in cluster.regions.items():
        if region.secure != secure:
            have, want = ("secured", "unsecured") if region.secure else ("unsecured", "secured")
            hint = "start it as it was, or `rlstream cluster down --purge` first"
            if name in names:
                raise SetupError(
                    f"region {name} at {cluster.home} was started {have}; it cannot restart "
                    f"{want}. {hint.capitalize()}"
                )
            raise SetupError(
                f"the cluster at {cluster.home} is {have} (region {name}); a region cannot join "
                f"it {want}: {hint}"
            )
    return secure


def _plan_links(cluster: Cluster, names: list[str], link: LinkSpec | None) -> None:
    """Give the trainer region a WAN listener for every rollout region; a running trainer
    region cannot take a new one (its brokers read listeners at start)."""
    trainer = cluster.regions.get(cluster.trainer)
    if trainer is None:
        raise SetupError(
            f"a WAN link needs the trainer region {cluster.trainer!r}: name it in the regions"
        )
    for name in cluster.rollout_regions():
        if trainer.add_link(name) and trainer.running():
            raise SetupError(
                f"the trainer region {cluster.trainer} runs without a listener for {name}'s WAN "
                "link; `rlstream cluster down` first (the data stays), then `up` with the link"
            )
        there = cluster.regions[name]
        if cluster.trainer not in there.links and not there.running():
            # the flow home is fetched from here through the link (one running since before
            # keeps a single MirrorMaker for its link until it restarts)
            there.add_link(cluster.trainer)
    if cluster.wan is None and link is not None:
        cluster.wan = Wan(home=str(cluster.home), api_port=0, rtt_ms=link.rtt_ms, mbit=link.mbit)


def _ensure_wan(cluster: Cluster, spec: LinkSpec, log) -> None:
    """The WAN's proxy server running with one proxy per trainer broker per link, at ``spec``."""
    assert cluster.wan is not None
    if not cluster.wan.running():
        cluster.wan = wan.start(cluster.home, spec)
        log(f"wan: Toxiproxy running (pid {cluster.wan.pid}, api 127.0.0.1:{cluster.wan.api_port})")
    cluster.wan.rtt_ms, cluster.wan.mbit = spec.rtt_ms, spec.mbit
    trainer = cluster.regions[cluster.trainer]
    for name, ports in trainer.links.items():
        # the trainer's brokers as seen from the rollout region, then (when it has them) the
        # rollout region's as seen from the trainer region: one link, cut and healed as one
        back = (
            cluster.regions[name].links.get(cluster.trainer, []) if name in cluster.regions else []
        )
        hops = [(proxy, listen) for listen, proxy in [*ports, *back]]
        wan.ensure_proxies(cluster.wan, name, hops)
    rate = f", {spec.mbit:g} Mbit/s per connection" if spec.mbit else ""
    log(f"wan: {cluster.trainer} <-> {', '.join(trainer.links)} at {spec.rtt_ms:g} ms RTT{rate}")
    cluster.save()


def cut_link(region: str, home: Path | None = None) -> None:
    """Partition rollout region ``region`` from the trainer region (a black hole) until
    ``heal_link``."""
    cluster = load(home)
    if cluster.wan is None or not cluster.wan.running():
        raise SetupError("the cluster has no running WAN: `cluster up --rtt-ms MS` first")
    wan.cut(cluster.wan, region)


def heal_link(region: str, home: Path | None = None, log=lambda *_: None) -> None:
    """End ``region``'s cut, then restart its link's MirrorMakers. A cut longer than the
    Connect worker's session timeout made the herder of the flow home rebalance when it ran
    across the link (its worker cluster the trainer region); its exactly-once tasks then failed
    to stop, and dedicated mode never restarts them (measured: after a 60 s cut no trajectory
    crossed home in the next 240 s). Each restarted MirrorMaker resumes from its committed
    offsets with exactly-once, so nothing is lost or copied twice."""
    home = Path(home or default_home())
    with _locked(home):
        cluster = load(home)
        if cluster.wan is None or not cluster.wan.running():
            raise SetupError("the cluster has no running WAN: `cluster up --rtt-ms MS` first")
        wan.heal(cluster.wan, region)
        if cluster.link_mirrors(region):
            for link in cluster.link_mirrors(region):
                mirror.stop(link)
            _ensure_link(cluster, region, log)
        cluster.save()


def _create_cluster_topics(cluster: Cluster, regions: list[str]) -> None:
    """Every region gets ``rl.schemas`` and ``rl.runs`` so any consumer there can decode."""
    from rlstream.producers.client.admin import ensure_cluster_topics

    for name in regions:
        ensure_cluster_topics(cluster.settings(name))


def _link_processes(
    cluster: Cluster, region: str
) -> list[tuple[str, list[Flow], dict[str, str], list[str]]]:
    """``(name, flows, via, targets)`` of each MirrorMaker of ``region``'s link. Without a WAN,
    one process with both flows. Across a WAN, each flow runs in the region it writes to (remote
    fetch, local exactly-once produce): ``REGION`` in the rollout region, reaching the trainer
    region through the link, and ``REGION-home`` in the trainer region, reaching the rollout
    region through the link's way back. A produce request across the link costs a round trip
    per batch and a transaction several; a fetch across it streams."""
    outward, home = link_flows(cluster.trainer, region)
    trainer, there = cluster.regions[cluster.trainer], cluster.regions[region]
    if region not in trainer.links:
        return [(region, [outward, home], {}, [])]
    to_trainer = {cluster.trainer: trainer.link_bootstrap(region)}
    if cluster.trainer not in there.links:  # started before links had a way back
        return [(region, [outward, home], to_trainer, [])]
    return [
        (region, [outward], to_trainer, [region]),
        (
            region + HOME_SUFFIX,
            [home],
            {region: there.link_bootstrap(cluster.trainer)},
            [cluster.trainer],
        ),
    ]


def _ensure_link(cluster: Cluster, region: str, log) -> None:
    """The MirrorMaker 2 processes of ``region``'s link (``_link_processes``), each started
    unless it runs with the same config (flows, the way to the other region, extra settings);
    a process the link no longer has is stopped. On a secured cluster the link's user and
    run-independent ACLs are written first."""
    from rlstream.ops.cluster import link_acls as acls

    plan = _link_processes(cluster, region)
    for old in [n for n in (region, region + HOME_SUFFIX) if n in cluster.mirrors]:
        if old not in {name for name, _, _, _ in plan}:
            mirror.stop(cluster.mirrors.pop(old))
    extra = cluster.mirror_settings
    user = acls.mirror_user(region) if cluster.regions[region].secure else None
    for name, flows, via, targets in plan:
        current = cluster.mirrors.get(name)
        same = False
        if current and current.running() and current.flows == [str(f) for f in flows]:
            # its user exists (it started as that user); a changed config restarts it
            text = mirror.mm2_properties(flows, cluster.regions, user, via, extra)
            same = current.properties.read_text() == text and current.targets == targets
        if same and current is not None:
            log(f"mirror {name}: running (pid {current.pid})")
            continue
        if current:
            mirror.stop(current)
        if cluster.regions[region].secure:
            user = _authorize_link(cluster, region, run=None)
        where = f" in {targets[0]}" if targets else ""
        log(f"mirror {name}: starting MirrorMaker 2 ({cluster.trainer} <-> {region}{where}) ...")
        started = mirror.start(
            cluster.home, flows, cluster.regions, name=name, user=user, via=via, extra=extra,
            targets=targets,
        )  # fmt: skip
        cluster.mirrors[name] = started
        cluster.save()  # recorded at once: a later link failing to start must not hide this one
        log(f"mirror {name}: running (pid {started.pid}, log {started.log})")


def _authorize_link(cluster: Cluster, region: str, run: str | None) -> str:
    """Write the link user of ``region`` and its ACLs (``acls.mirror_grants``) into both
    clusters of the link, as admin; returns the user."""
    from rlstream.ops.cluster import link_acls as acls
    from rlstream.ops.cluster import security

    user = acls.mirror_user(region)
    for on in (cluster.trainer, region):
        grants = acls.mirror_grants(cluster.trainer, region, on, run)
        security.authorize(cluster.settings(on), cluster.home, [user], grants)
    return user


def authorize_links(cluster: Cluster, run: str) -> int:
    """Give every secured link whose two regions are running the ACLs of ``run``'s streams, on
    both of its clusters; returns how many ACLs were written. A link added (or a region that
    was down) later gets them from the next ``acl apply --run RUN``."""
    from rlstream.ops.cluster import link_acls as acls

    count = 0
    running = set(cluster.running_regions())
    for region in cluster.rollout_regions():
        if not cluster.regions[region].secure or not {region, cluster.trainer} <= running:
            continue
        _authorize_link(cluster, region, run)
        count += sum(
            len(acls.mirror_grants(cluster.trainer, region, on, run))
            for on in (cluster.trainer, region)
        )
    return count


def stop_mirror(region: str, home: Path | None = None) -> None:
    """Stop the MirrorMakers of ``region``'s link (the next ``up`` starts them again)."""
    home = Path(home or default_home())
    with _locked(home):
        cluster = load(home)
        for link in cluster.link_mirrors(region):
            mirror.stop(link)
        cluster.save()


def down(
    home: Path | None = None,
    purge: bool = False,
    log=print,
    only: list[str] | None = None,
) -> None:
    """Stop what ``up`` started (every MirrorMaker first, then every broker, each kind side by
    side); ``purge`` deletes the data. With ``only``, just those regions and the MirrorMakers
    of their links stop (their data stays; ``up`` starts them again)."""
    if only is not None and purge:
        raise ValueError("purge deletes every region's data: it cannot go with only")
    home = Path(home or default_home())
    with _locked(home):
        cluster = load(home)
        links = [
            (n, m)
            for n, m in cluster.mirrors.items()
            if only is None or n.removesuffix(HOME_SUFFIX) in only
        ]
        procs.stop_all([(m.pid, str(m.properties)) for _, m in links if m.pid])
        if only is None and cluster.wan is not None:
            wan.stop(cluster.wan)
        for name, link in links:
            link.pid = None
            log(f"mirror {name}: stopped")
        regions = [(n, r) for n, r in cluster.regions.items() if only is None or n in only]
        procs.stop_all([t for _, r in regions for t in broker.targets(r)])
        for name, region in regions:
            was = [str(n.pid) for n in region.nodes() if n.pid]
            for node in region.nodes():
                region.set_pid(node.node_id, None)
            log(f"region {name}: stopped" + (f" (pid {', '.join(was)})" if was else ""))
        cluster.save()
        if purge:
            for name in cluster.regions:
                shutil.rmtree(home / name, ignore_errors=True)
            shutil.rmtree(home / "mirror", ignore_errors=True)
            shutil.rmtree(home / "wan", ignore_errors=True)
            cluster.state_file.unlink(missing_ok=True)
            log(f"purged {home}")
