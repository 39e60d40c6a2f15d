"""Run untrusted code behind a boundary, or refuse to.

Isolation modes, strongest first: ``full`` (fresh namespaces, a private root, a fresh uid, no
network, seccomp, cgroups), ``userns`` (the same inside a user namespace, weaker) and
``rlimits`` (not a boundary). ``SandboxConfig.isolation`` names the weakest mode a caller
accepts; ``run`` uses the strongest that works and raises :class:`IsolationUnavailable` rather
than run code with less isolation than asked for.

Rules a maintainer must keep:
- limits hold for the run as a whole (cgroups) and per process (rlimits); the wall clock is
  enforced twice, and the status comes on a descriptor the program never holds;
- files cross by value only; the environment is scrubbed; the interpreter runs with ``-I -S``;
- library folders are root's, read-only, and never on a verdict side's ``sys.path``;
- in a judged run the verdict side cannot be reached from the answer: its own uid, imports only
  from paths the answer cannot write, made before the answer's process exists, two pipes only.

Details: docs/sandbox.md (The sandbox in full).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import importlib.util
import json
import marshal
import os
import re
import secrets
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlstream.envs.sandbox import cgroup as sandbox_cgroup
from rlstream.envs.sandbox import client as sandbox_client
from rlstream.envs.sandbox import zygote as sandbox_zygote
from rlstream.schemas.derive import LOCAL
from rlstream.schemas.errors import RlstreamError

Status = Literal["ok", "timeout", "oom", "crash", "killed", "error"]
Mode = Literal["full", "userns", "rlimits"]
MODES: tuple[Mode, ...] = ("full", "userns", "rlimits")  # strongest first

#: Exit code the bootstrap uses when the program raised ``MemoryError``.
OOM_EXIT = 86
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_UID_BASE = sandbox_zygote.UID_BASE
_BOOT = sandbox_zygote.BOOT
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
MAX_FILES = 64


class IsolationUnavailable(RlstreamError, RuntimeError):
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
    library: tuple[str, ...] = Field(
        default=(),
        max_length=8,
        description="Host folders the program may read (a test runner and what tests need): "
        "bound read-only at the same path in the private root; each must be owned by root and "
        "writable by no one else (checked before every run).",
    )
    python: str | None = Field(
        default=None,
        description="Interpreter for the code; None: this one in the namespaced modes, one "
        "whose standard library the sandbox uid can read in rlimits mode (probed once).",
        json_schema_extra=LOCAL,
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
    memory_peak_bytes: int | None = None  # the run's peak memory, all processes (cgroup runs)


def mechanisms(
    mode: Mode, block_exec: bool, cgroup: bool = False, judged: bool = False
) -> dict[str, bool]:
    """What each mode rests on (recorded with every result); a judged run adds whether its
    verdict side ran as a uid of its own."""
    ns = mode != "rlimits"
    found = {
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
        "cgroup_limits": cgroup,
    }
    if judged:
        found["verdict_own_uid"] = found["own_uid"]
    return found


# ---------------------------------------------------------------- choosing a mode


@functools.cache
def probe_mode(mode: Mode) -> str:
    """ "" when ``mode`` works here, else why not (probed once per process by running a program)."""
    if mode == "full" and os.geteuid() != 0:
        return "needs root (a fresh uid and the mounts need privileges)"
    if mode == "full" and sandbox_cgroup.unavailable():
        return f"per-sandbox limits need cgroups: {sandbox_cgroup.unavailable()}"
    try:
        r = _run_in(mode, "print('ok')", SandboxConfig(wall_timeout_s=20), "", None)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    ok = r.status == "ok" and r.stdout == "ok\n"
    return "" if ok else (r.reason or r.stderr.strip()[-300:] or r.status)


def probe() -> dict[str, str]:
    """Every mode -> "" when it works here, else why not (the service's answer, in a process
    that runs its sandboxes through one)."""
    if (service := sandbox_client.active()) is not None:
        return dict(_ask(service, {"op": "probe"}))
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


# ---------------------------------------------------------------- running


def run(
    code: str,
    cfg: SandboxConfig | None = None,
    stdin: str = "",
    files: Mapping[str, bytes | str] | None = None,
    answer: str | None = None,
) -> SandboxResult:
    """Run Python ``code`` in the sandbox and return what happened.

    ``files`` (relative name -> content) is the workspace the code starts in; when given, the
    result's ``files`` is the workspace afterwards. With ``answer`` the run is *judged*: ``code``
    is the trusted verdict side and ``answer`` the untrusted side's program, each its own process
    and identity (see the module rules; the result's status is the verdict side's). Never raises
    for the program's faults; raises :class:`IsolationUnavailable` when the accepted isolation
    cannot be set up (a judged run in ``rlimits`` mode without root: the two sides would share
    one uid), and ``ValueError`` for a bad file name. Files that cannot be laid out together
    (a file under a file) are the program's fault: a ``crash`` result, nothing run.
    """
    cfg = cfg or SandboxConfig()
    if (service := sandbox_client.active()) is not None:  # this process dropped root
        return _through(service, code, cfg, stdin, files, answer)
    mode = choose_mode(cfg)
    if answer is not None and mode == "rlimits" and os.geteuid() != 0:
        raise IsolationUnavailable(
            "sandbox refused: a judged run in rlimits mode needs root (a fresh uid for the "
            "verdict side and another for the answer); without it the answer could write "
            "what the verdict side imports"
        )
    return _run_in(mode, code, cfg, stdin, files, answer)


def _through(
    service: sandbox_client.Client,
    code: str,
    cfg: SandboxConfig,
    stdin: str,
    files: Mapping[str, bytes | str] | None,
    answer: str | None,
) -> SandboxResult:
    """``run`` by this process's sandbox service (``envs.sandbox.service``): it stays root
    where this process dropped it; what crosses is the programs and the files, by value."""
    given = None
    if files is not None:
        given = {
            k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode()
            for k, v in files.items()
        }
    request = {"op": "run", "code": code, "cfg": cfg.model_dump(mode="json"), "stdin": stdin}
    found = _ask(service, {**request, "files": given, "answer": answer})
    back = found.pop("files")
    result = SandboxResult(**found)
    if back is not None:
        result.files = {k: base64.b64decode(v) for k, v in back.items()}
    return result


def _ask(service: sandbox_client.Client, request: dict[str, object]) -> Any:
    """The service's answer; its refusals raised as the local call would raise them."""
    try:
        return service.ask(request)
    except sandbox_client.ServiceError as exc:
        if exc.kind == "isolation":
            raise IsolationUnavailable(str(exc)) from None
        if exc.kind == "value":
            raise ValueError(str(exc)) from None
        raise OSError(str(exc)) from None


