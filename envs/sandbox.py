"""Run untrusted code behind a boundary, or refuse to.

Isolation modes, strongest first (``SandboxResult.mode`` says which one a run had):

- ``full`` (needs root): the program runs in fresh mount, PID, network, IPC and UTS namespaces,
  in a private root built by the trusted bootstrap (:mod:`rlstream.envs.sandbox_boot`): ``/usr``
  (with ``/bin``, ``/lib*``) and the interpreter read-only, ``/dev`` with five harmless devices,
  a fresh ``/proc`` showing only its own processes, and one size-capped tmpfs shown as ``/work``
  (the cwd and workspace), ``/tmp`` and ``/dev/shm``. The old root is detached, so nothing of the
  host's repository, virtualenv, Kafka state, checkpoints, home directories or processes is
  reachable, and there is no network at all (an empty network namespace: not even the host's
  loopback). The program runs as a fresh, unused uid with no capabilities, no-new-privs,
  non-dumpable, under a seccomp filter (no ``exec``, no new namespaces, mounts, ptrace, bpf or
  io_uring) and a Python audit hook (defence in depth).
- ``userns``: the same namespaces and private root, set up inside a user namespace by a
  non-root parent; the program keeps the namespace's uid 0 (the invoking user on the host) with
  every capability dropped. Weaker: it is not a fresh host uid, and user namespaces widen the
  kernel's attack surface.
- ``rlimits``: no namespaces: rlimits, a fresh uid when the parent is root, seccomp and the audit
  hook only. The host's files and loopback network are reachable: this is not a boundary.

``SandboxConfig.isolation`` names the weakest mode a caller accepts (default ``full``). ``run``
uses the strongest mode that works here (probed once per process by running a program in it)
and raises :class:`IsolationUnavailable`, with every mode's failure, when that is weaker than
accepted: code is never run with less isolation than asked for.

Limits in every mode: CPU time (``RLIMIT_CPU``), address space per process (``RLIMIT_AS``),
processes (``RLIMIT_NPROC``, per sandbox uid), file size (``RLIMIT_FSIZE``, stdout and stderr
included), open files, total disk (the scratch tmpfs: workspace, ``/tmp`` and ``/dev/shm``
together), and the wall clock, enforced twice: by the bootstrap (init of the PID namespace, so
it holds even if the parent died; when init exits the kernel kills everything left in the
namespace) and by the parent, which kills the bootstrap's process group. The verdict (wait
status, CPU time) is reported by the bootstrap on a descriptor the program never holds, so it
cannot be forged or deleted. Workspace files go in and come back out by value (``files``):
regular files only, no link followed, capped. The environment is scrubbed to ``PATH``,
``HOME``, ``LANG``; the interpreter runs isolated (``-I -S``). Nothing here needs Docker.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "timeout", "oom", "crash", "killed", "error"]
Mode = Literal["full", "userns", "rlimits"]
MODES: tuple[Mode, ...] = ("full", "userns", "rlimits")  # strongest first

#: Exit code the bootstrap uses when the program raised ``MemoryError``.
OOM_EXIT = 86
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_UID_BASE = 1_000_000  # sandbox uids are unused numbers above this: no /etc/passwd entry needed
_BOOT = Path(__file__).resolve().parent / "sandbox_boot.py"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
MAX_FILES = 64


class IsolationUnavailable(RuntimeError):
    """The isolation asked for cannot be set up here; nothing was run."""


class SandboxConfig(BaseModel):
    """Limits for one sandboxed run, and the weakest isolation accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_timeout_s: float = Field(
        default=5.0, gt=0, le=3600, description="Wall-clock limit in seconds."
    )
    cpu_limit_s: int = Field(
        default=2, ge=1, le=3600, description="CPU-seconds limit (RLIMIT_CPU)."
    )
    memory_bytes: int = Field(
        default=256 * 2**20,
        ge=32 * 2**20,
        le=2**40,
        description="Address-space limit per process (RLIMIT_AS).",
    )
    max_processes: int = Field(
        default=16, ge=1, le=4096, description="Process limit for the sandbox uid (RLIMIT_NPROC)."
    )
    max_file_bytes: int = Field(
        default=1 * 2**20,
        ge=4096,
        le=2**34,
        description="Largest file the code may write, stdout/stderr included.",
    )
    max_output_bytes: int = Field(
        default=16 * 2**10,
        ge=64,
        le=2**30,
        description="Bytes of stdout and of stderr returned to the caller.",
    )
    disk_bytes: int = Field(
        default=32 * 2**20,
        ge=2**20,
        le=2**34,
        description="Total disk of the program: workspace, /tmp and /dev/shm together (tmpfs).",
    )
    block_exec: bool = Field(
        default=True,
        description="Seccomp filter (no exec, namespaces, mounts, ptrace, bpf) plus audit hook.",
    )
    isolation: Mode = Field(
        default="full",
        description="Weakest isolation accepted: 'full', or a named weaker mode ('userns', "
        "'rlimits'); the sandbox refuses to run when only weaker modes work here.",
    )
    python: str | None = Field(
        default=None,
        description="Interpreter for the code; None: this one in the namespaced modes, one "
        "whose standard library the sandbox uid can read in rlimits mode (probed once).",
    )


