"""Run untrusted code in a subprocess sandbox.

Guarantees (each one tested in ``tests/unit/test_sandbox.py``):

- **Time**: a CPU-time limit (``RLIMIT_CPU``, the kernel kills at the hard limit) and a wall-clock
  timeout (the parent kills the whole process group). Either one yields ``status="timeout"``.
- **Memory**: ``RLIMIT_AS`` per process; a ``MemoryError`` yields ``status="oom"``.
- **Processes**: a fork bomb is contained twice over. (1) The code runs in a new PID namespace
  (``unshare --pid --fork``) under a small reaper that is the namespace's init: when the program
  exits or is killed, the kernel kills every process left in the namespace, including ones that
  escaped the process group with ``setsid``. (2) When the parent is root, the program runs as a
  fresh, unused uid, so ``RLIMIT_NPROC`` (a per-user count that root is exempt from) bounds it.
  Without namespaces the parent kills the process group and, as root, every process of that uid.
- **Network**: the code runs in a new, empty network namespace (``unshare --net``; as non-root a
  user namespace makes that possible), so nothing can be reached. As defence in depth a Python
  audit hook refuses sockets, ``exec``/``spawn``/``subprocess`` and ``ctypes`` in the child.
- **Files**: its own temporary directory as cwd, removed afterwards; ``RLIMIT_FSIZE`` caps every
  file it writes, stdout and stderr included, and the parent returns at most
  ``max_output_bytes`` of each (``*_truncated`` says when more was written).
- **Environment**: scrubbed to ``PATH``, ``HOME``, ``LANG``; the interpreter runs isolated (``-I -S``).

Which isolation was in force is reported in ``SandboxResult.isolation``; the probe runs once per
process. Nothing here needs Docker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "timeout", "oom", "crash", "killed"]

#: Exit code the bootstrap uses when the program raised ``MemoryError``.
OOM_EXIT = 86
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_UID_BASE = 1_000_000  # sandbox uids are unused numbers above this: no /etc/passwd entry needed


class SandboxConfig(BaseModel):
    """Limits for one sandboxed run."""

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
        description="Address-space limit per process (RLIMIT_AS).",
    )
    max_processes: int = Field(
        default=16, ge=1, le=4096, description="Process limit for the sandbox uid (RLIMIT_NPROC)."
    )
    max_file_bytes: int = Field(
        default=1 * 2**20,
        ge=4096,
        description="Largest file the code may write, stdout/stderr included.",
    )
    max_output_bytes: int = Field(
        default=16 * 2**10,
        ge=64,
        description="Bytes of stdout and of stderr returned to the caller.",
    )
    isolate_network: bool = Field(default=True, description="Run in an empty network namespace.")
    block_exec: bool = Field(
        default=True, description="Audit hook refuses exec/spawn/subprocess/ctypes in the child."
    )
    python: str | None = Field(
        default=None,
        description="Interpreter for the code; None picks one whose standard library the "
        "sandbox uid can read (probed once).",
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
    uid: int | None = None  # the unprivileged uid the code ran as (root parents only)


# The trusted bootstrap: runs as `python -I -S -c BOOT spec_json`, is PID 1 of the new PID
# namespace when there is one, forks the worker, reports the worker's wait status on status_fd.
_BOOT = r"""
import json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
pid = os.fork()
if pid:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _, status, ru = os.wait4(pid, 0)
    os.write(spec["status_fd"], json.dumps({"status": status, "cpu": ru.ru_utime + ru.ru_stime}).encode())
    os._exit(0)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; we want the kill
def _limit(name, soft, hard=None):
    resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
_limit("RLIMIT_CPU", spec["cpu"], spec["cpu"] + 1)
_limit("RLIMIT_AS", spec["mem"])
_limit("RLIMIT_FSIZE", spec["fsize"])
_limit("RLIMIT_CORE", 0)
if spec["uid"] is not None:
    _limit("RLIMIT_NPROC", spec["nproc"])
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
os.chdir(spec["cwd"])
os.umask(0o077)
os.close(spec["status_fd"])
if spec["block"]:
    _deny = ("socket.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.",
             "ctypes.", "os.fork_exec", "_posixsubprocess")
    def _hook(event, args):
        if event.startswith(_deny):
            raise PermissionError("sandbox: " + event + " is not allowed")
    sys.addaudithook(_hook)
sys.argv = ["solution.py"]
try:
    src = open("solution.py").read()
    exec(compile(src, "solution.py", "exec"), {"__name__": "__main__"})
except MemoryError:
    os.write(2, b"MemoryError\n")
    os._exit(86)
except SystemExit as e:
    code = e.code
    sys.stdout.flush()
    if code is None or isinstance(code, int):
        os._exit(code or 0)
    sys.stderr.write(str(code) + "\n")
    sys.stderr.flush()
    os._exit(1)
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@functools.cache
def _unshare_prefix(network: bool) -> tuple[str, ...]:
    """The `unshare` invocation that works here, probed once; () when none does.

    Rule: a new PID namespace (with ``--kill-child``) always when possible; a new network
    namespace when asked; as non-root both need a user namespace (``--user``).
    """
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    base = [exe, "--pid", "--fork", "--kill-child"]
    if network:
        base.insert(1, "--net")
    candidates = [base] if os.geteuid() == 0 else []
    candidates.append([exe, "--user", *base[1:]])
    for cmd in candidates:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            probe = subprocess.run([*cmd, "true"], capture_output=True, timeout=10)
            if probe.returncode == 0:
                return tuple(cmd)
    return ()


