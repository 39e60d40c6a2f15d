"""Shared plumbing for benchmarks: a broker to measure against, medians, JSON output, and the
kept result of a run (``results/bench-NAME.json`` with the machine it ran on and its
provenance), written only when asked: ``--save``, or ``$RLSTREAM_RESULTS`` naming the folder."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def local_cluster(
    args: Any,
    regions: tuple[str, ...] = ("trainer",),
    *,
    reuse_default: bool = True,
    heap: str = "1g",
    brokers: int = 1,
    link: Any = None,
) -> Iterator[Any]:
    """The local cluster (``ops.cluster.Cluster``) a benchmark runs on: the one at ``--home``
    when given (its ``regions``, and the links between them, must be running: an error says
    so otherwise); else, with ``reuse_default``, the default home's cluster when those run
    there; else a temporary one, started in its own state directory and stopped (by pid) at
    the end. Benchmarks that break brokers pass ``reuse_default=False``: they touch a user's
    cluster only when named. ``link`` (``cluster.LinkSpec``): the regions joined by a WAN; a
    named cluster must have one already (the bench sets its round trip)."""
    from rlstream.ops import cluster

    def ready(local: Any) -> bool:
        links = [r for r in regions if r != "trainer"]
        running = set(local.running_regions())
        wan_ok = link is None or (local.wan is not None and local.wan.running())
        return wan_ok and set(regions) <= running and all(local.link_running(r) for r in links)

    home = getattr(args, "home", None)
    if home or reuse_default:
        local = cluster.load(Path(home) if home else None)
        if ready(local):
            yield local
            return
        if home:
            raise SystemExit(
                f"error: {', '.join(regions)} (and their links) are not running in {home}; "
                f"start them with `rlstream cluster --home {home} up --regions {','.join(regions)}`"
            )
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-") as tmp:
        temp = Path(tmp) / "cluster"
        progress(f"starting a temporary local cluster ({', '.join(regions)}) for the benchmark ...")
        state = cluster.up(
            list(regions), home=temp, heap=heap, log=lambda *_: None, brokers=brokers, link=link
        )
        try:
            yield state
        finally:
            cluster.down(home=temp, purge=True, log=lambda *_: None)


@contextlib.contextmanager
def bench_kafka(args: Any) -> Iterator[Any]:
    """Settings for the cluster named by ``--bootstrap`` or the environment, else the trainer
    region of ``local_cluster``."""
    with bench_broker(args) as (settings, _):
        yield settings


@contextlib.contextmanager
def bench_broker(args: Any) -> Iterator[tuple[Any, int | None]]:
    """``bench_kafka``'s settings with the broker's pid when it is a local cluster's (None for a
    cluster named by its bootstrap address: the bench cannot see its process)."""
    from rlstream.producers.client.settings import KafkaSettings

    settings = KafkaSettings.from_env(getattr(args, "bootstrap", None))
    if settings is not None:
        yield settings, None
        return
    with local_cluster(args) as local:
        yield local.settings("trainer"), local.regions["trainer"].pid


def jit_cpu_seconds(pid: int) -> float | None:
    """CPU seconds the JVM ``pid``'s JIT compiler threads (``C1/C2 CompilerThread``) have used,
    from ``/proc/PID/task``; None where that cannot be read (not Linux, not our process).

    A freshly started broker compiles its hot paths during its first tens of thousands of
    records, at up to half a core on a small machine: a measurement taken then measures the
    compiler, not the broker."""
    ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, _, rest = stat[stat.index("(") + 1 :].rpartition(")")
        if "CompilerThre" in name:
            fields = rest.split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / ticks_per_s


def run_signer(settings: Any, run: str) -> Any:
    """The bench run's weight signer: its key made and recorded in the run manifest at the
    run's first start, as a learner does (``consumers.weights.trust.ensure_run_key``), kept in
    the temporary folder; the bench's readers verify every manifest with it."""
    from rlstream.consumers.weights.trust import ensure_run_key
    from rlstream.producers.weights.signing import KEY_FILE

    path = Path(tempfile.gettempdir()) / "rlstream-bench-keys" / run / KEY_FILE
    return ensure_run_key(settings, run, path)


def bf16_bits(w: Any) -> Any:
    """bf16 bit patterns (uint16, flat) of finite fp32 values, rounded to nearest even as torch
    rounds; a benchmark's synthetic weights go through it."""
    import numpy as np

    u = np.ascontiguousarray(w, np.float32).reshape(-1).view(np.uint32)
    t = (u >> 16) & np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u
    t >>= 16
    return t.astype(np.uint16)


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def median_ci95(values: list[float]) -> list[float]:
    """A distribution-free 95% interval of the median of ``values`` from their order statistics
    (the binomial approximation; about 93% coverage at 8 values, 96% at 20)."""
    n, ranked = len(values), sorted(values)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return [ranked[k], ranked[min(n - 1, n - 1 - k)]]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[index])