def _run_in(
    mode: Mode,
    code: str,
    cfg: SandboxConfig,
    stdin: str,
    files: Mapping[str, bytes | str] | None,
    answer: str | None = None,
) -> SandboxResult:
    verdict_uid = _UID_BASE + secrets.randbelow(1_000_000)
    answer_uid = _UID_BASE + (verdict_uid - _UID_BASE + 1 + secrets.randbelow(999_999)) % 1_000_000
    uids: list[int | None] = [verdict_uid, answer_uid]  # two draws that never collide
    if mode == "userns" or os.geteuid() != 0:
        uids = [None, None]
    if answer is None:
        uids[1] = None
    root = tempfile.mkdtemp(prefix="rlstream-sbx-")
    cg = _cgroup(cfg)
    try:
        try:
            spec = _stage(root, mode, code, cfg, uids, files, answer)
        except OSError as exc:  # the files given cannot be laid out: the answer's fault
            return _unstaged(exc, mode)
        python, ro_paths = sandbox_zygote.interpreter(mode, cfg.python)
        spec["ro_paths"] = ro_paths + [check_library(p) for p in cfg.library]
        spec["cgroup_tasks"] = cg.tasks_files() if cg else []
        spec["cgroup_leave"] = cg.parent_tasks_files() if cg else []
        wall, stop, report = _execute(root, python, spec, cfg, stdin, cg)
        if mode == "rlimits":
            for uid in uids:
                if uid is not None:
                    _kill_uid(uid)
        result = _collect(cfg, root, wall, stop, report, cg)
        result.mode, result.uid = mode, uids[0]
        result.isolation = mechanisms(mode, cfg.block_exec, cg is not None, answer is not None)
        if files is not None:
            result.files, result.files_skipped = _files_back(root, result)
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if cg is not None:
            cg.remove()


def _unstaged(exc: OSError, mode: Mode) -> SandboxResult:
    """The result of a run whose workspace cannot be laid out (a file under a file, say):
    nothing ran; a failure of what was given, never the sandbox's error."""
    where = f" ({Path(exc.filename).name})" if exc.filename else ""
    reason = f"the workspace cannot be laid out: {exc.strerror or exc}{where}"
    return SandboxResult("crash", "", reason, None, None, 0.0, 0.0, reason=reason, mode=mode)