def _stdlib_readable(python: str) -> bool:
    """True when a process with an unrelated uid can import ``python``'s standard library."""
    probe = "import json, math, traceback, collections"
    uid = _UID_BASE + secrets.randbelow(1_000_000)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            [python, "-I", "-S", "-c", probe],
            capture_output=True,
            timeout=30,
            user=uid,
            group=uid,
            extra_groups=[],
            cwd="/",
        )
        return done.returncode == 0
    return False


@functools.cache
def default_python() -> str:
    """The interpreter sandboxed code runs with (probed once).

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


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for ``proc``; True when it timed out. A pidfd wakes us exactly at exit."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout_s)
            return False
        except subprocess.TimeoutExpired:
            return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(timeout_s * 1000)
    finally:
        os.close(fd)


def _kill_uid(uid: int) -> None:
    """Kill every process owned by ``uid`` (fallback cleanup when there is no PID namespace)."""
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


def _prepare(root: str, code: str, uid: int | None) -> str:
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "solution.py"), "w", encoding="utf-8") as fh:
        fh.write(code)
    if uid is not None:
        os.chmod(root, 0o711)  # the sandbox uid may traverse to work/, not list root/
        os.chown(work, uid, uid)
        os.chown(os.path.join(work, "solution.py"), uid, uid)
    return work


def run(code: str, cfg: SandboxConfig | None = None, stdin: str = "") -> SandboxResult:
    """Run Python ``code`` in the sandbox and return what happened (never raises for its faults)."""
    cfg = cfg or SandboxConfig()
    uid = _UID_BASE + secrets.randbelow(1_000_000) if os.geteuid() == 0 else None
    prefix = _unshare_prefix(cfg.isolate_network)
    isolation = {
        "pid_namespace": bool(prefix),
        "network_namespace": bool(prefix) and "--net" in prefix,
        "own_uid": uid is not None,
        "audit_hook": cfg.block_exec,
    }
    root = tempfile.mkdtemp(prefix="rlstream-sbx-")
    try:
        work = _prepare(root, code, uid)
        spec: dict[str, object] = {
            "cpu": cfg.cpu_limit_s,
            "mem": cfg.memory_bytes,
            "fsize": cfg.max_file_bytes,
            "nproc": cfg.max_processes,
            "uid": uid,
            "cwd": work,
            "block": cfg.block_exec,
        }
        python = cfg.python or default_python()
        wall, timed_out = _execute(
            root, [*prefix, python, "-I", "-S", "-c", _BOOT], spec, cfg, stdin
        )
        _cleanup_uid(uid, bool(prefix))
        result = _collect(cfg, root, wall, timed_out, isolation)
        result.uid = uid
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _execute(
    root: str, argv: list[str], spec: dict[str, object], cfg: SandboxConfig, stdin: str
) -> tuple[float, bool]:
    """Start the bootstrap, wait for it (killing its process group on timeout): (wall_s, timed_out)."""
    work = str(spec["cwd"])
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}
    with open(os.path.join(root, "status"), "wb") as st:
        spec["status_fd"] = st.fileno()
        started = time.monotonic()
        proc = _spawn([*argv, json.dumps(spec)], env, root, st.fileno(), stdin)
        timed_out = _wait(proc, cfg.wall_timeout_s)
        if timed_out:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wall = time.monotonic() - started
    # the group may hold stragglers even after a clean exit when there is no PID namespace
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    return wall, timed_out


def _spawn(
    argv: list[str], env: dict[str, str], root: str, status_fd: int, stdin: str
) -> subprocess.Popen[bytes]:
    in_p = os.path.join(root, "in")
    with open(in_p, "wb") as fh:
        fh.write(stdin.encode())
    with (
        open(in_p, "rb") as fin,
        open(os.path.join(root, "out"), "wb") as out,
        open(os.path.join(root, "err"), "wb") as err,
    ):
        return subprocess.Popen(
            argv,
            stdin=fin,
            stdout=out,
            stderr=err,
            pass_fds=(status_fd,),
            env=env,
            start_new_session=True,  # one process group to kill on timeout
        )


def _cleanup_uid(uid: int | None, namespaced: bool) -> None:
    """Without a PID namespace, kill whatever still runs as the sandbox uid."""
    if not namespaced and uid is not None:
        _kill_uid(uid)


def _collect(
    cfg: SandboxConfig, root: str, wall: float, timed_out: bool, isolation: dict[str, bool]
) -> SandboxResult:
    with open(os.path.join(root, "status"), "rb") as fh:
        raw = fh.read()
    report = json.loads(raw) if raw else None
    wait_status = report["status"] if report else None
    cpu = float(report["cpu"]) if report else 0.0
    status, code, sig, reason = classify(wait_status, cpu, cfg, timed_out)
    stdout, out_trunc = _read_capped(os.path.join(root, "out"), cfg.max_output_bytes)
    stderr, err_trunc = _read_capped(os.path.join(root, "err"), cfg.max_output_bytes)
    if os.path.getsize(os.path.join(root, "out")) >= cfg.max_file_bytes:
        out_trunc = True
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
        isolation=isolation,
    )
