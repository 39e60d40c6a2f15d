"""The interpreter a sandbox runs, and the warm helper that forks every sandbox of a process
(``boot.py --serve``).

Rules: one helper per (process, interpreter), started on first use with a scrubbed environment
and ``-I -S`` (no site, no user paths), holding only a socket to its parent; it exits when the
parent's end closes (at exit, or when the parent dies). A run sends the bootstrap's spec and
its descriptors and gets the launcher's pid back; a helper that died is restarted once.
Forking a warm interpreter instead of starting one per run keeps a sandboxed run cheap.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

BOOT = Path(__file__).resolve().parent / "boot.py"
UID_BASE = 1_000_000  # sandbox uids are unused numbers above this: no /etc/passwd entry needed


@functools.cache
def default_python() -> str:
    """The interpreter of rlimits mode (probed once; the namespaced modes bind this one's prefix).

    Rule: as non-root, this process's own interpreter. As root the code runs as an unprivileged
    uid, which cannot read a standard library under a private home (pyenv in ``/root``): take the
    first of this interpreter, ``/usr/bin/python3``, ``/usr/local/bin/python3`` whose standard
    library such a uid can import.
    """
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0:
        return own
    for cand in (own, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and _stdlib_readable(cand):
            return cand
    return own


def _stdlib_readable(python: str) -> bool:
    uid = UID_BASE + secrets.randbelow(1_000_000)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            [python, "-I", "-S", "-c", "import json, math, traceback, collections"],
            capture_output=True,
            timeout=30,
            user=uid,
            group=uid,
            extra_groups=[],
            cwd="/",
        )
        return done.returncode == 0
    return False


def interpreter(mode: str, chosen: str | None) -> tuple[str, list[str]]:
    """(interpreter, read-only paths to bind for it) for ``mode``; ``chosen``: the config's."""
    if mode == "rlimits":
        return chosen or default_python(), []
    python = os.path.realpath(chosen or sys.executable)
    prefix = sys.base_prefix if chosen is None else str(Path(python).parent.parent)
    return python, [os.path.realpath(prefix)]


class _Zygote:
    """A trusted helper (``boot.py --serve``) that forks every sandbox of this process.

    Forking a warm interpreter instead of starting one per run keeps a sandboxed run cheap.
    The helper holds only a scrubbed environment and a socket to us; it exits when we do.
    """

    def __init__(self, python: str) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [python, "-I", "-S", str(BOOT), "--serve", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        self.lock = threading.Lock()

    def launch(self, spec: dict[str, object], fds: list[int]) -> int:
        """Start one sandbox; its pid (the leader of its process group)."""
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(spec).encode()], fds)
            reply = self.sock.recv(4096)
        if not reply:
            raise OSError("the sandbox helper exited")
        answer = json.loads(reply)
        if "error" in answer:
            raise OSError(f"the sandbox helper could not fork: {answer['error']}")
        return int(answer["pid"])

    def close(self) -> None:
        """Close our end (the helper exits on it) and reap the helper."""
        self.sock.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTES: dict[tuple[int, str], _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


@atexit.register
def _close_zygotes() -> None:
    with _ZYGOTES_LOCK:
        mine = [k for k in _ZYGOTES if k[0] == os.getpid()]
        for key in mine:
            _ZYGOTES.pop(key).close()


def launch(python: str, spec: dict[str, object], fds: list[int]) -> int:
    """Start a sandbox through this process's helper for ``python`` (restarted if it died)."""
    key = (os.getpid(), python)
    for attempt in range(2):
        with _ZYGOTES_LOCK:
            zygote = _ZYGOTES.get(key)
            if zygote is None or zygote.proc.poll() is not None:
                zygote = _ZYGOTES[key] = _Zygote(python)
        try:
            return zygote.launch(spec, fds)
        except (OSError, ValueError):
            with _ZYGOTES_LOCK:
                _ZYGOTES.pop(key, None)
            if attempt:
                raise
    raise AssertionError("unreachable")
