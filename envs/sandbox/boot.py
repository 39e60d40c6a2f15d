"""The sandbox's trusted bootstrap: builds the private root, then runs the program as a nobody.

Run only by :mod:`rlstream.envs.sandbox`, through its helper ``python -I -S boot.py --serve FD``
(standard library only), which forks one launcher per run. The launcher joins the run's cgroups
before it forks anything; in the namespaced modes its child is PID 1 of fresh namespaces and
(1) mounts the private root, (2) copies the workspace in, pivots into the root and detaches the
old one, (3) forks the worker (rlimits, an unprivileged identity, no-new-privs, seccomp, the
audit hook) and (4) as init enforces the wall clock, kills what is left, copies the workspace
out and reports the status on a descriptor the worker never had.

Rules a maintainer must keep: nothing the answer can write is ever imported, read or executed by
a judged run's verdict side; anything failing during set-up is ``setup_error`` and the program
does not run.

Details: docs/sandbox.md (The trusted bootstrap).
"""

from __future__ import annotations

import ast  # noqa: F401  (warm for every run: the verdict side parses tests with it)
import binascii
import contextlib
import ctypes
import importlib.util
import json
import linecache
import marshal
import os
import resource
import signal
import stat
import struct
import sys
import time
import traceback
import types

if __package__:  # imported (tests): from the package
    from rlstream.envs.sandbox.root import MS_REC, RootSetupError, build_root, check, libc, mount
else:  # run as the bootstrap: from its own directory, which no program's sys.path keeps
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from root import (  # type: ignore[no-redef]
            MS_REC,
            RootSetupError,
            build_root,
            check,
            libc,
            mount,
        )
    finally:
        del sys.path[0]

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 22, 38, 36
SECCOMP_MODE_FILTER = 2
OOM_EXIT = 86

#: Per-architecture audit arch and syscall numbers the filter denies (x86_64 is the tested one).
_ARCH = {
    "x86_64": (0xC000003E, 56, 435),
    "aarch64": (0xC00000B7, 220, 435),
}
_DENIED = {
    # execve execveat unshare setns mount umount2 pivot_root chroot ptrace bpf perf_event_open
    # userfaultfd keyctl add_key request_key io_uring_setup open_tree move_mount fsopen fsconfig
    # fsmount kexec_load init_module finit_module open_by_handle_at process_vm_readv
    # process_vm_writev mount_setattr pidfd_getfd
    "x86_64": (59, 322, 272, 308, 165, 166, 155, 161, 101, 321, 298, 323, 250, 248, 249, 425,
               428, 429, 430, 431, 432, 246, 175, 313, 304, 310, 311, 442, 438),
    "aarch64": (221, 281, 97, 268, 40, 39, 41, 51, 117, 280, 241, 282, 219, 217, 218, 425,
                428, 429, 430, 431, 432, 104, 105, 273, 265, 270, 271, 442, 438),
}  # fmt: skip
_NS_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def seccomp_program(machine: str) -> bytes:
    """The BPF filter: deny (EPERM) the syscalls in ``_DENIED``, clone with namespace flags,
    x32 syscalls and other architectures; clone3 fails with ENOSYS (callers fall back to clone,
    whose flags the filter can see); allow the rest."""
    audit_arch, clone_nr, clone3_nr = _ARCH[machine]
    deny, nosys, allow = 0x00050000 | 1, 0x00050000 | 38, 0x7FFF0000
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    denied = _DENIED[machine]
    n = len(denied)
    prog = [
        (ld_abs, 0, 0, 4),  # arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, deny),
        (ld_abs, 0, 0, 0),  # syscall number
        (jge, n + 6, 0, 0x40000000),  # x32 ABI -> deny
    ]
    prog += [(jeq, n - i + 5, 0, nr) for i, nr in enumerate(denied)]  # -> deny
    prog += [
        (jeq, 4, 0, clone3_nr),  # -> nosys
        (jeq, 0, 2, clone_nr),
        (ld_abs, 0, 0, 16),  # clone flags (low word of arg 0)
        (jset, 2, 0, _NS_FLAGS),  # -> deny
        (ret, 0, 0, allow),
        (ret, 0, 0, nosys),
        (ret, 0, 0, deny),
    ]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _install_seccomp() -> None:
    code = seccomp_program(os.uname().machine)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0), "seccomp")


