"""``rlstream bench tidal``: a compressed day of serving load on two rollout regions whose serving
engines roll out while serving is quiet, against dedicated rollout capacity only and a naive
lend-everything policy.

What is real: three Kafka clusters (trainer, eu, us) with MirrorMaker 2 between them; the run's
learner, admission, a judge and the scheduler; each region's capacity role; rollout workers (the
product's role, each its own process) that join and leave with the signal, hand reclaimed groups
on as checkpoints and resume them. What is emulated, because this machine has no GPUs: each
engine's speed (``tidal_worker``: a fixed number of decode steps a second, so the rollout rate
grows with the engines rolling out, not with two shared cores) and the serving side
(``ServingFleet``: requests arrive as a Poisson process following the trace, each takes
``--service-s`` on one of the region's engines that serve, first come first served; its
``/metrics`` are real HTTP in vLLM's names, read by the capacity role as from a vLLM fleet).

Arms, per seed, interleaved: ``dedicated`` (only the dedicated rollout workers; every serving
engine serves), ``tidal`` (the capacity role's rule: headroom, ``min_serving``, the p99 guard),
``naive`` (every engine the load leaves idle this second is lent: no headroom, no guard).

Figures (per arm, medians over seeds): trained samples per hour of dedicated rollout capacity
(the dedicated workers' hours), serving p99 and its 1-second windows over the SLO, groups lost
(released in the day, undecided after the drain) and decided twice, the share of generated
tokens generated again, groups preempted and resumed, and the share of the engine-time the trace
leaves idle that lent workers spent rolling out.

Details: docs/benchmarks.md (bench tidal), docs/capacity.md.
"""

from __future__ import annotations

import argparse
import collections
import http.server
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlstream.ops.bench.common import emit, local_cluster, median, percentile, progress

