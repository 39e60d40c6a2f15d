"""The launcher of a learner's ranks on one machine: ``rlstream run learner --ranks N``.

The supervised learner process (``ops.run.supervise``) becomes this launcher when the learner has
several ranks and its environment names none: it starts N copies of its own command line, each
with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``
(a free port found by binding port 0), the variables ``torchrun`` sets, so that each copy runs
one rank (``trainer.distributed``). Rules:

- a rank that fails (non-zero exit, or killed by a signal) fails the learner: the launcher
  kills the other ranks by pid (SIGKILL; nothing of a step is committed before every rank's
  part of it is done, so there is nothing to finish) and exits non-zero, so the supervisor
  restarts all of them together, and they resume from the last committed version;
- when every rank exits 0 (rank 0 stopped and told the others) the launcher exits 0; once one
  rank exited 0 the others get ``STOP_GRACE_S`` to follow, then count as failed;
- SIGTERM/SIGINT to the launcher is passed to every rank (rank 0 stops the others);
- the ranks die with the launcher (``PR_SET_PDEATHSIG``): killing it never leaves a rank
  holding the learner's transactional id.

Across machines, start each node's ranks with ``torchrun`` (its own rendezvous and restarts):
``rlstream run learner`` with ``WORLD_SIZE`` set runs one rank, unsupervised.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlstream.ops.run.supervise import _die_with_parent
from rlstream.producers.runtime.ports import free_port

#: Seconds the other ranks have to exit after one exited 0.
STOP_GRACE_S = 60.0


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables of rank ``rank`` of ``world`` on this machine (``torchrun``'s names)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launch(
    cmd: Sequence[str],
    world: int,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Run ``cmd`` as ``world`` ranks until they all exit (module rules); the exit code."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(world):
            env = {**os.environ, **rank_env(rank, world, port)}
            procs.append(subprocess.Popen(list(cmd), env=env, preexec_fn=_die_with_parent))
            log(f"launcher: rank {rank} of {world} started (pid {procs[-1].pid})")
        return _watch(procs, log)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(procs: list[subprocess.Popen[bytes]], log: Callable[[str], None]) -> int:
    """Wait until every rank exited 0 (0), or one failed or lingered (non-zero)."""
    done_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log(f"launcher: rank {rank} exited with {code}; stopping the other ranks")
            return code if code is not None and code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        if done_at is None and any(c == 0 for c in codes):
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() - done_at > STOP_GRACE_S:
            log(f"launcher: ranks still running {STOP_GRACE_S:.0f}s after one stopped")
            return 1
        time.sleep(0.2)


def run_local_ranks(
    target: Callable[..., None], world: int, args: tuple, what: str, timeout: float = 1800.0
) -> Any:
    """Run ``target(rank, world, port, *args, out)`` in ``world`` spawned processes on this
    machine (a free ``port`` for their rendezvous) and return what rank 0 puts on ``out``.
    Spawned, not forked: the caller may hold Kafka clients' threads. A rank still alive after
    the result is killed; any rank that exited non-zero raises, naming ``what``, as soon as it
    is seen (the others, which may wait in a collective for it, are killed then), as does
    ``timeout`` passing without a result."""
    import multiprocessing
    import queue

    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    result, grace = None, 120.0
    try:
        while result is None:
            try:
                result = out.get(timeout=0.5)
            except queue.Empty:
                ended = [p.exitcode for p in procs if p.exitcode is not None]
                failed = any(c != 0 for c in ended) or len(ended) == world
                if failed or time.monotonic() > deadline:
                    grace = 0.0
                    break
    finally:
        for proc in procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if result is None or any(proc.exitcode != 0 for proc in procs):
        why = "no result" if result is None else "a rank failed"
        raise RuntimeError(f"{what} ranks: {why}; exit codes {[p.exitcode for p in procs]}")
    return result