@dataclass
class SandboxResult:
    """Outcome of one run. ``exit_code`` is None when the program died by a signal."""

    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    wall_s: float
    cpu_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    reason: str = ""
    isolation: dict[str, bool] = field(default_factory=dict)
    uid: int | None = None  # the fresh uid the code ran as (root parents only)
    mode: str = ""
    files: dict[str, bytes] | None = None  # the workspace afterwards, when files were given
    files_skipped: list[str] = field(default_factory=list)


def mechanisms(mode: Mode, block_exec: bool) -> dict[str, bool]:
    """What each mode rests on (recorded with every result)."""
    ns = mode != "rlimits"
    return {
        "mount_namespace": ns,
        "private_root": ns,
        "pid_namespace": ns,
        "network_namespace": ns,
        "user_namespace": mode == "userns",
        "own_uid": mode != "userns" and os.geteuid() == 0,
        "no_capabilities": ns or os.geteuid() == 0,
        "disk_limit": ns,
        "seccomp": block_exec,
        "audit_hook": block_exec,
    }


# ---------------------------------------------------------------- choosing a mode


@functools.cache
def probe_mode(mode: Mode) -> str:
    """ "" when ``mode`` works here, else why not (probed once per process by running a program)."""
    if mode == "full" and os.geteuid() != 0:
        return "needs root (a fresh uid and the mounts need privileges)"
    try:
        r = _run_in(mode, "print('ok')", SandboxConfig(wall_timeout_s=20), "", None)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    ok = r.status == "ok" and r.stdout == "ok\n"
    return "" if ok else (r.reason or r.stderr.strip()[-300:] or r.status)


def probe() -> dict[str, str]:
    """Every mode -> "" when it works here, else why not."""
    return {mode: probe_mode(mode) for mode in MODES}


def choose_mode(cfg: SandboxConfig) -> Mode:
    """The strongest mode that works here; raises when it is weaker than ``cfg.isolation``."""
    for mode in MODES[: MODES.index(cfg.isolation) + 1]:
        if not probe_mode(mode):
            return mode
    found = probe()
    why = "; ".join(f"{m}: {found[m] or 'works'}" for m in MODES)
    raise IsolationUnavailable(
        f"sandbox refused: isolation {cfg.isolation!r} cannot be set up here ({why}). Run as "
        "root on Linux with util-linux unshare, or accept a named weaker mode explicitly "
        "(sandbox isolation = 'userns' or 'rlimits')."
    )


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
    uid = _UID_BASE + secrets.randbelow(1_000_000)
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


def _interpreter(mode: Mode, cfg: SandboxConfig) -> tuple[str, list[str]]:
    """(interpreter, read-only paths to bind for it) for ``mode``."""
    if mode == "rlimits":
        return cfg.python or default_python(), []
    python = os.path.realpath(cfg.python or sys.executable)
    prefix = sys.base_prefix if cfg.python is None else str(Path(python).parent.parent)
    return python, [os.path.realpath(prefix)]


# ---------------------------------------------------------------- running


def run(
    code: str,
    cfg: SandboxConfig | None = None,
    stdin: str = "",
    files: Mapping[str, bytes | str] | None = None,
) -> SandboxResult:
    """Run Python ``code`` in the sandbox and return what happened.

    ``files`` (relative name -> content) is the workspace the code starts in; when given, the
    result's ``files`` is the workspace afterwards. Never raises for the program's faults;
    raises :class:`IsolationUnavailable` when the accepted isolation cannot be set up, and
    ``ValueError`` for a bad file name.
    """
    cfg = cfg or SandboxConfig()
    return _run_in(choose_mode(cfg), code, cfg, stdin, files)