ARMS = ("dedicated", "tidal", "naive")
REGIONS = ("eu", "us")
#: 1-second windows of serving latency: a window whose p99 is over the SLO is a violation.
WINDOW_S = 1.0


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tidal", help="rollouts on the serving fleet's idle engines over a day")
    p.add_argument("--seeds", type=int, default=3, help="runs of each arm")
    p.add_argument("--arms", default=",".join(ARMS), help="arms to run, comma-separated")
    p.add_argument("--day-s", type=float, default=240.0, help="wall seconds of the trace's day")
    p.add_argument(
        "--drain-s",
        type=float,
        default=300.0,
        help="most seconds after the day to decide its groups",
    )
    p.add_argument("--engines", type=int, default=8, help="serving engines per region")
    p.add_argument("--dedicated", type=int, default=1, help="dedicated rollout workers a region")
    p.add_argument("--steps-per-s", type=float, default=8.0, help="an engine's decode steps/s")
    p.add_argument("--service-s", type=float, default=0.25, help="one serving request's time")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="serving p99 bound, ms")
    p.add_argument("--headroom", type=float, default=0.2, help="the tidal arm's headroom")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--trace", default=None, help="trace CSV (default: the shipped diurnal day)")
    p.add_argument("--home", default=None, help="a running 3-region local cluster's state dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"error: unknown arms {sorted(unknown)} (known: {', '.join(ARMS)})")
    result = run(args, arms)
    emit(result, args.json, _lines(result), name="tidal")
    return 0


def run(args: argparse.Namespace, arms: list[str]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with (
        local_cluster(args, ("trainer", *REGIONS), reuse_default=False, heap="384m") as local,
        tempfile.TemporaryDirectory(prefix="rlstream-tidal-") as tmp,
    ):
        for seed in range(args.seeds):
            for arm in arms:  # interleaved: the machine's drift hits every arm alike
                one = Arm(args, local, Path(tmp), arm, seed).run()
                runs[arm].append(one)
                progress(f"  {arm} seed {seed}: {_brief(one)}")
    return {
        "trace": Path(args.trace).name if args.trace else "diurnal (synthetic, shipped)",
        "day_s": args.day_s,
        "engines_per_region": args.engines,
        "dedicated_per_region": args.dedicated,
        "regions": list(REGIONS),
        "steps_per_s": args.steps_per_s,
        "service_s": args.service_s,
        "slo_p99_ms": args.slo_ms,
        "headroom": args.headroom,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "arms": {arm: _summary(rs) for arm, rs in runs.items()},
        "ratio": _ratios(runs),
    }


# --- the emulated serving side -------------------------------------------------------------


class ServingFleet:
    """One region's serving engines, emulated (see the module docstring): Poisson arrivals at
    ``load(t) * engines / service_s`` a second, served first come first served by the engines
    not lent (``lent()``; slots ``0..lent-1`` roll out). ``GET /metrics`` answers vLLM's running
    and waiting counts and its e2e latency histogram."""

    TICK_S = 0.02

    def __init__(
        self,
        engines: int,
        service_s: float,
        load: Callable[[float], float],
        lent: Callable[[], int],
        seed: int,
    ) -> None:
        from rlstream.rollout.serve import LATENCY_BUCKETS

        self.engines, self.service_s, self.load, self.lent = engines, service_s, load, lent
        self.rng = random.Random(seed)
        self.queue: collections.deque[float] = collections.deque()  # arrival times
        self.free_at = [0.0] * engines
        self.done: list[tuple[float, float]] = []  # (finished, latency s)
        self.buckets = [*LATENCY_BUCKETS, math.inf]
        self.counts = [0] * len(self.buckets)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = time.time()
        self.server: http.server.ThreadingHTTPServer | None = None
        self.url = ""

    def start(self) -> ServingFleet:
        """Serve ``/metrics`` on a port of its own and tick every ``TICK_S``."""
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self._last = time.time()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.TICK_S):
            self.tick(time.time())

    def tick(self, now: float) -> None:
        """Arrivals since the last tick join the queue; free serving engines take from it."""
        dt, self._last = now - self._last, now
        rate = max(0.0, self.load(now)) * self.engines / self.service_s
        arrivals = _poisson(self.rng, rate * dt)
        with self._lock:
            self.queue.extend(sorted(now - self.rng.random() * dt for _ in range(arrivals)))
            serving = range(min(self.lent(), self.engines), self.engines)
            for e in serving:
                while self.queue and self.free_at[e] <= now:
                    arrived = (
                        self.queue.popleft()
                    )  # it starts when both it and the engine were there
                    finished = max(arrived, self.free_at[e]) + self.service_s
                    self.free_at[e] = finished
                    latency = finished - arrived
                    self.done.append((finished, latency))
                    self.counts[next(i for i, b in enumerate(self.buckets) if latency <= b)] += 1

    def metrics(self, now: float) -> str:
        with self._lock:
            running = sum(1 for f in self.free_at if f > now)
            waiting = len(self.queue)
            finished = [0] * len(self.buckets)  # only what has finished by now, cumulative
            for at, latency in self.done:
                if at <= now:
                    finished[next(i for i, b in enumerate(self.buckets) if latency <= b)] += 1
        lines = [
            f'vllm:num_requests_running{{model_name="fleet"}} {running}',
            f'vllm:num_requests_waiting{{model_name="fleet"}} {waiting}',
        ]
        total = 0
        for bound, count in zip(self.buckets, finished, strict=True):
            total += count
            le = "+Inf" if math.isinf(bound) else f"{bound}"
            lines.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{le}"}} {total}')
        return "\n".join(lines) + "\n"

    def windows(self, start: float, end: float) -> list[float]:
        """The p99 latency (ms) of each ``WINDOW_S`` window in ``[start, end)`` by finish time
        (windows where nothing finished are left out)."""
        by: dict[int, list[float]] = collections.defaultdict(list)
        with self._lock:
            for at, latency in self.done:
                if start <= at < end:
                    by[int((at - start) // WINDOW_S)].append(latency * 1000)
        return [percentile(v, 99) for _, v in sorted(by.items())]

    def latencies_ms(self, start: float, end: float) -> list[float]:
        with self._lock:
            return [lat * 1000 for at, lat in self.done if start <= at < end]

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        fleet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = fleet.metrics(time.time()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method: the means here are small, a tick's arrivals)."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


# --- one arm of one seed -------------------------------------------------------------------


class Arm:
    """One run of one arm on the shared 3-region cluster."""

    def __init__(
        self, args: argparse.Namespace, local: Any, tmp: Path, arm: str, seed: int
    ) -> None:
        self.args, self.local, self.arm, self.seed = args, local, arm, seed
        self.run_name = f"bench-tidal-{arm}-s{seed}-{uuid.uuid4().hex[:6]}"
        self.out = tmp / self.run_name
        (self.out / "logs").mkdir(parents=True)
        self.lent = arm != "dedicated"

    def recipe(self, origin_ms: int) -> Path:
        a, lent = self.args, self.lent
        guard = (
            {"headroom": a.headroom, "min_serving": 1, "slo_p99_ms": a.slo_ms, "cooldown_s": 10.0}
            if self.arm == "tidal"
            else {"headroom": 0.0, "min_serving": 0, "slo_p99_ms": 1e12, "cooldown_s": 0.0}
        )
        capacity = {
            "engines": a.engines,
            "dedicated": a.dedicated,
            "interval_s": 1.0,
            "raise_step": a.engines,
            "slots_per_engine": 1,
            "time_scale": 86400.0 / a.day_s,
            "trace_origin_ms": origin_ms,
            **guard,
        }
        if a.trace:
            capacity["trace"] = str(Path(a.trace).resolve())
        text = f"""
seed = {self.seed}
group_size = {a.group_size}
groups_per_step = {a.groups_per_step}
max_staleness = 4

[regions]
rollout = ["eu", "us"]

[scheduler]
max_turns = 0
max_tasks = 1000000
reissue_after_s = 120.0
follow_capacity = {"true" if lent else "false"}
min_lease_s = 5.0

[rollout]
torch_threads = 1
[rollout.harness]
max_new_tokens = {a.max_new_tokens}

[learner.warm_start]
steps = 0

[admission]
reject_no_signal = false
timeout_s = 600.0

[judges.format]
kind = "format"

[capacity]
{_toml_table(capacity)}
"""
        path = self.out / "recipe.toml"
        path.write_text(text)
        return path

    def run(self) -> dict[str, Any]:
        from rlstream.consumers.capacity_log import CapacityView
        from rlstream.ops.demo import demo
        from rlstream.rollout.capacity import DIURNAL_TRACE, TraceLoad

        a = self.args
        count = len(REGIONS) * (a.dedicated + (a.engines if self.lent else 0))
        origin = time.time() + 60.0 + 4.0 * count  # the day starts once every worker is up
        recipe = self.recipe(int(origin * 1000))
        home = self.local.home
        settings = {r: self.local.settings(r) for r in ("trainer", *REGIONS)}
        key_file = self.out / "learner-key" / "run.pem"
        keys = demo.sign_weights(settings["trainer"], self.run_name, key_file, False)
        shared = ["--config", str(recipe)]
        trace = TraceLoad(Path(a.trace) if a.trace else DIURNAL_TRACE, 1, 86400.0 / a.day_s, origin)
        views = (
            {
                r: CapacityView.for_role(settings[r], self.run_name, _regions(), r, stale_s=10.0)
                for r in REGIONS
            }
            if self.lent
            else {}
        )

        def load(now: float) -> float:
            return trace.at((now - origin) * trace.scale)

        def lent_in(region: str) -> Callable[[], int]:
            view = views.get(region)
            return (lambda: view.lent(region)) if view is not None else (lambda: 0)

        fleets = {
            r: ServingFleet(
                a.engines, a.service_s, load, lent_in(r), zlib.crc32(f"{self.seed}/{r}".encode())
            ).start()
            for r in REGIONS
        }
        roles: list[Any] = []
        workers: dict[str, subprocess.Popen[bytes]] = {}
        logs = self.out / "logs"

        def start(role: str, region: str, name: str, *more: str) -> None:
            roles.append(
                demo.start_role(
                    role, self.run_name, settings[region], logs, [*more, *shared], name,
                    region=region, home=home, env=keys.env(role),
                )
            )  # fmt: skip

        try:
            progress(f"run {self.run_name}: {self.arm}, seed {self.seed}; logs in {logs}")
            start("learner", "trainer", "learner")
            start("admission", "trainer", "admission")
            start("judge", "trainer", "judge-format", "--name", "format")
            for r in REGIONS if self.lent else ():
                metrics = f'capacity.metrics_urls=["{fleets[r].url}"]'
                start("capacity", r, f"capacity-{r}", "--set", metrics)
            for r in REGIONS:
                for i in range(a.dedicated):
                    workers[f"{r}-d{i}"] = self._worker(r, f"d{i}", False, shared, keys, home)
                for slot in range(a.engines if self.lent else 0):
                    workers[f"{r}-{slot}"] = self._worker(r, str(slot), True, shared, keys, home)
            start("scheduler", "trainer", "scheduler")
            _sleep_until(origin, roles, workers)
            at_start = self._tallies()
            progress(f"  the day starts: {a.day_s:.0f} s ...")
            _sleep_until(origin + a.day_s, roles, workers, report=lambda: self._report(views))
            at_end = self._tallies()
            progress(f"  draining: the day's groups decided, or {a.drain_s:.0f} s ...")
            self._drain(settings["trainer"], origin + a.day_s, roles, workers)
            return self._figures(settings["trainer"], fleets, trace, origin, at_start, at_end)
        finally:
            for proc in workers.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in workers.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            demo.stop_roles(roles)
            for fleet in fleets.values():
                fleet.close()
            for view in views.values():
                view.close()

    def _worker(
        self, region: str, member: str, lent: bool, shared: list[str], keys: Any, home: Path
    ) -> subprocess.Popen[bytes]:
        import os

        status = self.out / f"worker-{region}-{member}.json"
        cmd = [
            sys.executable, "-m", "rlstream.ops.bench.tidal_worker",
            "--steps-per-s", str(self.args.steps_per_s), "--status", str(status),
            "--run", self.run_name, "--region", region, "--home", str(home), "--member", member,
            *(["--set", "rollout.lent=true"] if lent else []), *shared,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **keys.env("rollout")}
        log = open(self.out / "logs" / f"worker-{region}-{member}.log", "ab")  # noqa: SIM115
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _drain(self, settings: Any, end: float, roles: list[Any], workers: dict[str, Any]) -> None:
        """Keep the run going until every group released in the day is decided (the workers
        still have the groups queued in their partitions then) or ``--drain-s`` passed."""
        deadline = time.time() + self.args.drain_s
        while time.time() < deadline:
            ledger = read_ledger(settings, self.run_name, tokens=False)
            day = [g for g, t in ledger["first_release_ms"].items() if t < end * 1000]
            left = [g for g in day if not ledger["decisions"].get(g)]
            if not left:
                return
            _sleep_until(min(deadline, time.time() + 5.0), roles, workers)

    def _tallies(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path in self.out.glob("worker-*.json"):
            try:
                out[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def _report(self, views: dict[str, Any]) -> str:
        lent = {r: v.lent(r) for r, v in views.items()}
        return f"lent {lent}" if lent else "dedicated only"

    def _figures(
        self,
        settings: Any,
        fleets: dict[str, ServingFleet],
        trace: Any,
        origin: float,
        at_start: dict[str, dict[str, Any]],
        at_end: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        from rlstream.ops.bench.asyncrl import commits_ms

        a = self.args
        end = origin + a.day_s
        commits = commits_ms(settings, self.run_name)
        in_day = [v for v, ms in commits.items() if origin * 1000 <= ms < end * 1000 and v > 0]
        trained = len(in_day) * a.groups_per_step * a.group_size
        dedicated_hours = len(REGIONS) * a.dedicated * a.day_s / 3600
        windows = [w for f in fleets.values() for w in f.windows(origin, end)]
        latencies = [x for f in fleets.values() for x in f.latencies_ms(origin, end)]
        ledger = read_ledger(settings, self.run_name)
        released_in_day = {g for g, t in ledger["first_release_ms"].items() if t < end * 1000}
        decided = ledger["decisions"]
        lost = sorted(g for g in released_in_day if not decided.get(g))
        twice = sorted(g for g, n in decided.items() if n > 1)
        busy = sum(
            at_end.get(k, {}).get("busy_s", 0.0) - at_start.get(k, {}).get("busy_s", 0.0)
            for k in at_end
            if at_end[k].get("lent")
        )
        idle = (
            len(REGIONS)
            * a.engines
            * sum((1.0 - trace.at((t + 0.5) * trace.scale)) for t in range(int(a.day_s)))
        )  # engine-seconds the trace leaves idle over the day
        return {
            "run": self.run_name,
            "trained_samples": trained,
            "samples_per_dedicated_hour": trained / dedicated_hours,
            "serving_p99_ms": percentile(latencies, 99) if latencies else None,
            "slo_violations_p99": sum(1 for w in windows if w > a.slo_ms),
            "windows": len(windows),
            "groups_released": len(released_in_day),
            "groups_lost": len(lost),
            "groups_decided_twice": len(twice),
            "regenerated_token_fraction": ledger["regenerated_token_fraction"],
            "preempted": ledger["preempted"],
            "resumed": ledger["resumed"],
            "idle_capacity_used": busy / idle if idle > 0 else 0.0,
            "lent_busy_s": busy,
            "idle_engine_s": idle,
        }


def read_ledger(settings: Any, run: str, tokens: bool = True) -> dict[str, Any]:
    """What the run's streams say at home: each group's first release, its decisions, the
    reclaimed groups and resumed releases, and (``tokens``) the tokens generated again (module
    docstring)."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.rollout.checkpoint import GroupCheckpoint
    from rlstream.schemas import arrays, events, topics

    def records(stream: str, sources: tuple[str | None, ...] = (None,)) -> list[dict[str, Any]]:
        out = []
        for source in sources:
            topic = topics.remote_topic(source, topics.topic_name(run, stream))
            for msg in read_topic(settings, topic, name="bench-tidal"):
                out.append(events.decode(msg.value() or b"").record)
        return out

    home = (None, *REGIONS)
    first: dict[str, int] = {}
    resumed = 0
    for task in records("tasks"):
        first.setdefault(task["task_id"], int(task["created_ms"]))
        resumed += task.get("checkpoint") is not None
    decisions: collections.Counter[str] = collections.Counter()
    for stream in ("admitted", "rejected"):
        for rec in records(stream):
            if int(rec.get("part_index") or 0) == 0:
                decisions[rec["group_id"]] += 1
    if not tokens:
        return {"first_release_ms": first, "decisions": dict(decisions)}
    cuts: dict[str, list[GroupCheckpoint]] = collections.defaultdict(list)
    for rec in records("preempted", home):
        cuts[rec["group_id"]].append(GroupCheckpoint.from_bytes(rec["checkpoint"]))
    copies: dict[str, dict[tuple[str, int], list[Any]]] = collections.defaultdict(dict)
    for rec in records("trajectories", home):
        key = (rec["worker_id"], int(rec["timings"]["started_ms"]))
        copies[rec["group_id"]].setdefault(key, []).append(arrays.unpack_tokens(rec))
    total = wasted = 0
    for group in decisions:
        spent, useful = _group_tokens(copies.get(group, {}), cuts.get(group, []))
        total += spent
        wasted += max(0, spent - useful)
    return {
        "first_release_ms": first,
        "decisions": dict(decisions),
        "preempted": sum(len(c) for c in cuts.values()),
        "resumed": resumed,
        "regenerated_token_fraction": wasted / total if total else 0.0,
    }


def _group_tokens(copies: dict[tuple[str, int], list[Any]], cuts: list[Any]) -> tuple[int, int]:
    """(tokens generated for a group, tokens of one complete copy): a sample's tokens carried
    from a checkpoint (its prefix) count once, where they were generated."""
    import numpy as np

    rows = [(i, row) for ck in cuts for i, row in enumerate(ck.rows)]

    def carried(index: int, ids: Any, own: Any = None) -> int:
        best = 0
        for i, row in rows:
            fits = i == index and row is not own and len(row.tokens) <= len(ids)
            if fits and np.array_equal(ids[: len(row.tokens)], row.tokens):
                best = max(best, row.generated)
        return best

    spent = 0
    for i, row in rows:  # what each checkpoint added to the one it resumed from
        spent += row.generated - carried(i, row.tokens, own=row)
    useful = None
    for samples in copies.values():
        size = 0
        for index, sample in enumerate(samples):
            generated = int(sample.loss_mask.sum())
            spent += generated - carried(index, sample.token_ids)
            size += generated
        useful = size if useful is None else useful
    return spent, useful or 0


def _regions() -> Any:
    from rlstream.schemas import topics

    return topics.Regions("trainer", REGIONS)


def _toml_table(values: dict[str, Any]) -> str:
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items())


def _sleep_until(
    when: float,
    roles: list[Any],
    workers: dict[str, Any],
    report: Callable[[], str] | None = None,
) -> None:
    """Wait until ``when``, failing as soon as a process we started exited."""
    last = 0.0
    while time.time() < when:
        dead = [r.name for r in roles if r.proc.poll() is not None]
        dead += [k for k, p in workers.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"exited before the end: {dead} (see the logs)")
        if report is not None and time.monotonic() - last > 15:
            last = time.monotonic()
            progress(f"    {max(0.0, when - time.time()):.0f} s left; {report()}")
        time.sleep(min(1.0, max(0.0, when - time.time())))


# --- the figures ---------------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return median(values) if values else None

    return {
        "samples_per_dedicated_hour": med("samples_per_dedicated_hour"),
        "slo_violations_p99": med("slo_violations_p99"),
        "serving_p99_ms": med("serving_p99_ms"),
        "groups_lost": sum(r["groups_lost"] for r in runs),
        "groups_decided_twice": sum(r["groups_decided_twice"] for r in runs),
        "regenerated_token_fraction": med("regenerated_token_fraction"),
        "preempted": sum(r["preempted"] for r in runs),
        "resumed": sum(r["resumed"] for r in runs),
        "idle_capacity_used": med("idle_capacity_used"),
        "seeds": len(runs),
        "runs": runs,
    }


def _ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm, its samples per dedicated hour over the dedicated arm's, seed by seed."""
    base = runs.get("dedicated")
    if not base:
        return {}
    out = {}
    for arm, rs in runs.items():
        if arm == "dedicated":
            continue
        pairs = [
            r["samples_per_dedicated_hour"] / b["samples_per_dedicated_hour"]
            for r, b in zip(rs, base, strict=False)
            if b["samples_per_dedicated_hour"]
        ]
        out[arm] = {"median": median(pairs) if pairs else None, "seeds": pairs}
    return out


def _brief(r: dict[str, Any]) -> str:
    p99 = r["serving_p99_ms"]
    return (
        f"{r['trained_samples']} trained ({r['samples_per_dedicated_hour']:.0f}/dedicated h); "
        f"serving p99 {p99:.0f} ms, {r['slo_violations_p99']} windows over; "
        f"lost {r['groups_lost']}, twice {r['groups_decided_twice']}; "
        f"preempted {r['preempted']}, resumed {r['resumed']}; "
        f"regenerated {r['regenerated_token_fraction']:.3f}; idle used {r['idle_capacity_used']:.2f}"
        if p99 is not None
        else f"{r['trained_samples']} trained; nothing served"
    )


def _lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"bench tidal: {len(result['regions'])} regions x {result['engines_per_region']} serving "
        f"engines, {result['dedicated_per_region']} dedicated; a day in {result['day_s']:.0f} s"
    ]
    for arm, s in result["arms"].items():
        lines.append(
            f"  {arm:9s} {s['samples_per_dedicated_hour']:.0f} samples/dedicated h; serving p99 "
            f"{s['serving_p99_ms'] or 0:.0f} ms, {s['slo_violations_p99']} s over the SLO; lost "
            f"{s['groups_lost']}, twice {s['groups_decided_twice']}; regenerated "
            f"{s['regenerated_token_fraction'] or 0:.3f}; idle used {s['idle_capacity_used'] or 0:.2f}"
        )
    for arm, r in result["ratio"].items():
        if r["median"] is not None:
            lines.append(f"  {arm} / dedicated: {r['median']:.2f}x (seeds {r['seeds']})")
    return lines
