"""Supervision of ``rlstream run ROLE``: the role runs as a child process, restarted when it fails.

Rules (``RestartPolicy``, pure and unit-tested):

- a child that exits 0, or that was asked to stop (SIGTERM/SIGINT to the supervisor, which
  forwards it), is not restarted: the supervisor exits with the child's code;
- nor is a child that exits with ``CONFIG_EXIT`` (2): its configuration was refused (invalid,
  or not the run's), which no restart mends;
- a failed child (non-zero exit, or killed by a signal) is restarted after a delay that doubles
  with each consecutive failure, from ``base_s`` up to ``cap_s``, with +-25% jitter so the
  members of a group do not restart in lockstep;
- a failure counts as *fast* when the child ran less than ``fast_s``; after ``max_fast``
  consecutive fast failures the supervisor gives up with a message naming the role, the
  failures and the last exit code, and exits non-zero (a bad config or an unreachable cluster
  is reported, not retried forever). A child that ran longer resets the count;
- the child dies with the supervisor (``PR_SET_PDEATHSIG``): killing the supervisor, even with
  SIGKILL, never leaves an orphaned role holding a transactional id.
"""

from __future__ import annotations

import ctypes
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlstream.schemas.errors import CONFIG_EXIT

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    """When and how soon a failed role is restarted (see the module rules)."""

    base_s: float = 1.0
    cap_s: float = 30.0
    fast_s: float = 30.0
    max_fast: int = 5
    final: tuple[int, ...] = (CONFIG_EXIT,)
    """Exit codes never restarted (see the module rules)."""

    def delay(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait before restart number ``failures`` (1 for the first)."""
        nominal = min(self.cap_s, self.base_s * 2 ** max(0, failures - 1))
        return nominal * rng.uniform(0.75, 1.25)

    def give_up(self, fast_failures: int) -> bool:
        return fast_failures >= self.max_fast


def _die_with_parent() -> None:  # pragma: no cover (runs in the child before exec)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(
    name: str,
    cmd: Sequence[str],
    policy: RestartPolicy,
    log: Callable[[str], None] | None = None,
    rng: random.Random | None = None,
) -> int:
    """Run ``cmd`` until it succeeds or is stopped, restarting it by ``policy``; returns the exit
    code to leave with."""
    rng, log = rng or random.Random(), log or _stamped
    stop = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        stop.set()
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _restart_loop(name, cmd, policy, log, rng, stop, child)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stamped(line: str) -> None:
    """A supervisor line on stderr (the role's log), with the local time it happened."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _restart_loop(
    name: str,
    cmd: Sequence[str],
    policy: RestartPolicy,
    log: Callable[[str], None],
    rng: random.Random,
    stop: threading.Event,
    child: list[subprocess.Popen[bytes]],
) -> int:
    failures = fast = 0
    while True:
        started = time.monotonic()
        child.append(subprocess.Popen(list(cmd), preexec_fn=_die_with_parent))
        log(f"supervisor: {name} started (pid {child[-1].pid})")
        code = child[-1].wait()
        child.pop()
        ran = time.monotonic() - started
        if code == 0 or stop.is_set():
            return code
        if code in policy.final:
            log(f"supervisor: {name} refused its configuration (exit {code}); not restarting")
            return code
        quick = ran < policy.fast_s
        failures = failures + 1 if quick else 1  # a child that ran long starts a new series
        fast = fast + 1 if quick else 0
        if policy.give_up(fast):
            log(
                f"supervisor: {name} failed {fast} times in a row, each within "
                f"{policy.fast_s:.0f}s of starting (last exit code {code}); giving up"
            )
            return code if code > 0 else 1
        wait = policy.delay(failures, rng)
        log(f"supervisor: {name} exited with {code} after {ran:.1f}s; restarting in {wait:.1f}s")
        if stop.wait(wait):
            return code
