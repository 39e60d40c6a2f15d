"""One rollout worker of ``rlstream bench tidal``: the product's rollout role with its engine paced
to a fixed number of decode steps a second, as a GPU of its own would run.

On a 2-core machine every engine shares the same cores, so unpaced the rollout rate would follow
the CPU, not the engines lent. The bench paces each engine well under what the cores can run
for all of them at once, so its rate grows with the engines rolling out. The pacing wraps the
engine's generate function (its public part: the stop check it is handed, asked once a decode
step); the role itself is ``rollout.worker`` unchanged. Every ``STATUS_S`` and at exit the worker
writes its tally to ``--status``: tokens its engine generated and seconds it spent rolling out.

    python -m rlstream.ops.bench.tidal_worker --steps-per-s 8 --status S.json --run R ...
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATUS_S = 2.0


@dataclass
class Tally:
    """What one engine did: tokens generated, seconds rolling out (a task in hand)."""

    tokens: int = 0
    busy_s: float = 0.0
    preempted: int = 0
    resumed: int = 0


def paced(generate_fn: Callable[..., Any], steps_per_s: float, tally: Tally) -> Callable[..., Any]:
    """``generate_fn`` that runs at most ``steps_per_s`` decode steps a second."""
    period = 1.0 / steps_per_s

    def run(*args: Any, **kwargs: Any) -> Any:
        stop = kwargs.get("stop")
        due = [time.monotonic()]

        def step() -> bool:
            wait = due[0] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            due[0] = max(time.monotonic(), due[0]) + period
            return bool(stop()) if stop is not None else False

        gen = generate_fn(*args, **{**kwargs, "stop": step})
        tally.tokens += int(gen.lengths.sum())
        return gen

    return run


def timed(process: Callable[[list[Any]], Any], tally: Tally) -> Callable[[list[Any]], Any]:
    """``process`` with the seconds it held a task added to ``tally.busy_s``."""

    def run(records: list[Any]) -> Any:
        if not records:
            return process(records)
        started = time.monotonic()
        try:
            return process(records)
        finally:
            tally.busy_s += time.monotonic() - started

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal_worker")
    parser.add_argument("--steps-per-s", type=float, required=True)
    parser.add_argument("--status", required=True)
    # what ``rlstream run rollout`` takes, for ``ops.run.role_main.prepare``
    parser.add_argument("--run", required=True)
    parser.add_argument("--region", default=None)
    parser.add_argument("--home", default=None)
    parser.add_argument("--member", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[])
    ns = parser.parse_args(argv)
    import torch

    from rlstream.ops.run.role_main import prepare
    from rlstream.producers.weights.signing import Verifier
    from rlstream.rollout.worker import RolloutWorker, lent_loops, rollout_loop
    from rlstream.schemas.derive import derive

    role = {"role": "rollout", "name": None, "bootstrap": None, "once": True}
    ctx = prepare(argparse.Namespace(**vars(ns), **role))
    if isinstance(ctx, int):
        return ctx
    cfg = derive(ctx.cfg, region=ctx.region)
    torch.set_num_threads(cfg.torch_threads)
    worker = RolloutWorker(
        ctx.settings, ctx.run, cfg, ctx.member, ctx.regions, Verifier.given(ctx.keys)
    )
    tally, status = Tally(), Path(ns.status)
    engine: Any = worker.engine
    engine.generate_fn = paced(engine.generate_fn, ns.steps_per_s, tally)
    worker.process = timed(worker.process, tally)  # type: ignore[method-assign,assignment]
    done = threading.Event()

    def write() -> None:
        tally.preempted, tally.resumed = worker.preempted, worker.resumed
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(tally), "lent": cfg.lent, "member": ctx.member}))
        tmp.replace(status)

    def keep_writing() -> None:
        while not done.wait(STATUS_S):
            write()

    threading.Thread(target=keep_writing, daemon=True).start()
    try:
        worker.wait_for_weights(ctx.stopper)
        if cfg.lent:
            lent_loops(ctx, worker)
        else:
            rollout_loop(ctx, worker).run(ctx.stopper)
    finally:
        done.set()
        worker.close()
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
