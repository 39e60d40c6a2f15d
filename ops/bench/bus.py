"""``rlstream bench bus``: trajectory events through the broker vs the same bytes sent raw.

Both paths go through the same broker, topic settings, producer and consumer settings (zstd
included), in the same run, alternating raw/rlstream repetitions so machine noise hits both
alike:
- rlstream: pack the token arrays, Avro-encode with the schema header, produce; consume,
  decode with the writer schema, unpack the arrays (numpy views);
- raw: produce the very bytes of an encoded event, pre-built (so both paths compress alike);
  consume them. The ratio therefore prices rlstream's encoding and decoding, nothing else.
Throughput is events from the first produce to the last consume; end-to-end latency (produce
call to decoded record) is measured in a paced phase at a moderate rate so it is not queueing.
The ratio is median rlstream events/s over median raw events/s.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

from rlstream.ops.bench.common import bench_kafka, emit, median, percentile, progress


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bus", help="trajectory events vs raw bytes through the same broker")
    p.add_argument("--events", type=int, default=300, help="events per repetition")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per trajectory")
    p.add_argument("--layers", type=int, default=8, help="MoE layers")
    p.add_argument("--top-k", type=int, default=8, help="experts per token per layer")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each path")
    p.add_argument("--latency-rate", type=float, default=20.0, help="events/s in the latency phase")
    p.add_argument("--json", action="store_true")
    p.add_argument("--bootstrap", default=None)
    p.add_argument("--home", default=None)
    p.set_defaults(func=_main)


def _trajectory(args: argparse.Namespace, rng: Any, i: int) -> dict[str, Any]:
    import numpy as np

    from rlstream.schemas import arrays

    t = args.tokens
    fields = arrays.pack_tokens(
        rng.integers(0, 50_000, t, dtype=np.int32),
        rng.standard_normal(t, dtype=np.float32),
        (np.arange(t) >= 512).astype(np.uint8),
        rng.integers(0, 64, (t, args.layers, args.top_k), dtype=np.uint8),
    )
    now = int(time.time() * 1000)
    return {
        "run": "bench",
        "group_id": f"g{i // 8}",
        "task_id": f"t{i // 8}",
        "sample_index": i % 8,
        "group_size": 8,
        "policy_version": 3,
        "model": "bench",
        "worker_id": "w0",
        "region": "local",
        **fields,
        "prompt_tokens": 512,
        "completion": "x" * 200,
        "turns": [],
        "outcome": {"status": "completed", "tool_calls": 0, "summarised": False},
        "timings": {
            "queued_ms": now,
            "started_ms": now,
            "finished_ms": now,
            "generate_ms": 0,
            "env_ms": 0,
        },
    }


class _Path:
    """One measured path: how to turn an event into bytes and consumed bytes back."""

    def __init__(self, name: str, encode: Any, decode: Any) -> None:
        self.name, self.encode, self.decode = name, encode, decode


def _paths(args: argparse.Namespace) -> tuple[_Path, _Path, int]:
    import numpy as np

    from rlstream.schemas import arrays, events

    rng = np.random.default_rng(0)
    templates = [_trajectory(args, rng, i) for i in range(8)]
    serialize, deserialize = events.serializer("trajectory"), events.deserializer()
    size = len(serialize(templates[0], None))
    raw_payload = serialize(templates[0], None)  # the same bytes, without the work

    def rl_encode(i: int) -> bytes:
        src = templates[i % 8]
        rec = dict(src, **arrays.pack_tokens(*_views(src)))  # pack per event, as a worker would
        return serialize(rec, None)

    def rl_decode(value: bytes) -> int:
        return arrays.unpack_tokens(deserialize(value, None).record).n_tokens

    return (_Path("raw", lambda i: raw_payload, len), _Path("rlstream", rl_encode, rl_decode), size)


def _views(rec: dict[str, Any]) -> tuple[Any, ...]:
    from rlstream.schemas import arrays

    t = arrays.unpack_tokens(rec)
    return t.token_ids, t.logprobs, t.loss_mask, t.routed_experts


def _run_once(settings: Any, topic: str, path: _Path, n: int, rate: float | None) -> dict[str, Any]:
    """Produce ``n`` events (paced at ``rate`` if given) while a consumer drains them."""
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition

    from rlstream.producers.client.producer import make_producer

    consumer = Consumer(
        {
            **settings.librdkafka(),
            "group.id": f"bench-{uuid.uuid4().hex}",
            "enable.auto.commit": "false",
            "fetch.max.bytes": str(64 << 20),
            "max.partition.fetch.bytes": str(16 << 20),
        }
    )
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in parts])
    consumer.consume(1, 1.0)  # settle the assignment before producing
    sent: dict[int, float] = {}
    producer = make_producer(settings)

    def produce() -> None:
        start = time.perf_counter()
        for i in range(n):
            if rate:
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            sent[i] = time.perf_counter()
            value = path.encode(i)
            while True:
                try:
                    producer.produce(topic, value, str(i).encode())
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
        producer.flush(60)

    thread = threading.Thread(target=produce)
    t0 = time.perf_counter()
    thread.start()
    latencies, got, nbytes = [], 0, 0
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        first = consumer.poll(0.5)  # block for one, then drain what is already fetched
        for msg in [first, *consumer.consume(100, 0)] if first is not None else []:
            if msg.error():
                continue
            value = msg.value() or b""
            path.decode(value)
            latencies.append((time.perf_counter() - sent[int(msg.key() or b"-1")]) * 1000)
            got, nbytes = got + 1, nbytes + len(value)
    elapsed = time.perf_counter() - t0
    thread.join()
    consumer.close()
    return {
        "events": got,
        "seconds": elapsed,
        "events_per_s": got / elapsed,
        "mb_per_s": nbytes / elapsed / 1e6,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


def _main(args: argparse.Namespace) -> int:
    from rlstream.producers.client.admin import TopicWant, admin_client, apply_topics

    raw, rl, size = _paths(args)
    with bench_kafka(args) as settings:
        topic = f"bench.bus.{uuid.uuid4().hex[:8]}"
        apply_topics(
            admin_client(settings), [TopicWant(topic, 3, {"max.message.bytes": str(16 << 20)})]
        )
        runs: dict[str, list[dict[str, Any]]] = {"raw": [], "rlstream": []}
        for rep in range(args.reps):
            for path in (raw, rl):
                result = _run_once(settings, topic, path, args.events, None)
                runs[path.name].append(result)
                progress(
                    f"rep {rep + 1}/{args.reps} {path.name:8s} {result['events_per_s']:8.1f} ev/s "
                    f"{result['mb_per_s']:7.1f} MB/s"
                )
        paced = {
            p.name: _run_once(settings, topic, p, max(50, args.events // 3), args.latency_rate)
            for p in (raw, rl)
        }
        admin_client(settings).delete_topics([topic])
    return _report(args, runs, paced, size)


def _report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    paced: dict[str, dict[str, Any]],
    size: int,
) -> int:
    eps = {k: median([r["events_per_s"] for r in v]) for k, v in runs.items()}
    mbs = {k: median([r["mb_per_s"] for r in v]) for k, v in runs.items()}
    result = {
        "bench": "bus",
        "event_bytes": size,
        "tokens": args.tokens,
        "layers": args.layers,
        "top_k": args.top_k,
        "reps": args.reps,
        "events_per_rep": args.events,
        "events_per_s": eps["rlstream"],
        "mb_per_s": mbs["rlstream"],
        "raw_events_per_s": eps["raw"],
        "raw_mb_per_s": mbs["raw"],
        "ratio": eps["rlstream"] / eps["raw"],
        "p50_ms": paced["rlstream"]["p50_ms"],
        "p99_ms": paced["rlstream"]["p99_ms"],
        "raw_p50_ms": paced["raw"]["p50_ms"],
        "raw_p99_ms": paced["raw"]["p99_ms"],
        "latency_rate_per_s": args.latency_rate,
    }
    lines = [
        f"event size {size / 1e3:.0f} kB ({args.tokens} tokens, {args.layers} layers x top-{args.top_k})",
        f"rlstream: {eps['rlstream']:.1f} events/s, {mbs['rlstream']:.1f} MB/s (median of {args.reps})",
        f"raw:      {eps['raw']:.1f} events/s, {mbs['raw']:.1f} MB/s",
        f"ratio rlstream/raw: {result['ratio']:.3f}",
        f"latency at {args.latency_rate:.0f} ev/s: rlstream p50 {result['p50_ms']:.1f} ms "
        f"p99 {result['p99_ms']:.1f} ms; raw p50 {result['raw_p50_ms']:.1f} ms "
        f"p99 {result['raw_p99_ms']:.1f} ms",
    ]
    emit(result, args.json, lines, "bus")
    return 0