def _drop_capabilities() -> None:
    """userns mode: the program keeps the namespace's uid 0 but holds no capability at all."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    check(libc.capset(ctypes.c_char_p(header), data), "capset")


def _limit(name: str, soft: int, hard: int | None = None) -> None:
    resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))


def _become_nobody(spec: dict, who: dict) -> None:
    """Limits, then ``who``'s identity: its uid (or no capabilities), its descriptors, its cwd."""
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; we want the kill
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if who["role"] == "verdict":
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt a test could swallow
    _limit("RLIMIT_CPU", spec["cpu"], spec["cpu"] + 1)
    _limit("RLIMIT_AS", spec["mem"])
    _limit("RLIMIT_FSIZE", spec["fsize"])
    _limit("RLIMIT_CORE", 0)
    _limit("RLIMIT_NOFILE", 256)
    uid = who["uid"]
    if uid is not None or spec["mode"] == "userns":
        _limit("RLIMIT_NPROC", spec["nproc"])  # counted per user (per user namespace)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    elif spec["mode"] == "userns":
        _drop_capabilities()
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    os.dup2(who["setup_fd"], SETUP_FD)
    who["setup_fd"] = SETUP_FD
    _keep_fds(who["fds"], who["stdin"])
    os.chdir(who["cwd"])
    os.umask(0o077)


def _keep_fds(fds: list[int], stdin: bool) -> None:
    """Descriptors 0-2 (0 is /dev/null unless ``stdin``), ``fds`` as 3, 4, ...; nothing else."""
    if not stdin:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    parked = [os.dup2(fd, 200 + i) for i, fd in enumerate(fds)]  # under RLIMIT_NOFILE
    os.closerange(3, 200)
    for i, fd in enumerate(parked):
        os.dup2(fd, 3 + i)
    os.closerange(3 + len(fds), SETUP_FD)
    os.closerange(SETUP_FD + 1, 65536)


def _verdict_path(answer_uid: int | None) -> list[str]:
    """The verdict side's ``sys.path``: the interpreter's own entries the answer cannot write.

    Rule: an entry (or, when it does not exist, its closest existing parent) stays when it is on
    a read-only mount, or owned by root and writable by nobody else (and not by ``answer_uid``).
    The workspace, the cwd, ``/tmp`` and ``/dev/shm`` are never entries.
    """
    keep = []
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue
        probe = entry
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        st = os.stat(probe)
        read_only = os.statvfs(probe).f_flag & os.ST_RDONLY
        owned = st.st_uid == 0 and st.st_uid != answer_uid and not st.st_mode & 0o022
        if read_only or owned:
            keep.append(entry)
    return keep


def _audit_hook(event: str, args: tuple) -> None:
    """Defence in depth under the seccomp filter. Its rules are constants of its own code: a code
    object cannot be changed, and replacing a function's ``__code__`` is refused here, so nothing
    the program can reach (a module global, a closure cell) switches it off."""
    if event.startswith(
        ("socket.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.",
         "ctypes.", "os.fork_exec", "_posixsubprocess")
    ) or (event == "object.__setattr__" and args[1] == "__code__"):  # fmt: skip
        raise PermissionError("sandbox: " + event + " is not allowed")


SETUP_FD = 255  # a worker's set-up channel to init while it sets up (under RLIMIT_NOFILE)
_setup_errors: list[str] = []  # init's: what a worker's set-up channel said


