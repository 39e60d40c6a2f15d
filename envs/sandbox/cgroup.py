"""One cgroup per sandbox run: memory, CPU time and processes capped for the sandbox as a whole.

Rules and guarantees:

- A run gets a fresh cgroup in each of the v1 ``memory``, ``cpuacct`` and ``pids`` hierarchies,
  made under this process's own cgroup of that hierarchy (so a sandbox stays inside whatever
  limits its caller is under), named ``rlstream-sbx-PID-RANDOM``. The sandbox's launcher joins
  them before it forks anything, so every process of the run, the bootstrap's included, is in
  them, and nothing can leave: moving a process between cgroups needs root outside the sandbox.
- Caps: ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted)
  is the memory of all processes together, the scratch tmpfs's pages included; ``pids.max`` is
  the number of tasks (threads count); CPU time is a budget for all processes together, read
  from ``cpuacct.usage``: the caller polls :meth:`Cgroup.cpu_s` and calls :meth:`kill` when it
  is spent (the kernel has no CPU-seconds cap, only a rate).
- :meth:`Cgroup.remove` kills whatever is left in the cgroup and removes it; runs always remove
  theirs (``finally``), and the cgroups of a process that died mid-run are removed by the next
  process that probes (:func:`unavailable`), so the host keeps no trace of a run.
- Where the hierarchies are missing or not writable (no root, cgroup v2 only) :func:`unavailable`
  says why (probed once per process); the sandbox then refuses its ``full`` mode and records
  ``cgroup_limits: false`` in the weaker modes, which fall back to per-process rlimits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import time
from collections.abc import Callable

ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "cpuacct", "pids")
#: Tasks of the bootstrap itself (launcher and init) on top of the program's own processes.
BOOTSTRAP_TASKS = 2


def _own_path(controller: str) -> str | None:
    """This process's cgroup in the v1 hierarchy of ``controller`` (None when not mounted)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _n, names, path = line.split(":", 2)
        if controller in names.split(","):
            return os.path.join(ROOT, controller, path.lstrip("/"))
    return None


@functools.cache
def unavailable() -> str:
    """ "" when per-sandbox cgroups work here, else why not (probed once: make one, remove it)."""
    if os.geteuid() != 0:
        return "cgroups need root"
    for controller in CONTROLLERS:
        path = _own_path(controller)
        if path is None or not os.path.isdir(path):
            return f"no cgroup v1 {controller!r} hierarchy mounted under {ROOT}"
    try:
        Cgroup.create(64 * 2**20, 4).remove()
    except OSError as exc:
        return f"cannot make a cgroup: {exc}"
    _sweep()
    return ""


def _sweep() -> None:
    """Remove the cgroups of runs whose process died before it could (left empty by the kernel:
    a sandbox dies with its launcher's init)."""
    for controller in CONTROLLERS:
        parent = _own_path(controller)
        with contextlib.suppress(OSError):
            for name in os.listdir(parent or ""):
                owner = name.split("-")[2] if name.startswith("rlstream-sbx-") else ""
                if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(parent or "", name))


class Cgroup:
    """The cgroups of one sandbox run (see the module rules)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths
        self._usage = os.open(os.path.join(paths["cpuacct"], "cpuacct.usage"), os.O_RDONLY)

    @classmethod
    def create(cls, memory_bytes: int, max_tasks: int) -> Cgroup:
        """Fresh cgroups with the caps set; OSError (and nothing left behind) when it fails."""
        name = f"rlstream-sbx-{os.getpid()}-{secrets.token_hex(4)}"
        paths: dict[str, str] = {}
        try:
            for controller in CONTROLLERS:
                parent = _own_path(controller)
                if parent is None:
                    raise OSError(f"no cgroup v1 {controller!r} hierarchy")
                paths[controller] = os.path.join(parent, name)
                os.mkdir(paths[controller], 0o700)
            mem = paths["memory"]
            _write(os.path.join(mem, "memory.limit_in_bytes"), memory_bytes)
            with contextlib.suppress(FileNotFoundError):  # swap accounting is optional
                _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), memory_bytes)
            _write(os.path.join(paths["pids"], "pids.max"), max_tasks + BOOTSTRAP_TASKS)
            return cls(paths)
        except OSError:
            for path in paths.values():
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise

    def tasks_files(self) -> list[str]:
        """The ``tasks`` files the launcher writes ``0`` into to join every cgroup. A thread
        moving itself skips the kernel's global threadgroup lock (a ``cgroup.procs`` write
        waits for an RCU grace period, milliseconds per run); the launcher has one thread."""
        return [os.path.join(p, "tasks") for p in self.paths.values()]

    def parent_tasks_files(self) -> list[str]:
        """The ``tasks`` files of the cgroups the run's were made in: the launcher moves back
        there once it forked the sandbox's init, so the run's cgroups empty when init exits."""
        return [os.path.join(os.path.dirname(p), "tasks") for p in self.paths.values()]

    def cpu_s(self) -> float:
        """CPU seconds used by every process of the run so far (``cpuacct.usage``)."""
        return int(os.pread(self._usage, 32, 0) or b"0") / 1e9

    def memory_peak(self) -> int:
        """The most memory the run held at once, in bytes (``memory.max_usage_in_bytes``)."""
        return _read_int(os.path.join(self.paths["memory"], "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory cap (``oom_kill`` of ``memory.oom_control``)."""
        path = os.path.join(self.paths["memory"], "memory.oom_control")
        with contextlib.suppress(OSError), open(path, encoding="ascii") as fh:
            for line in fh:
                key, _sp, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def pids(self) -> list[int]:
        """Processes in the run's cgroup now."""
        with open(os.path.join(self.paths["pids"], "cgroup.procs"), encoding="ascii") as fh:
            return [int(p) for p in fh.read().split()]

    def kill(self) -> None:
        """SIGKILL every process of the run until none is left (forks are capped by pids.max)."""
        kill_until_gone(self.pids)

    def remove(self) -> None:
        """Kill what is left and remove the cgroups (retried while the kernel still counts exits)."""
        self.kill()
        os.close(self._usage)
        for path in self.paths.values():
            for attempt in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 99:
                        raise
                    self.kill()
                    time.sleep(0.002)


def kill_until_gone(find: Callable[[], list[int]], rounds: int = 200) -> None:
    """SIGKILL the processes ``find()`` lists until it lists none (or ``rounds`` passed);
    an OSError from ``find`` means there is nothing left to look at."""
    for _ in range(rounds):
        try:
            left = find()
        except OSError:
            return
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


def _write(path: str, value: int) -> None:
    with open(path, "w", encoding="ascii") as fh:
        fh.write(str(value))


def _read_int(path: str) -> int:
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as fh:
        return int(fh.read().strip())
    return 0