def _run_in(
    mode: Mode, code: str, cfg: SandboxConfig, stdin: str, files: Mapping[str, bytes | str] | None
) -> SandboxResult:
    uid = _UID_BASE + secrets.randbelow(1_000_000) if os.geteuid() == 0 else None
    if mode == "userns":
        uid = None
    root = tempfile.mkdtemp(prefix="rlstream-sbx-")
    try:
        spec = _stage(root, mode, code, cfg, uid, files)
        python, ro_paths = _interpreter(mode, cfg)
        spec["ro_paths"] = ro_paths
        wall, timed_out, report = _execute(root, python, spec, cfg, stdin)
        if mode == "rlimits" and uid is not None:
            _kill_uid(uid)
        result = _collect(cfg, root, wall, timed_out, report)
        result.mode, result.uid = mode, uid
        result.isolation = mechanisms(mode, cfg.block_exec)
        if files is not None:
            result.files, result.files_skipped = _files_back(root, result)
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stage(
    root: str,
    mode: Mode,
    code: str,
    cfg: SandboxConfig,
    uid: int | None,
    files: Mapping[str, bytes | str] | None,
) -> dict[str, object]:
    """Write the program and the workspace into ``root``; the bootstrap's spec."""
    Path(root, "program.py").write_text(code, encoding="utf-8")
    work = os.path.join(root, "in" if mode != "rlimits" else "work")
    os.mkdir(work, 0o700)
    for name, content in (files or {}).items():
        path = os.path.join(work, check_name(name))
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        Path(path).write_bytes(data)
    if mode == "rlimits" and uid is not None:
        os.chmod(root, 0o711)  # the sandbox uid may traverse to work/, not list root/
        for dirpath, _dirs, names in os.walk(work):
            os.chown(dirpath, uid, uid)
            for n in names:
                os.chown(os.path.join(dirpath, n), uid, uid)
    if mode != "rlimits":
        os.mkdir(os.path.join(root, "newroot"), 0o755)
    return {
        "mode": mode,
        "root": os.path.join(root, "newroot"),
        "in_dir": work,
        "program": os.path.join(root, "program.py"),
        "cwd": "/work" if mode != "rlimits" else work,
        "uid": uid,
        "cpu": cfg.cpu_limit_s,
        "mem": cfg.memory_bytes,
        "fsize": cfg.max_file_bytes,
        "nproc": cfg.max_processes,
        "disk": cfg.disk_bytes,
        "inodes": 4096,
        "wall": cfg.wall_timeout_s,
        "block": cfg.block_exec,
        "max_files": MAX_FILES,
        "max_collect": cfg.disk_bytes,
    }


def check_name(name: str) -> str:
    """A workspace file name: relative, ``/``-separated safe parts, no ``..``; else ValueError."""
    parts = name.split("/")
    if not name or len(parts) > 8 or not all(_NAME.match(p) and p != ".." for p in parts):
        raise ValueError(f"bad workspace file name {name!r}")
    return name


class _Zygote:
    """A trusted helper (``sandbox_boot.py --serve``) that forks every sandbox of this process.

    Forking a warm interpreter instead of starting one per run keeps a sandboxed run cheap.
    The helper holds only a scrubbed environment and a socket to us; it exits when we do.
    """

    def __init__(self, python: str) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [python, "-I", "-S", str(_BOOT), "--serve", str(theirs.fileno())],
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


def _launch(python: str, spec: dict[str, object], fds: list[int]) -> int:
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


