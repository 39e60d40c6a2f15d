"""A transactional copier used by the exactly-once test: tasks in, one reward per task out.

Run as a subprocess so the test can SIGKILL it mid-batch. Each record takes ``--delay`` seconds
so a kill lands inside an open transaction.
"""

from __future__ import annotations

import argparse
import time

from rlstream.consumers.consumer import Stopper
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.producers.client.settings import KafkaSettings


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("bootstrap", "input", "output", "dlq", "group", "txid"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--idle-exit", type=float, default=5.0)
    args = p.parse_args()

    def process(records):
        for rec in records:
            time.sleep(args.delay)
            task = rec.value
            yield Output(
                args.output,
                "reward",
                {
                    "run": task["run"],
                    "group_id": task["task_id"],
                    "task_id": task["task_id"],
                    "sample_index": 0,
                    "judge": "copy",
                    "judge_version": "1",
                    "score": 1.0,
                    "passed": True,
                    "latency_ms": 0,
                    "policy_version": 0,
                    "trajectory": {
                        "topic": rec.message.topic(),
                        "partition": rec.message.partition(),
                        "offset": rec.message.offset(),
                    },
                },
                key=task["task_id"],
            )

    loop = TransactionalLoop(
        KafkaSettings(bootstrap_servers=args.bootstrap),
        group_id=args.group,
        topics=[args.input],
        transactional_id=args.txid,
        dlq_topic=args.dlq,
        process=process,
        batch_size=20,
        instance_id=args.txid,
    )
    print("ready", flush=True)
    stats = loop.run(Stopper().install(), idle_exit_s=args.idle_exit)
    print(f"done batches={stats.batches} records={stats.records}", flush=True)


if __name__ == "__main__":
    main()