def worker(spec: dict, who: dict, program: tuple[str, object]) -> None:
    """One program's process (never returns): limits, identity, filters, then the program.

    A set-up failure is written on the set-up channel (``who["setup_fd"]``, a pipe to init,
    closed before the program runs), so only the sandbox, never a program's exit status or
    output, can say that set-up failed. The program runs as the module ``__main__`` of its own
    (the bootstrap's module is not in ``sys.modules``). The verdict side of a judged run imports
    only from ``_verdict_path`` and writes no bytecode; any other program also imports from its
    cwd (the workspace).
    """
    try:
        path = _verdict_path(spec["answer_uid"]) if who["role"] == "verdict" else None
        _become_nobody(spec, who)
        if spec["block"]:
            _install_seccomp()
            sys.addaudithook(_audit_hook)
    except BaseException as exc:  # report, never run the program
        with contextlib.suppress(OSError):
            os.write(who["setup_fd"], f"{who['role']}: {exc}".encode()[:4000])
        os._exit(70)
    os.close(who["setup_fd"])
    if path is None:
        path = [who["cwd"], *sys.path]
    else:
        sys.dont_write_bytecode = True
    sys.path[:] = path
    sys.path_importer_cache.clear()
    _run_program(program, who["name"])


def _run_program(program: tuple[str, object], name: str) -> None:
    source, code = program
    if not isinstance(code, types.CodeType) or code.co_filename != name:
        code = compile(source, name, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = name
    sys.modules["__main__"] = main
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    sys.argv = [name]
    try:
        exec(code, main.__dict__)
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(OOM_EXIT)
    except SystemExit as e:
        code = e.code
        sys.stdout.flush()
        if code is None or isinstance(code, int):
            os._exit(code or 0)
        sys.stderr.write(str(code) + "\n")
        sys.stderr.flush()
        os._exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Clock:
    """The wall clock, enforced by this process (init of the namespace, or the workers' parent)."""

    def __init__(self, spec: dict) -> None:
        self.spec, self.group, self.expired = spec, 0, False
        signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, float(spec["wall"]))

    def _expire(self, signum: int, frame: object) -> None:
        self.expired = True
        kill_everything(self.spec, self.group)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def kill_everything(spec: dict, group: int) -> None:
    """Kill what the programs started: the whole namespace as its init, else the programs'
    process group and every process of their uids."""
    if spec["mode"] != "rlimits":
        _kill(-1)  # from a namespace's init: every process in the namespace but init
        return
    if group > 0:
        _kill(-group)
    uids = {spec["uid"], spec["answer_uid"]} - {None}
    if uids:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid in uids:
                        _kill(int(entry))
                except OSError:
                    pass


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def supervise(spec: dict, pid: int, clock: _Clock) -> dict:
    """Wait for the program (the verdict side of a judged run) under the wall clock, kill and
    reap everything left, return the report: its wait status, and the CPU time of every
    process reaped here (all of them: init of the namespace, or a subreaper in rlimits mode)."""
    status = None
    while status is None:
        try:
            got, st, _ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if got == pid:
            status = st
    clock.stop()
    kill_everything(spec, clock.group)
    # kill and reap the rest (nothing else will): kill(-1) from a namespace's init is one sweep
    # that no fork escapes; rlimits mode sweeps by uid and must repeat until nothing is left
    flags = os.WNOHANG if spec["mode"] == "rlimits" else 0
    for _ in range(5000):
        try:
            if os.wait4(-1, flags)[0] == 0:
                kill_everything(spec, clock.group)
                time.sleep(0.001)
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report: dict[str, object] = {
        "status": status, "cpu": usage.ru_utime + usage.ru_stime, "timed_out": clock.expired
    }  # fmt: skip
    if _setup_errors:
        report["setup_error"] = "; ".join(_setup_errors)
    return report


def collect(top: str, max_files: int, max_bytes: int) -> dict:
    """The workspace's regular files (base64), walked by descriptor: no link is ever followed."""
    out: dict[str, str] = {}
    budget = [max_bytes]
    skipped: list[str] = []
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _collect_dir(fd, "", out, budget, max_files, skipped)
    finally:
        os.close(fd)
    return {"files": out, "skipped": skipped[:20]}