def _execute(
    root: str, python: str, spec: dict[str, object], cfg: SandboxConfig, stdin: str
) -> tuple[float, bool, bytes]:
    """Run one sandbox; (wall_s, timed out by the backstop, the bootstrap's status report).

    The bootstrap enforces the wall clock itself; ours (``wall + 5 s``) is a backstop that kills
    the sandbox's process group. The status pipe reaches EOF when the sandbox's init exits.
    """
    Path(root, "in.txt").write_text(stdin, encoding="utf-8")
    r, w = os.pipe()
    try:
        with (
            open(os.path.join(root, "in.txt"), "rb") as fin,
            open(os.path.join(root, "out"), "wb") as out,
            open(os.path.join(root, "err"), "wb") as err,
            open(os.path.join(root, "files.json"), "wb") as fl,
        ):
            fds = [fin.fileno(), out.fileno(), err.fileno(), w, fl.fileno()]
            started = time.monotonic()
            try:
                pid = _launch(python, spec, fds)
            finally:
                os.close(w)
        report, timed_out = _read_status(r, cfg.wall_timeout_s + 5.0)
        if timed_out:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            report, _ = _read_status(r, 5.0)
        return time.monotonic() - started, timed_out, report
    finally:
        os.close(r)


def _read_status(fd: int, timeout_s: float) -> tuple[bytes, bool]:
    """Everything written on ``fd`` until EOF; (data, True) when ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return data, True
        chunk = os.read(fd, 65536)
        if not chunk:
            return data, False
        data += chunk


def _kill_uid(uid: int) -> None:
    """Kill every process owned by ``uid`` (rlimits mode: there is no PID namespace)."""
    for _ in range(50):
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        pids.append(int(entry))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def classify(
    wait_status: int | None, cpu_s: float, cfg: SandboxConfig, timed_out: bool
) -> tuple[Status, int | None, int | None, str]:
    """Map a worker's wait status to (status, exit_code, signal, reason).

    Rule: wall timeout -> timeout; no status reported -> killed; SIGXCPU, or SIGKILL after the
    CPU budget was spent -> timeout; SIGXFSZ -> killed (file/output limit); SIGSEGV/ABRT/BUS/FPE/
    ILL -> crash; other signals -> killed; exit ``OOM_EXIT`` -> oom; exit 0 -> ok; else crash.
    """
    if timed_out:
        return "timeout", None, None, "wall-clock limit"
    if wait_status is None:
        return "killed", None, None, "sandbox killed before the program reported"
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cfg.cpu_limit_s):
            return "timeout", None, sig, "cpu-time limit"
        if sig == signal.SIGXFSZ:
            return "killed", None, sig, "file/output size limit"
        if sig in _CRASH_SIGNALS:
            return "crash", None, sig, signal.Signals(sig).name
        return "killed", None, sig, signal.Signals(sig).name
    code = os.WEXITSTATUS(wait_status)
    if code == OOM_EXIT:
        return "oom", code, None, "memory limit"
    return ("ok" if code == 0 else "crash"), code, None, ""


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _collect(
    cfg: SandboxConfig, root: str, wall: float, timed_out: bool, raw: bytes
) -> SandboxResult:
    try:
        report = json.loads(raw) if raw else {}
    except ValueError:
        report = {}
    stdout, out_trunc = _read_capped(os.path.join(root, "out"), cfg.max_output_bytes)
    stderr, err_trunc = _read_capped(os.path.join(root, "err"), cfg.max_output_bytes)
    if os.path.getsize(os.path.join(root, "out")) >= cfg.max_file_bytes:
        out_trunc = True
    cpu = float(report.get("cpu", 0.0))
    if "setup_error" in report:
        status: Status = "error"
        code, sig, reason = None, None, f"sandbox setup failed: {report['setup_error']}"
    else:
        late = timed_out or bool(report.get("timed_out"))
        status, code, sig, reason = classify(report.get("status"), cpu, cfg, late)
    if status == "crash" and code == 70 and "sandbox setup failed" in stderr:
        status, reason = "error", stderr.strip().splitlines()[-1]
    return SandboxResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=code,
        signal=sig,
        wall_s=wall,
        cpu_s=cpu,
        stdout_truncated=out_trunc,
        stderr_truncated=err_trunc,
        reason=reason,
    )


def _files_back(root: str, result: SandboxResult) -> tuple[dict[str, bytes], list[str]]:
    """The workspace the bootstrap copied out (empty when it reported nothing)."""
    raw = Path(root, "files.json").read_bytes()
    try:
        found = json.loads(raw) if raw else {}
        files = {check_name(k): base64.b64decode(v) for k, v in found.get("files", {}).items()}
    except ValueError:
        return {}, ["<unreadable workspace report>"]
    return files, [str(s) for s in found.get("skipped", [])]
