"""A transactional consume-transform-produce loop killed with SIGKILL mid-batch and restarted
produces each output exactly once; undecodable records land in the dead-letter stream."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import decode_all, make_topics, read_all, task, wait_for

from rlstream.consumers.consumer import Record, Stopper
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import events

WORKER = Path(__file__).with_name("eos_worker.py")


def _start(kafka: KafkaSettings, names: dict[str, str], delay: float) -> subprocess.Popen:
    args = [
        sys.executable,
        str(WORKER),
        "--bootstrap",
        kafka.bootstrap_servers,
        "--delay",
        str(delay),
        "--idle-exit",
        "6",
    ]
    for k, v in names.items():
        args += [f"--{k}", v]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=WORKER.parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.unsecured_only("its worker process is given a bare bootstrap address, no credentials")
def test_sigkill_mid_batch_then_restart_outputs_each_input_once(kafka, unique_run):
    names = {
        "input": f"{unique_run}.in",
        "output": f"{unique_run}.out",
        "dlq": f"{unique_run}.dlq",
        "group": f"rlstream.{unique_run}.copier",
        "txid": f"rlstream.{unique_run}.copier.0",
    }
    make_topics(kafka, names["input"], names["output"], names["dlq"])
    n = 300
    with EventProducer.connect(kafka) as producer:
        for i in range(n):
            producer.produce(names["input"], "task", task(unique_run, f"t{i}"), f"t{i}")
        producer.produce_raw(names["input"], b"\x00garbage that is no event", b"bad")

    first = _start(kafka, names, delay=0.02)  # 300 inputs take 6 s at least
    # killed once its first batch is committed (a fresh broker's first transaction takes
    # seconds: the transaction log is created then), the next one open
    wait_for(
        lambda: bool(read_all(kafka, names["output"])),
        60,
        {"copier": first},
        what="the copier's first committed batch",
    )
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    partial = len(read_all(kafka, names["output"]))
    assert 0 < partial < n, f"kill did not land mid-run ({partial} outputs)"

    second = _start(kafka, names, delay=0.0)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out

    ids = collections.Counter(d.record["task_id"] for d in decode_all(kafka, names["output"]))
    assert set(ids) == {f"t{i}" for i in range(n)}, "an input was lost"
    assert max(ids.values()) == 1, f"duplicated outputs: {[k for k, c in ids.items() if c > 1][:5]}"
    letters = decode_all(kafka, names["dlq"])
    assert len(letters) == 1
    letter = letters[0].record
    assert letter["reason"] == "bad_header" and letter["value"] == b"\x00garbage that is no event"
    assert letter["source_topic"] == names["input"] and letter["key"] == b"bad"
    # uncommitted (aborted) outputs of the killed run exist only outside read_committed
    assert len(read_all(kafka, names["output"], committed_only=False)) >= n
    assert events.decode(read_all(kafka, names["output"])[0][1]).event == "reward"


def test_a_record_the_processor_fails_on_is_dead_lettered_and_the_loop_goes_on(kafka, unique_run):
    """A poison record (the processor raises on it, not ``Refused``) costs one dead letter:
    every other input is output once, in order of its partition, and the loop never stops."""
    names = {s: f"{unique_run}.{s}" for s in ("in", "out", "dlq")}
    make_topics(kafka, *names.values(), partitions=1)
    with EventProducer.connect(kafka) as producer:
        for i in range(40):
            producer.produce(names["in"], "task", task(unique_run, f"t{i}"), f"t{i}")
    seen: list[str] = []
    aborts: list[int] = []
    commits: list[int] = []

    def process(records: list[Record]) -> list[Output]:
        outputs = []
        for rec in records:
            task_id = rec.value["task_id"]
            if task_id in ("t7", "t31"):
                raise KeyError(f"no rule for {task_id}")  # a bug meeting a record
            seen.append(task_id)
            outputs.append(Output(names["out"], "task", rec.value, task_id))
        return outputs

    loop = TransactionalLoop(
        kafka,
        group_id=f"rlstream.{unique_run}.poison",
        topics=[names["in"]],
        transactional_id=f"rlstream.{unique_run}.poison.0",
        dlq_topic=names["dlq"],
        process=process,
        on_abort=lambda: aborts.append(len(seen)),
        on_commit=lambda: commits.append(len(seen)),
        batch_size=16,
    )
    stats = loop.run(Stopper(), idle_exit_s=4.0)

    outputs = [d.record["task_id"] for d in decode_all(kafka, names["out"])]
    assert outputs == [f"t{i}" for i in range(40) if i not in (7, 31)]
    letters = [d.record for d in decode_all(kafka, names["dlq"])]
    assert [(r["reason"], r["offset"]) for r in letters] == [
        ("processing_error", 7),
        ("processing_error", 31),
    ]
    assert "KeyError" in letters[0]["error"] and stats.dead_letters == 2 and aborts
    assert len(commits) == stats.batches  # committed batches only, never an aborted one
    # found by halving: [0-3] [4-5] [6] [7-22] [23-30] [31-39] when every poll is full (one
    # record per transaction would be 33)
    assert stats.batches <= 8
