"""A WAN between regions on one machine: the trainer region reached from a rollout region only
through a link with a set round trip and bandwidth.

The link is Toxiproxy (Shopify's TCP fault proxy, a Go program installed once with ``go install``
into the per-user cache, as the Kafka jars are): one proxy per broker of either region per link,
each with a latency toxic of half the round trip on both directions and, when a rate is set, a
bandwidth toxic on both. Each trainer broker has one extra listener per link (``LINK_<REGION>``)
that advertises the proxy's address, so a client that bootstraps through the link is told the
link's address for every broker and never reaches the trainer region around it; each rollout
broker likewise has one (``LINK_<TRAINER>``) for the way back. The link's two MirrorMaker 2
processes each run in the region they write to and reach the other region only through the
link, so every byte between the regions crosses it, as remote fetches: weights and tasks
fetched from the trainer region, trajectories fetched home (``cluster._link_processes``).

Rules:
- the round trip a run sees is measured, not assumed (``measure_rtt_ms``: Kafka ApiVersions
  requests over one connection through the link, the median);
- a cut (``cut``) is a black hole, not a reset: a timeout toxic of 0 on both directions drops
  every byte and keeps every connection open, as a partition does, so clients learn of it only
  by their own timeouts; ``heal`` removes it, which closes the connections it held and lets
  clients reconnect (``cluster.heal_link`` also restarts the link's MirrorMaker, see there);
- the bandwidth toxic limits each connection, not the link as a whole (Toxiproxy has no shared
  limit); MirrorMaker holds one connection per trainer broker for each direction's bulk data.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlstream.ops.cluster import artifacts, procs
from rlstream.producers.runtime.ports import free_port
from rlstream.schemas.errors import SetupError

MARKER = artifacts.TOXIPROXY  # in the binary's path: procs.alive knows the process by it


@dataclass(frozen=True)
class LinkSpec:
    """What a link between two regions is: a round trip and a per-connection rate (None:
    unlimited)."""

    rtt_ms: float
    mbit: float | None = None

    def __post_init__(self) -> None:
        if self.rtt_ms < 0:
            raise ValueError(f"a link's round trip is >= 0 ms, not {self.rtt_ms}")
        if self.mbit is not None and self.mbit <= 0:
            raise ValueError(f"a link's rate is > 0 Mbit/s, not {self.mbit}")


@dataclass
class Wan:
    """The Toxiproxy server of a cluster and the link it models; persisted in cluster.json."""

    home: str
    api_port: int
    rtt_ms: float
    mbit: float | None = None
    pid: int | None = None

    @property
    def dir(self) -> Path:
        return Path(self.home) / "wan"

    @property
    def spec(self) -> LinkSpec:
        return LinkSpec(self.rtt_ms, self.mbit)

    def running(self) -> bool:
        return procs.alive(self.pid, MARKER)

    def to_dict(self) -> dict:
        return asdict(self)


def listener_name(region: str) -> str:
    """The trainer brokers' listener for ``region``'s link (Kafka listener names: A-Z, 0-9, _)."""
    return "LINK_" + "".join(c if c.isalnum() else "_" for c in region.upper())


def start(home: Path, spec: LinkSpec, timeout: float = 30.0) -> Wan:
    wan = Wan(home=str(home), api_port=free_port(), rtt_ms=spec.rtt_ms, mbit=spec.mbit)
    wan.dir.mkdir(parents=True, exist_ok=True)
    # argv[0] names the process MARKER, so procs.alive and procs.stop know it is ours
    cmd = [str(artifacts.toxiproxy_binary()), "-host", "127.0.0.1", "-port", str(wan.api_port)]
    proc = procs.spawn(cmd, wan.dir / "toxiproxy.log", cwd=wan.dir)
    wan.pid = proc.pid
    try:
        _wait_started(wan, proc, timeout)
    except BaseException:
        stop(wan)  # never leave a half-started proxy behind
        raise
    return wan


def _wait_started(wan: Wan, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SetupError(
                f"Toxiproxy exited during start-up:\n{procs.tail(wan.dir / 'toxiproxy.log')}"
            )
        try:
            _api(wan, "GET", "/version")
            return
        except OSError:
            time.sleep(0.2)
    raise SetupError(f"Toxiproxy did not answer on 127.0.0.1:{wan.api_port} within {timeout}s")


def stop(wan: Wan) -> None:
    if wan.pid:
        procs.stop(wan.pid, MARKER)
    wan.pid = None


def ensure_proxies(wan: Wan, region: str, hops: list[tuple[int, int]]) -> None:
    """The proxies of ``region``'s link, one per trainer broker ``(listen port, upstream port)``,
    created if missing, with the toxics of ``wan.spec`` (replaced when the spec changed)."""
    have = {p["name"]: p for p in _api(wan, "GET", "/proxies").values()}
    for index, (listen, upstream) in enumerate(hops):
        name = f"{region}-{index + 1}"
        if name not in have:
            _api(
                wan,
                "POST",
                "/proxies",
                {
                    "name": name,
                    "listen": f"127.0.0.1:{listen}",
                    "upstream": f"127.0.0.1:{upstream}",
                    "enabled": True,
                },
            )
        _set_toxics(wan, name, _toxics(wan.spec))


def _toxics(spec: LinkSpec) -> dict[str, dict[str, Any]]:
    toxics: dict[str, dict[str, Any]] = {}
    for stream in ("upstream", "downstream"):
        toxics[f"latency-{stream}"] = {
            "type": "latency",
            "stream": stream,
            "attributes": {"latency": round(spec.rtt_ms / 2), "jitter": 0},
        }
        if spec.mbit is not None:
            toxics[f"bandwidth-{stream}"] = {
                "type": "bandwidth",
                "stream": stream,
                "attributes": {"rate": max(1, round(spec.mbit * 1e6 / 8 / 1000))},  # KB/s
            }
    return toxics


def _set_toxics(wan: Wan, proxy: str, wanted: dict[str, dict[str, Any]]) -> None:
    """Make the proxy's toxics exactly ``wanted`` (a cut's black hole included if named)."""
    have = {t["name"]: t for t in _api(wan, "GET", f"/proxies/{proxy}/toxics")}
    for name in have.keys() - wanted.keys():
        _api(wan, "DELETE", f"/proxies/{proxy}/toxics/{name}")
    for name, toxic in wanted.items():
        current = have.get(name)
        if current is None:
            _api(wan, "POST", f"/proxies/{proxy}/toxics", {"name": name, **toxic})
        elif current["attributes"] != toxic["attributes"]:
            _api(
                wan, "POST", f"/proxies/{proxy}/toxics/{name}", {"attributes": toxic["attributes"]}
            )


def _proxies_of(wan: Wan, region: str) -> list[str]:
    names = [p["name"] for p in _api(wan, "GET", "/proxies").values()]
    found = sorted(n for n in names if n.rsplit("-", 1)[0] == region)
    if not found:
        raise SetupError(f"region {region} has no WAN link (proxies: {sorted(names)})")
    return found


def cut(wan: Wan, region: str) -> None:
    """Drop every byte between ``region`` and the trainer region until ``heal``."""
    for proxy in _proxies_of(wan, region):
        wanted = _toxics(wan.spec)
        for stream in ("upstream", "downstream"):
            wanted[f"cut-{stream}"] = {
                "type": "timeout",
                "stream": stream,
                "attributes": {"timeout": 0},
            }
        _set_toxics(wan, proxy, wanted)


def heal(wan: Wan, region: str) -> None:
    for proxy in _proxies_of(wan, region):
        _set_toxics(wan, proxy, _toxics(wan.spec))


def is_cut(wan: Wan, region: str) -> bool:
    toxics = _api(wan, "GET", f"/proxies/{_proxies_of(wan, region)[0]}/toxics")
    return any(t["name"].startswith("cut-") for t in toxics)


def measure_rtt_ms(port: int, samples: int = 20, timeout: float = 10.0) -> float:
    """The median round trip of a Kafka ApiVersions request (v0) through ``port``, over one
    connection (its set-up excluded): what a client across the link waits per request."""
    request = struct.pack(">hhi", 18, 0, 0) + struct.pack(">h", -1)  # key, version, id, no client
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(samples + 1):
            body = request[:4] + struct.pack(">i", i) + request[8:]
            t0 = time.perf_counter()
            conn.sendall(struct.pack(">i", len(body)) + body)
            size = struct.unpack(">i", _recv(conn, 4))[0]
            _recv(conn, size)
            if i:  # the first pays for the broker's connection set-up
                times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _recv(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the link closed the connection")
        data += chunk
    return data


def _api(wan: Wan, method: str, path: str, body: dict | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{wan.api_port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            text = response.read()
    except urllib.error.HTTPError as exc:
        raise SetupError(
            f"Toxiproxy refused {method} {path}: {exc.code} {exc.read().decode(errors='replace')}"
        ) from exc
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:  # /version answers plain text
        return text.decode(errors="replace")