def _collect_dir(dfd: int, prefix: str, out: dict, budget: list, cap: int, skipped: list) -> None:
    for name in sorted(os.listdir(dfd)):
        rel = prefix + name
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags, dir_fd=dfd)
        except OSError:
            skipped.append(rel)  # a link, or unreadable
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode) and prefix.count("/") < 8:
                _collect_dir(fd, rel + "/", out, budget, cap, skipped)
            elif stat.S_ISREG(st.st_mode) and len(out) < cap and st.st_size <= budget[0]:
                data = os.read(fd, st.st_size + 1)[: budget[0]]
                budget[0] -= len(data)
                out[rel] = binascii.b2a_base64(data, newline=False).decode()
            else:
                skipped.append(rel)
        finally:
            os.close(fd)


def _read_program(spec: dict, key: str) -> tuple[str, object]:
    """(source, code or None): a judged run's programs come compiled by the parent (its own
    trusted code, compiled once per process), when this interpreter reads its bytecode."""
    with open(spec[key], encoding="utf-8") as fh:
        source = fh.read()
    code = None
    if spec.get(key + "_code"):
        with open(spec[key + "_code"], "rb") as fh:
            data = fh.read()
        if data[:4] == importlib.util.MAGIC_NUMBER:
            code = marshal.loads(data[4:])
    return source, code


def init_main(spec: dict) -> None:
    """The sandbox's supervisor (init of its PID namespace): build, run, police, report."""
    status_fd, files_fd = spec["status_fd"], spec["files_fd"]
    try:
        sources = {key: _read_program(spec, key) for key in ("program", "answer") if spec[key]}
        if spec["mode"] != "rlimits":
            check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
            build_root(spec)
        else:
            check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    except (RootSetupError, OSError) as exc:
        os.write(status_fd, json.dumps({"setup_error": str(exc)}).encode())
        os._exit(3)
    clock = _Clock(spec)
    if "answer" in sources:
        pid = _start_judged(spec, sources["program"], sources["answer"], clock)
    else:
        who = {"role": "program", "uid": spec["uid"], "cwd": spec["cwd"], "fds": [],
               "stdin": True, "name": "main.py"}  # fmt: skip
        pid = clock.group = _fork(spec, who, sources["program"], 0)
    report = supervise(spec, pid, clock)
    if files_fd >= 0:
        try:
            found = collect(spec["cwd"], spec["max_files"], spec["max_collect"])
        except OSError as exc:
            found = {"files": {}, "skipped": [], "error": str(exc)}
        with os.fdopen(files_fd, "w") as fh:
            json.dump(found, fh)
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def _fork(spec: dict, who: dict, program: tuple[str, object], group: int) -> int:
    """Fork a worker for ``who`` (in rlimits mode it joins process group ``group``, or leads
    its own); its pid, once it finished setting up (what failed is in ``_setup_errors``)."""
    setup_r, setup_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(setup_r)
        who["setup_fd"] = setup_w
        if spec["mode"] == "rlimits":
            os.setpgid(0, group)
        elif who["role"] == "answer":
            os.setsid()  # no process group shared with the verdict side to signal
        worker(spec, who, program)
    os.close(setup_w)
    with os.fdopen(setup_r, "rb") as channel:  # EOF once the worker's set-up ended
        failed = channel.read(4001)
    if failed:
        _setup_errors.append(failed.decode("utf-8", "replace"))
    return pid