_load_before: tuple[float, float, float] | None = None
_keep: bool | str = False  # True, or the name to keep the result under (``--save-as``)
_code_before: dict[str, Any] | None = None  # ``code_state`` as a kept bench started
#: The top-level keys ``save`` writes: any other one was added by hand (``bench table --check``).
SAVED_KEYS = frozenset(
    {"bench", "measured_at", "command", "machine", "load_average", "result", "provenance"}
)
#: Paths whose changes do not make a tree dirty for a measurement: the kept results themselves
#: and prose (git pathspecs).
NOT_CODE = (":(exclude)results", ":(exclude)*.md")


def mark_start(keep: bool | str = False) -> None:
    """Remember the machine's load average as the bench starts (``rlstream bench`` calls it
    before any bench runs); ``save`` records it with the load average at the end. ``keep``:
    the result is kept (``--save``), under that name when it is one (``--save-as``)."""
    global _load_before, _keep, _code_before
    _load_before, _keep = _loadavg(), keep
    _code_before = code_state() if keep else None


def _loadavg() -> tuple[float, float, float] | None:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # not available on this platform
        return None
    return round(one, 2), round(five, 2), round(fifteen, 2)


def emit(result: dict[str, Any], as_json: bool, lines: list[str], name: str | None = None) -> None:
    """Human lines first; with ``as_json`` the JSON object is the last stdout line. With a
    ``name`` the result is also kept (``save``) when asked: ``--save``, or
    ``$RLSTREAM_RESULTS`` set."""
    for line in lines:
        print(line)
    if name is not None and (_keep or os.environ.get("RLSTREAM_RESULTS")):
        kept = save(name, result, _keep if isinstance(_keep, str) else None)
        progress(f"result kept in {kept}")
    elif name is not None:
        progress("result not kept (--save keeps it in results/)")
    if as_json:
        print(json.dumps(result))


def save(name: str, result: dict[str, Any], file_name: str | None = None) -> Path:
    """Write bench ``name``'s ``result`` with the machine's description and its provenance, as
    ``bench-NAME.json`` (``file_name`` instead of ``name`` when given); returns the path."""
    folder = Path(os.environ.get("RLSTREAM_RESULTS") or "results")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench-{file_name or name}.json"
    found = machine()
    load = {"before": _load_before, "after": _loadavg()}
    record = {
        "bench": name,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["rlstream", *sys.argv[1:]]),
        "machine": found,
        # 1, 5 and 15 minutes, when the bench started and when its result was kept
        "load_average": load,
        "result": result,
        "provenance": provenance(result, found, load),
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def result_hash(result: dict[str, Any]) -> str:
    """SHA-256 of ``result`` in canonical JSON: a kept result edited afterwards no longer
    matches the hash its provenance recorded."""
    text = json.dumps(result, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def code_state() -> dict[str, Any]:
    """The code as it is now: the full commit, whether it differs from it (``dirty``: tracked
    or untracked changes outside ``NOT_CODE``) and the hash of that difference."""
    commit, diff = _git("rev-parse", "HEAD"), _git("diff", "HEAD", "--", ".", *NOT_CODE)
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", ".", *NOT_CODE)
    dirty = None if commit is None else bool(diff or untracked)
    changed = (diff or "") + (untracked or "")
    digest = hashlib.sha256(changed.encode()).hexdigest()[:16] if dirty else None
    return {"commit": commit, "dirty": dirty, "diff_hash": digest}


def provenance(
    result: dict[str, Any], found: dict[str, Any] | None = None, load: Any = None
) -> dict[str, Any]:
    """Where ``result`` came from: the code it ran (``code_state`` as the bench started, when
    ``rlstream bench`` marked its start; else now), ``code_at_end`` when the code changed while
    it ran, the machine in one line, the load average, and the result's own hash."""
    found = found or machine()
    now = code_state()
    ran = _code_before or now
    return {
        **ran,
        **({"code_at_end": now} if now != ran else {}),
        "machine": f"{found.get('cpu')}, {found.get('cores')} cores, "
        f"{found.get('memory_gb')} GiB, Python {found.get('python')}",
        "load": load,
        "result_sha256": result_hash(result),
    }


def _git(*args: str) -> str | None:
    """``git ARGS`` in the repository this code runs from: its output, None without git."""
    try:
        out = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=Path(__file__).resolve().parents[2],
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (read from its metadata: nothing imported)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, OS, Python, key libraries, commit."""
    import numpy
    import zstandard

    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_gb = round(
            int(next(ln for ln in meminfo if ln.startswith("MemTotal")).split()[1]) / 2**20, 1
        )
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "zstandard": zstandard.__version__,
        # the policy's numerics (and so its samples and success rates) follow these two
        **{name: _version(name) for name in ("torch", "transformers")},
        "commit": _commit(),
    }


def _commit() -> str | None:
    return _git("rev-parse", "--short", "HEAD") or None
