"""Processes we start, tracked by pid; never found or stopped by name.

A pid alone can be reused by the system after its process exits, so liveness also checks that the
process's command line still names the file we started it with (its properties file).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

from rlstream.producers.runtime.ports import bindable


def port_in_use(port: int) -> bool:
    return not bindable(port)


def alive(pid: int | None, marker: str) -> bool:
    """True when ``pid`` runs and its command line contains ``marker``."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    state = _proc_state(pid)
    return marker in cmdline and state not in ("Z", "X")


def _proc_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat.rsplit(")", 1)[1].split()[0]


def spawn(cmd: list[str], log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start ``cmd`` detached from our session (it outlives the CLI), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    return proc


def stop(pid: int, marker: str, timeout: float = 30.0) -> None:
    """SIGTERM, wait up to ``timeout`` for a clean shutdown, then SIGKILL."""
    stop_all([(pid, marker)], timeout)


def stop_all(targets: list[tuple[int, str]], timeout: float = 30.0) -> None:
    """``stop`` for several ``(pid, marker)`` at once: all are sent SIGTERM together and shut
    down side by side; those still running after ``timeout`` get SIGKILL."""
    running = [(pid, marker) for pid, marker in targets if alive(pid, marker)]
    for pid, _ in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        time.sleep(0.2)
        for pid, marker in list(running):
            if not alive(pid, marker):
                _reap(pid)
                running.remove((pid, marker))
    for pid, _ in running:
        os.kill(pid, signal.SIGKILL)
        _reap(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except OSError:
        return f"(no log at {path})"
