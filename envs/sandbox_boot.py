"""The sandbox's trusted bootstrap: builds the private root, then runs the program as a nobody.

Run only by :mod:`rlstream.envs.sandbox` as ``python -I -S sandbox_boot.py SPEC_JSON`` (standard
library only, nothing of rlstream is importable here). In the namespaced modes it is PID 1 of a
fresh PID namespace inside fresh mount, network, IPC and UTS namespaces (and, in ``userns`` mode,
a user namespace), and it:

1. mounts a small tmpfs as the new root holding read-only binds of ``/usr`` (and ``/bin``,
   ``/lib*``, ``/sbin`` or their symlinks), the interpreter's prefix and ``/etc/ld.so.cache``;
   ``/dev`` with only null, zero, full, random and urandom; a fresh ``/proc`` (this namespace's
   processes only); and one size-capped scratch tmpfs shown as ``/work`` (the workspace, the
   cwd), ``/tmp`` and ``/dev/shm``: together they are the program's whole disk;
2. copies the workspace files in, ``pivot_root``s into the new root, detaches the old one (no
   path leads back to the host) and remounts ``/`` read-only;
3. forks the worker, which sets its rlimits, becomes an unprivileged identity (a fresh uid as
   root; no capabilities in ``userns`` mode), sets no-new-privs and non-dumpable, closes every
   descriptor but 0-2, installs the seccomp filter (no ``exec``, no new namespaces, no mounts,
   no ptrace, no bpf, no io_uring, ...) and a Python audit hook, then runs the program;
4. as init, enforces the wall clock itself (so it holds even when the judge that started it
   died), kills every process left in the namespace once the worker ended, copies the
   workspace back out (regular files only, never following a link, capped) and reports the
   worker's wait status on a descriptor the worker never had.

In ``rlimits`` mode (no namespaces; a named weaker mode) only steps 3-4 apply, in a host
directory. Anything failing during set-up is reported as ``setup_error`` and the program does
not run.
"""

from __future__ import annotations

import binascii
import contextlib
import ctypes
import json
import linecache
import os
import resource
import signal
import stat
import struct
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_RELATIME = 32, 4096, 16384, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 22, 38
SECCOMP_MODE_FILTER = 2
OOM_EXIT = 86
DEVICES = ("null", "zero", "full", "random", "urandom")

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


class SetupError(Exception):
    """The sandbox could not be built; the program must not run."""


_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def _locked_flags(path: str) -> int:
    """Mount flags a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)
    return flags | (MS_RELATIME if f & 4096 else 0)


def _bind_ro(src: str, dst: str) -> None:
    _mount(src, dst, None, MS_BIND | MS_REC, None)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(dst)
    _mount(None, dst, None, flags, None)


def _mkdirs(root: str, path: str) -> str:
    """``root + path`` with every missing directory created 0755 (traversable by the nobody)."""
    target = root
    for part in path.strip("/").split("/"):
        target = os.path.join(target, part)
        if not os.path.isdir(target):
            os.mkdir(target, 0o755)
    return target


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def _system_dirs(root: str, ro_paths: list[str]) -> None:
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind_ro(host, _mkdirs(root, host))
    _bind_ro("/usr", _mkdirs(root, "/usr"))
    for path in ro_paths:
        if not path.startswith("/usr/"):
            _bind_ro(path, _mkdirs(root, path))
    etc = _mkdirs(root, "/etc")
    if os.path.isfile("/etc/ld.so.cache"):
        _touch(os.path.join(etc, "ld.so.cache"))
        _bind_ro("/etc/ld.so.cache", os.path.join(etc, "ld.so.cache"))


def _devices(root: str) -> None:
    dev = _mkdirs(root, "/dev")
    for name in DEVICES:
        _touch(os.path.join(dev, name))
        _mount(f"/dev/{name}", os.path.join(dev, name), None, MS_BIND, None)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, os.path.join(dev, name))
    os.symlink("/proc/self/fd/1", os.path.join(dev, "stdout"))
    os.symlink("/proc/self/fd/2", os.path.join(dev, "stderr"))


def _scratch(root: str, spec: dict) -> None:
    """One size-capped tmpfs shown as /work, /tmp and /dev/shm: the program's whole disk."""
    scratch = _mkdirs(root, "/.scratch")
    opts = f"size={spec['disk']},nr_inodes={spec['inodes']},mode=755"
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    owner = spec["uid"] if spec["uid"] is not None else 0
    for name, where, mode in (("work", "/work", 0o700), ("tmp", "/tmp", 0o1777),
                              ("shm", "/dev/shm", 0o1777)):  # fmt: skip
        src = os.path.join(scratch, name)
        os.mkdir(src)
        os.chmod(src, mode)
        os.chown(src, owner, owner)
        _mount(src, _mkdirs(root, where), None, MS_BIND, None)
    _copy_in(spec["in_dir"], os.path.join(root, "work"), owner)
    _check(_libc.umount2(scratch.encode(), MNT_DETACH), "umount scratch")
    os.rmdir(scratch)


def _copy_in(src: str, dst: str, owner: int) -> None:
    """The workspace files the parent staged, owned by the sandbox identity."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        if rel != ".":
            os.mkdir(target, 0o700)
            os.chown(target, owner, owner)
        dirnames.sort()
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                data = fh.read()
            fd = os.open(os.path.join(target, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.fchown(fd, owner, owner)
            os.close(fd)


def build_root(spec: dict) -> None:
    """Steps 1-2 of the module docstring; afterwards ``/`` is the private root."""
    root = spec["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=755")
    _system_dirs(root, spec["ro_paths"])
    _devices(root)
    _scratch(root, spec)
    _mount("proc", _mkdirs(root, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.mkdir(os.path.join(root, ".old"))
    os.chdir(root)
    _check(_libc.syscall(_pivot_root_nr(), b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _pivot_root_nr() -> int:
    return {"x86_64": 155, "aarch64": 41}[os.uname().machine]


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
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0), "seccomp")


def _drop_capabilities() -> None:
    """userns mode: the program keeps the namespace's uid 0 but holds no capability at all."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    _check(_libc.capset(ctypes.c_char_p(header), data), "capset")


