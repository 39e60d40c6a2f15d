"""``rlstream bench ingest``: feedback events through the real HTTP service and Kafka, against a
bare aiohttp endpoint that answers 202 without Kafka, on the same machine in the same run.

Both servers are child processes, driven in turn by one load generator at every level of
``--concurrency``; ``ratio`` compares their best requests/s. The service is warmed up until the
broker's JIT settles. After the run the feedback topic must hold exactly as many records as 202
answers (``stored_check``); ``load_avg`` says how loaded the machine was.

Details: docs/benchmarks.md (bench ingest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from rlstream.ops.bench.common import (
    bench_broker,
    emit,
    jit_cpu_seconds,
    median,
    percentile,
    progress,
)

TOKEN = "bench-token"
#: Warm-up slices while the broker's JIT compiles, and the compiler load that counts as settled.
JIT_SLICE_S = 3.0
JIT_QUIET_CORE = 0.05


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ingest", help="feedback over HTTP into Kafka vs a bare 202 endpoint")
    p.add_argument("--seconds", type=float, default=5.0, help="load per repetition and server")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=(16, 64),
        help="requests in flight, one level or several (comma-separated); default 16,64",
    )
    p.add_argument("--max-requests", type=int, default=200_000, help="cap per repetition")
    p.add_argument("--tokens", type=int, default=256, help="tokens per feedback event")
    p.add_argument("--reps", type=int, default=2, help="repetitions of each server")
    p.add_argument(
        "--warmup",
        type=float,
        default=15.0,
        help="seconds of load on each server before measuring (a freshly started broker's "
        "JVM compiles its hot paths over its first ~20k records)",
    )
    p.add_argument(
        "--warmup-max",
        type=float,
        default=120.0,
        help="with a broker the bench started (or --home), go on warming up past --warmup until "
        "its JIT compiler threads go quiet, at most this many seconds in all",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--bootstrap", default=None)
    p.add_argument("--home", default=None)
    p.set_defaults(func=_main)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of counts: {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("every level needs at least one request in flight")
    return levels


# --- servers (child processes) --------------------------------------------------------------


def _bare_server() -> None:
    """The baseline: a bare aiohttp 202 endpoint on the same event loop (uvloop) as the service."""
    from aiohttp import web

    from rlstream.producers.runtime import aio

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"accepted": 1, "duplicate": False}, status=202)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/feedback", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"http://{host}:{port}", flush=True)
        await asyncio.Event().wait()  # until SIGTERM ends the process

    aio.run(main())


def _feedback_server(run: str, bootstrap: str) -> None:
    from rlstream.consumers.feedback.seen import durable_dedupe
    from rlstream.producers.client.settings import KafkaSettings
    from rlstream.producers.feedback.models import FeedbackServiceConfig
    from rlstream.producers.feedback.service import serve

    cfg = FeedbackServiceConfig(run=run, port=0, tokens=[TOKEN], user_id_salt="bench")
    settings = KafkaSettings(bootstrap_servers=bootstrap)
    dedupe = durable_dedupe(cfg, settings)
    if dedupe is not None:
        print(f"feedback-ingest: {dedupe.loaded} stored ids read back", file=sys.stderr)
    serve(cfg, settings, lambda url: print(url, flush=True), dedupe)


def _start(call: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``call`` (a function of this module) in a child process; returns it and its URL."""
    code = f"from rlstream.ops.bench import ingest; ingest.{call}"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    url = process.stdout.readline().strip()  # the child prints its URL once listening
    if not url.startswith("http://"):
        process.terminate()
        process.wait(30)
        raise RuntimeError(f"{call} did not start (exit code {process.poll()})")
    return process, url


# --- load -----------------------------------------------------------------------------------


def _template(tokens: int) -> str:
    event = {
        "feedback_id": "__FID__",
        "request_id": "__FID__",
        "policy_version": 1,
        "model": "policy",
        "action": "accepted",
        "token_ids": [(i * 7919) % 50_000 for i in range(tokens)],
        "logprobs": [-0.5] * tokens,
        "prompt_tokens": tokens // 2,
        "task_class": "tab",
        "user_id": "bench-user",
    }
    return json.dumps(event)


async def _load(
    url: str, template: str, concurrency: int, seconds: float, cap: int, tag: str
) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    counts = {"sent": 0, "errors": 0}
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    deadline = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        i = 0
        while time.perf_counter() < deadline and counts["sent"] < cap:
            counts["sent"] += 1
            body = template.replace("__FID__", f"{tag}-{w}-{i}").encode()
            i += 1
            started = time.perf_counter()
            async with session.post(f"{url}/v1/feedback", data=body, headers=headers) as r:
                await r.read()
                if r.status == 202:
                    latencies.append(time.perf_counter() - started)
                else:
                    counts["errors"] += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    began = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
    elapsed = time.perf_counter() - began
    return {
        "accepted": len(latencies),
        "errors": counts["errors"],
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
    }