def _cgroup(cfg: SandboxConfig) -> sandbox_cgroup.Cgroup | None:
    """The run's cgroups where this host has them (else None: per-process rlimits only)."""
    if sandbox_cgroup.unavailable():
        return None
    try:
        return sandbox_cgroup.Cgroup.create(cfg.memory_bytes, cfg.max_processes)
    except OSError as exc:
        raise IsolationUnavailable(f"sandbox refused: cannot make the run's cgroup: {exc}") from exc


def _stage(
    root: str,
    mode: Mode,
    code: str,
    cfg: SandboxConfig,
    uids: list[int | None],
    files: Mapping[str, bytes | str] | None,
    answer: str | None,
) -> dict[str, object]:
    """Write the programs and the workspace into ``root``; the bootstrap's spec."""
    Path(root, "program.py").write_text(code, encoding="utf-8")
    if answer is not None:  # the caller's own programs: compiled here, once per process
        Path(root, "answer.py").write_text(answer, encoding="utf-8")
        Path(root, "program.code").write_bytes(_bytecode(code, "verdict.py"))
        Path(root, "answer.code").write_bytes(_bytecode(answer, "answer.py"))
    owner = uids[1] if answer is not None else uids[0]  # the workspace is the answer's
    work = os.path.join(root, "in" if mode != "rlimits" else "work")
    os.mkdir(work, 0o700)
    for name, content in (files or {}).items():
        path = os.path.join(work, check_name(name))
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        Path(path).write_bytes(data)
    if mode == "rlimits" and owner is not None:
        os.chmod(root, 0o711)  # the sandbox uid may traverse to work/, not list root/
        for dirpath, _dirs, names in os.walk(work):
            os.chown(dirpath, owner, owner)
            for n in names:
                os.chown(os.path.join(dirpath, n), owner, owner)
    if mode != "rlimits":
        os.mkdir(os.path.join(root, "newroot"), 0o755)
    return {
        "mode": mode,
        "root": os.path.join(root, "newroot"),
        "in_dir": work,
        "program": os.path.join(root, "program.py"),
        "answer": os.path.join(root, "answer.py") if answer is not None else None,
        "program_code": os.path.join(root, "program.code") if answer is not None else None,
        "answer_code": os.path.join(root, "answer.code") if answer is not None else None,
        "cwd": "/work" if mode != "rlimits" else work,
        "uid": uids[0],
        "answer_uid": uids[1],
        "owner": owner,
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


@functools.lru_cache(maxsize=32)
def _bytecode(source: str, name: str) -> bytes:
    """``source`` compiled (a judged run's programs are its caller's code, not the answer's),
    with this interpreter's magic number: the bootstrap compiles it itself on a mismatch."""
    return importlib.util.MAGIC_NUMBER + marshal.dumps(compile(source, name, "exec"))


_LIBRARY_LOCK = threading.Lock()


def library_of(modules: tuple[str, ...]) -> str:
    """A root-owned, read-only copy of the importable ``modules`` of this environment (each a
    package folder or a module file), made once per process for each set under a lock: the
    callers of a scorer's threads must all name the same folder (``SandboxConfig.library``).
    ``ValueError`` naming the modules that do not import here."""
    if (service := sandbox_client.active()) is not None:
        return str(_ask(service, {"op": "library", "modules": sorted(set(modules))}))
    with _LIBRARY_LOCK:
        return _library_of(tuple(sorted(set(modules))))


@functools.cache
def _library_of(modules: tuple[str, ...]) -> str:
    specs = {name: importlib.util.find_spec(name) for name in modules}
    missing = [n for n, spec in specs.items() if spec is None or spec.origin is None]
    if missing:
        raise ValueError(f"not importable here: {', '.join(missing)} (install them first)")
    # not under /tmp: the sandbox's own /tmp (a private tmpfs) would hide it
    root = tempfile.mkdtemp(prefix="rlstream-pylib-", dir="/var/tmp")
    atexit.register(shutil.rmtree, root, True)
    for spec in specs.values():
        assert spec is not None and spec.origin is not None
        src = Path(spec.origin)
        if spec.submodule_search_locations:
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(src.parent, Path(root, src.parent.name), ignore=ignore)
        else:
            shutil.copy2(src, Path(root, src.name))
    for dirpath, _dirs, names in os.walk(root):
        os.chmod(dirpath, 0o755)
        for n in names:
            os.chmod(os.path.join(dirpath, n), 0o644)
    return os.path.realpath(root)


def check_library(path: str) -> str:
    """A ``library`` folder: absolute, no link, a folder owned by root and writable by no one
    else, so no sandboxed program can change what another imports from it; else ValueError."""
    st = os.lstat(path) if os.path.isabs(path) else None
    if st is None or not os.path.isdir(path) or os.path.islink(path):
        raise ValueError(f"sandbox library {path!r} must be an absolute path to a folder")
    if st.st_uid != 0 or st.st_mode & 0o022 or os.path.realpath(path) != path:
        raise ValueError(f"sandbox library {path!r} must be root's and writable by no one else")
    return path


def file_above(name: str, names: Collection[str]) -> str | None:
    """The folder of ``name``'s path that ``names`` holds as a file (``pkg/__init__.py`` for
    ``pkg/__init__.py/x``), or None: a workspace cannot lay out both."""
    parts = name.split("/")
    return next(
        ("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in names), None
    )


def check_name(name: str) -> str:
    """A workspace file name: relative, ``/``-separated safe parts, no ``..``; else ValueError."""
    parts = name.split("/")
    if not name or len(parts) > 8 or not all(_NAME.match(p) and p != ".." for p in parts):
        raise ValueError(f"bad workspace file name {name!r}")
    return name


Stop = Literal["", "wall", "cpu"]
_TICK_S = 0.02  # how often a run's CPU budget is checked


def _execute(
    root: str,
    python: str,
    spec: dict[str, object],
    cfg: SandboxConfig,
    stdin: str,
    cg: sandbox_cgroup.Cgroup | None,
) -> tuple[float, Stop, bytes]:
    """Run one sandbox; (wall_s, why we stopped it: "" / "wall" / "cpu", the status report).

    The bootstrap enforces the wall clock itself; ours (``wall + 5 s``) is a backstop. The CPU
    budget of a run with cgroups is ours: every process's CPU time together, checked every
    ``_TICK_S``. Stopping kills every process of the run (its cgroup, else its process group).
    The status pipe reaches EOF when the sandbox's init exits.
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
                pid = sandbox_zygote.launch(python, spec, fds)
            finally:
                os.close(w)
        budget = (lambda: cg.cpu_s() >= cfg.cpu_limit_s) if cg is not None else None
        report, stop = _read_status(r, cfg.wall_timeout_s + 5.0, budget)
        if stop:
            if cg is not None:
                cg.kill()
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            report, _ = _read_status(r, 5.0, None)
        return time.monotonic() - started, stop, report
    finally:
        os.close(r)


def _read_status(
    fd: int, timeout_s: float, over_budget: Callable[[], bool] | None
) -> tuple[bytes, Stop]:
    """Everything written on ``fd`` until EOF, and "" ; or what came so far and "wall" when
    ``timeout_s`` passed first, "cpu" when ``over_budget()`` turned true first."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, "wall"
        if over_budget is not None and over_budget():
            return data, "cpu"
        tick = left if over_budget is None else min(left, _TICK_S)
        if not poller.poll(tick * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return data, ""
        data += chunk


def _kill_uid(uid: int) -> None:
    """Kill every process owned by ``uid`` (rlimits mode: there is no PID namespace)."""

    def owned() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        found.append(int(entry))
        return found

    sandbox_cgroup.kill_until_gone(owned, rounds=50)


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
    cfg: SandboxConfig,
    root: str,
    wall: float,
    stop: Stop,
    raw: bytes,
    cg: sandbox_cgroup.Cgroup | None,
) -> SandboxResult:
    try:
        report = json.loads(raw) if raw else {}
    except ValueError:
        report = {}
    stdout, out_trunc = _read_capped(os.path.join(root, "out"), cfg.max_output_bytes)
    stderr, err_trunc = _read_capped(os.path.join(root, "err"), cfg.max_output_bytes)
    if os.path.getsize(os.path.join(root, "out")) >= cfg.max_file_bytes:
        out_trunc = True
    cpu = cg.cpu_s() if cg is not None else float(report.get("cpu", 0.0))
    if "setup_error" in report:
        status: Status = "error"
        code, sig, reason = None, None, f"sandbox setup failed: {report['setup_error']}"
    elif stop == "cpu":
        status, code, sig, reason = "timeout", None, None, "cpu-time limit (all processes)"
    else:
        late = stop == "wall" or bool(report.get("timed_out"))
        status, code, sig, reason = classify(report.get("status"), cpu, cfg, late)
        if status == "killed" and sig == signal.SIGKILL and cg is not None and cg.oom_kills():
            status, reason = "oom", "memory limit (all processes)"
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
        memory_peak_bytes=cg.memory_peak() if cg is not None else None,
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