def _limit(name: str, soft: int, hard: int | None = None) -> None:
    resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))


def _become_nobody(spec: dict) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; we want the kill
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    _limit("RLIMIT_CPU", spec["cpu"], spec["cpu"] + 1)
    _limit("RLIMIT_AS", spec["mem"])
    _limit("RLIMIT_FSIZE", spec["fsize"])
    _limit("RLIMIT_CORE", 0)
    _limit("RLIMIT_NOFILE", 256)
    uid = spec["uid"]
    if uid is not None or spec["mode"] == "userns":
        _limit("RLIMIT_NPROC", spec["nproc"])  # counted per user (per user namespace)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    elif spec["mode"] == "userns":
        _drop_capabilities()
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    os.closerange(3, 65536)
    os.chdir(spec["cwd"])
    os.umask(0o077)


_DENY_EVENTS = ("socket.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.",
                "ctypes.", "os.fork_exec", "_posixsubprocess")  # fmt: skip


def _audit_hook(event: str, args: tuple) -> None:
    if event.startswith(_DENY_EVENTS):
        raise PermissionError("sandbox: " + event + " is not allowed")


def worker(spec: dict, source: str) -> None:
    """The program's process (never returns): limits, identity, filters, then the program."""
    try:
        _become_nobody(spec)
        if spec["block"]:
            _install_seccomp()
            sys.addaudithook(_audit_hook)
    except BaseException as exc:  # report, never run the program
        os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(70)
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    sys.argv = ["main.py"]
    sys.path.insert(0, spec["cwd"])  # the workspace's modules are importable
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
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
    """The wall clock, enforced by this process (init of the namespace, or the worker's parent)."""

    def __init__(self, spec: dict, pid: int) -> None:
        self.spec, self.pid, self.expired = spec, pid, False
        signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, float(spec["wall"]))

    def _expire(self, signum: int, frame: object) -> None:
        self.expired = True
        kill_everything(self.spec, self.pid)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def kill_everything(spec: dict, pid: int) -> None:
    """Kill what the program started: the whole namespace as its init, else its group and uid."""
    if spec["mode"] != "rlimits":
        _kill(-1)  # from a namespace's init: every process in the namespace but init
        return
    _kill(-pid)
    if spec["uid"] is not None:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid == spec["uid"]:
                        _kill(int(entry))
                except OSError:
                    pass


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def supervise(spec: dict, pid: int) -> dict:
    """Wait for the worker under the wall clock, reap everything, return the report."""
    clock = _Clock(spec, pid)
    status, cpu = None, 0.0
    while True:
        try:
            got, st, ru = os.wait4(-1 if spec["mode"] != "rlimits" else pid, 0)
        except ChildProcessError:
            break
        if got == pid:
            status, cpu = st, ru.ru_utime + ru.ru_stime
            break
    clock.stop()
    kill_everything(spec, pid)
    if spec["mode"] != "rlimits":
        while True:  # reap the rest; as init nothing else will
            try:
                os.wait4(-1, 0)
            except ChildProcessError:
                break
    return {"status": status, "cpu": cpu, "timed_out": clock.expired}


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


def init_main(spec: dict) -> None:
    """The sandbox's supervisor (init of its PID namespace): build, run, police, report."""
    status_fd, files_fd = spec["status_fd"], spec["files_fd"]
    try:
        with open(spec["program"], encoding="utf-8") as fh:
            source = fh.read()
        if spec["mode"] != "rlimits":
            _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
            build_root(spec)
    except (SetupError, OSError) as exc:
        os.write(status_fd, json.dumps({"setup_error": str(exc)}).encode())
        os._exit(3)
    pid = os.fork()
    if pid == 0:
        if spec["mode"] == "rlimits":
            os.setpgid(0, 0)
        worker(spec, source)
    report = supervise(spec, pid)
    if files_fd >= 0:
        try:
            found = collect(spec["cwd"], spec["max_files"], spec["max_collect"])
        except OSError as exc:
            found = {"files": {}, "skipped": [], "error": str(exc)}
        with os.fdopen(files_fd, "w") as fh:
            json.dump(found, fh)
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def _unshare(mode: str) -> None:
    """Enter fresh namespaces (children enter the PID one); mounts stop propagating."""
    uid, gid = os.getuid(), os.getgid()
    flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
    if mode == "userns":
        flags |= 0x10000000
    _check(_libc.unshare(flags), "unshare")
    if mode == "userns":
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):  # fmt: skip
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    _mount(None, "/", None, MS_REC | (1 << 18), None)  # MS_PRIVATE


def launch(spec: dict, fds: list[int]) -> None:
    """One sandbox (never returns): namespaces, then its init as our only child."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # one process group for the parent's backstop kill
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    spec["status_fd"], spec["files_fd"] = fds[3], fds[4]
    try:
        if spec["mode"] != "rlimits":
            _unshare(spec["mode"])
    except (SetupError, OSError) as exc:
        os.write(fds[3], json.dumps({"setup_error": str(exc)}).encode())
        os._exit(3)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() not in (0, me):  # 0: our parent is outside the new PID namespace
            os._exit(3)
        init_main(spec)
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