def _stored(settings: Any, topic: str) -> int:
    """Records in ``topic``: the sum of its partitions' end offsets (no transactions there)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**settings.librdkafka(), "group.id": "rlstream.bench-ingest"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts
        )
    finally:
        consumer.close()


def _measure(
    args: argparse.Namespace, urls: dict[str, str], broker_pid: int | None
) -> dict[str, list[dict[str, Any]]]:
    """Runs by kind: ``warmup`` (the service's), ``jit`` (how the broker's compiler settled),
    ``light`` and ``light_bare`` (one in flight), and per server and level ``service@16``,
    ``bare@16``, ...; repetitions alternate servers."""
    template = _template(args.tokens)
    top = max(args.concurrency)
    runs: dict[str, list[dict[str, Any]]] = {"light": [], "light_bare": [], "warmup": []}
    for name, url in urls.items():  # warm-up: connections, schema announcement, the broker's JIT
        warm = asyncio.run(_load(url, template, top, args.warmup, args.max_requests, f"w-{name}"))
        if name == "service":
            runs["warmup"].append(warm)
            runs["jit"] = [_settle(args, url, template, top, broker_pid, runs["warmup"])]
    for rep in range(args.reps):
        for level in args.concurrency:
            for name, url in urls.items():
                tag = f"r{rep}c{level}"
                result = asyncio.run(
                    _load(url, template, level, args.seconds, args.max_requests, tag)
                )
                runs.setdefault(f"{name}@{level}", []).append(result)
                progress(
                    f"rep {rep + 1}/{args.reps} {level:3d} in flight {name:8s} "
                    f"{result['requests_per_s']:8.1f} req/s p50 {result['p50_ms']:6.1f} ms "
                    f"p99 {result['p99_ms']:6.1f} ms"
                )
    for name, key in (("service", "light"), ("bare", "light_bare")):
        runs[key].append(asyncio.run(_load(urls[name], template, 1, 1.0, 10_000, f"l-{name}")))
    return runs


def _settle(
    args: argparse.Namespace,
    url: str,
    template: str,
    concurrency: int,
    broker_pid: int | None,
    warmup: list[dict[str, Any]],
) -> dict[str, Any]:
    """Go on warming the service (runs appended to ``warmup``) in ``JIT_SLICE_S`` slices while
    the broker's JIT compiler threads used more than ``JIT_QUIET_CORE`` of a core over a slice,
    up to ``--warmup-max`` seconds in all; what the compiler did last and whether it settled.
    Without the broker's pid (a cluster named by ``--bootstrap``) only ``--warmup`` is spent."""
    spent, core = args.warmup, None
    used = jit_cpu_seconds(broker_pid) if broker_pid else None
    while broker_pid and used is not None and spent < args.warmup_max:
        began = time.perf_counter()
        tag = f"w-jit-{len(warmup)}"
        warmup.append(asyncio.run(_load(url, template, concurrency, JIT_SLICE_S, 10**9, tag)))
        now = jit_cpu_seconds(broker_pid)
        if now is None:
            break
        elapsed = time.perf_counter() - began
        spent += elapsed
        core, used = (now - used) / elapsed, now
        progress(f"warm-up {spent:5.1f} s: the broker's JIT compiler used {core:.2f} core")
        if core <= JIT_QUIET_CORE:
            break
    settled = None if core is None else core <= JIT_QUIET_CORE
    return {"warmup_s": spent, "broker_jit_core": core, "broker_jit_settled": settled}


def _main(args: argparse.Namespace) -> int:
    from rlstream.producers.client.admin import admin_client, ensure_run_topics
    from rlstream.schemas import topics

    with bench_broker(args) as (settings, broker_pid):
        run = f"bench-ingest-{uuid.uuid4().hex[:8]}"
        ensure_run_topics(settings, run)
        topic = topics.topic_name(run, "feedback")
        bare, bare_url = _start("_bare_server()")
        service, service_url = _start(f"_feedback_server({run!r}, {settings.bootstrap_servers!r})")
        progress(f"bare endpoint {bare_url}, feedback service {service_url} (run {run})")
        try:
            load_before = os.getloadavg()[0]
            runs = _measure(args, {"bare": bare_url, "service": service_url}, broker_pid)
            runs["load"] = [{"before": load_before, "after": os.getloadavg()[0]}]
        finally:
            for process in (bare, service):
                process.terminate()  # SIGTERM to the pid we started; the service flushes
                process.wait(30)
        stored = _stored(settings, topic)
        admin_client(settings).delete_topics(list(topics.run_topics(run).values()))
    return _report(args, runs, stored)