def _start_judged(
    spec: dict, verdict: tuple[str, object], answer: tuple[str, object], clock: _Clock
) -> int:
    """A judged run's two processes; the verdict side's pid.

    The verdict side starts first, with stdin, a pipe to the answer (fd 4), one from it (fd 3)
    and a start pipe (fd 5). Only when it writes a byte on fd 5 (after it imported what its
    tests need) is the answer's process forked: its own uid, the workspace as cwd, stdin
    ``/dev/null``, the other ends of the two pipes (fd 3 requests, fd 4 replies) and nothing
    else. Another uid cannot signal the verdict side; in ``userns`` mode (one uid for both) the
    answer's process is PID 1 of a PID namespace of its own, where the verdict side has no pid. A verdict side that exits without the byte never meets the answer.
    """
    to_answer_r, to_answer_w = os.pipe()
    from_answer_r, from_answer_w = os.pipe()
    start_r, start_w = os.pipe()
    judge = {"role": "verdict", "uid": spec["uid"], "cwd": "/", "stdin": True,
             "fds": [from_answer_r, to_answer_w, start_w], "name": "verdict.py"}  # fmt: skip
    pid = clock.group = _fork(spec, judge, verdict, 0)
    for fd in (from_answer_r, to_answer_w, start_w):
        os.close(fd)
    with os.fdopen(start_r, "rb", buffering=0) as start:
        go = start.read(1)  # EOF when the verdict side exits (or the clock killed it)
    if go:
        who = {"role": "answer", "uid": spec["answer_uid"], "cwd": spec["cwd"], "stdin": False,
               "fds": [to_answer_r, from_answer_w], "name": "answer.py"}  # fmt: skip
        try:
            if spec["mode"] == "userns":  # one uid for both: a PID namespace of its own, with
                # no pid to signal the verdict side by (other modes: another uid can't)
                check(libc.unshare(0x20000000), "unshare the answer's PID namespace")
            _fork(spec, who, answer, pid)
        except (RootSetupError, OSError) as exc:  # no answer: the sandbox's error, not a fail
            _setup_errors.append(f"answer: {exc}")
    os.close(to_answer_r)
    os.close(from_answer_w)
    return pid


def _unshare(mode: str) -> None:
    """Enter fresh namespaces (children enter the PID one); mounts stop propagating."""
    uid, gid = os.getuid(), os.getgid()
    flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
    if mode == "userns":
        flags |= 0x10000000
    check(libc.unshare(flags), "unshare")
    if mode == "userns":
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):  # fmt: skip
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    mount(None, "/", None, MS_REC | (1 << 18), None)  # MS_PRIVATE


def launch(spec: dict, fds: list[int]) -> None:
    """One sandbox (never returns): namespaces, then its init as our only child."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # one process group for the parent's backstop kill
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    spec["status_fd"], spec["files_fd"] = fds[3], fds[4]
    try:
        for tasks in spec["cgroup_tasks"]:  # the run's cgroups, before anything is forked
            with open(tasks, "w", encoding="ascii") as fh:
                fh.write("0")  # this thread, the launcher's only one
        if spec["mode"] != "rlimits":
            _unshare(spec["mode"])
    except (RootSetupError, OSError) as exc:
        os.write(fds[3], json.dumps({"setup_error": str(exc)}).encode())
        os._exit(3)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() not in (0, me):  # 0: our parent is outside the new PID namespace
            os._exit(3)
        init_main(spec)
    for tasks in spec["cgroup_leave"]:  # init holds the run's cgroups; we only wait
        with contextlib.suppress(OSError), open(tasks, "w", encoding="ascii") as fh:
            fh.write("0")
    os.closerange(3, 65536)
    os.waitpid(pid, 0)
    os._exit(0)


FDS = 5  # stdin, stdout, stderr, status (write end of a pipe), files report


def serve(sock_fd: int) -> None:
    """The zygote: per request (spec JSON + ``FDS`` descriptors) fork one sandbox, reply its pid.

    Started once per parent process; exits when the parent's end of the socket closes.
    """
    import socket

    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our direct children
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, FDS)
        except OSError:
            return
        if not msg:
            return
        reply: dict[str, object]
        try:
            if len(fds) != FDS:
                raise ValueError(f"expected {FDS} descriptors, got {len(fds)}")
            spec = json.loads(msg)
            pid = os.fork()
        except (ValueError, OSError) as exc:
            reply = {"error": str(exc)}
        else:
            if pid == 0:
                sock.close()
                launch(spec, fds)
            reply = {"pid": pid}
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    serve(int(sys.argv[2]) if sys.argv[1:2] == ["--serve"] else -1)