def _report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], stored: int) -> int:
    def med(name: str, key: str) -> float:
        return median([r[key] for r in runs[name]])

    levels = [
        {
            "concurrency": level,
            "requests_per_s": med(f"service@{level}", "requests_per_s"),
            "p50_ms": med(f"service@{level}", "p50_ms"),
            "p99_ms": med(f"service@{level}", "p99_ms"),
            "baseline_requests_per_s": med(f"bare@{level}", "requests_per_s"),
            "baseline_p50_ms": med(f"bare@{level}", "p50_ms"),
            "ratio": med(f"service@{level}", "requests_per_s")
            / med(f"bare@{level}", "requests_per_s"),
        }
        for level in args.concurrency
    ]
    best = max(levels, key=lambda lv: lv["requests_per_s"])
    best_bare = max(levels, key=lambda lv: lv["baseline_requests_per_s"])
    service = [r for name, v in runs.items() if name.startswith("service@") for r in v]
    accepted = sum(r["accepted"] for r in [*service, *runs["light"]])
    warm = sum(r["accepted"] for r in runs["warmup"])
    errors = sum(r.get("errors", 0) for v in runs.values() for r in v)
    jit = runs["jit"][0]
    result = {
        "bench": "ingest",
        "requests_per_s": best["requests_per_s"],
        "p50_ms": best["p50_ms"],
        "p99_ms": best["p99_ms"],
        "at_concurrency": best["concurrency"],
        "baseline_requests_per_s": best_bare["baseline_requests_per_s"],
        "baseline_p50_ms": best_bare["baseline_p50_ms"],
        "baseline_at_concurrency": best_bare["concurrency"],
        "ratio": best["requests_per_s"] / best_bare["baseline_requests_per_s"],
        "levels": levels,
        "light_p50_ms": med("light", "p50_ms"),
        "light_baseline_p50_ms": med("light_bare", "p50_ms"),
        "errors": errors,
        "accepted": accepted,
        "warmup_accepted": warm,
        "stored": stored,
        # every 202 (measured and warm-up) is stored; a 503 (if any) may have been stored too
        "stored_check": accepted + warm <= stored <= accepted + warm + errors,
        "load_avg": [round(runs["load"][0]["before"], 2), round(runs["load"][0]["after"], 2)],
        "concurrency": list(args.concurrency),
        "seconds": args.seconds,
        "warmup_s": round(jit["warmup_s"], 1),
        # the broker's JIT compiler in the last warm-up slice (cores; None: not measurable)
        "broker_jit_core": jit["broker_jit_core"],
        "broker_jit_settled": jit["broker_jit_settled"],
        "tokens": args.tokens,
        "reps": args.reps,
    }
    lines = [
        f"{lv['concurrency']:3d} in flight: service {lv['requests_per_s']:.0f} req/s "
        f"(p50 {lv['p50_ms']:.1f} ms, p99 {lv['p99_ms']:.1f} ms), bare 202 endpoint "
        f"{lv['baseline_requests_per_s']:.0f} req/s (p50 {lv['baseline_p50_ms']:.1f} ms): "
        f"ratio {lv['ratio']:.3f}"
        for lv in levels
    ]
    lines += [
        f"ratio of the best rates (service at {best['concurrency']} in flight, bare at "
        f"{best_bare['concurrency']}; {args.tokens} tokens, medians of {args.reps}): "
        f"{result['ratio']:.3f}",
        f"one in flight: service p50 {result['light_p50_ms']:.1f} ms, "
        f"bare p50 {result['light_baseline_p50_ms']:.1f} ms",
        f"warm-up {result['warmup_s']:.0f} s; the broker's JIT compiler "
        + (
            "not measurable (not a local broker)"
            if jit["broker_jit_core"] is None
            else f"at {jit['broker_jit_core']:.2f} core at its end"
        ),
        f"stored {stored} records for {accepted} measured and {warm} warm-up 202s: "
        f"{'ok' if result['stored_check'] else 'MISMATCH'}",
        f"machine load (1-minute average) {result['load_avg'][0]:.1f} before, "
        f"{result['load_avg'][1]:.1f} after, on {os.cpu_count()} cores",
    ]
    emit(result, args.json, lines, "ingest")
    return 0 if result["stored_check"] else 1
