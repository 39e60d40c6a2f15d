"""The sandbox's private root (steps 1-2 of :mod:`rlstream.envs.sandbox.boot`), standard library
only: loaded by the bootstrap from its own directory, run in the sandbox's init as root of its
mount namespace, before any program exists.

Rules: the new root is a small tmpfs; ``/usr`` (and ``/bin``, ``/lib*``, ``/sbin`` or their
symlinks), the interpreter's prefix and ``/etc/ld.so.cache`` are bound read-only, with every
``site-packages``/``dist-packages`` folder in them hidden (``installed_packages``); ``/dev`` holds
null, zero, full, random and urandom; ``/proc`` is the sandbox's own; one size-capped scratch
tmpfs, owned by the workspace's owner, is shown as ``/work``, ``/tmp`` and ``/dev/shm``. After
``pivot_root`` the old root is detached and ``/`` is remounted read-only: the only writable
places are the scratch disk's three views. Any failure raises :class:`RootSetupError`.
"""

from __future__ import annotations

import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_RELATIME = 32, 4096, 16384, 1 << 21
MNT_DETACH = 2
DEVICES = ("null", "zero", "full", "random", "urandom")


class RootSetupError(Exception):
    """The sandbox could not be built; the program must not run."""


libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise RootSetupError(f"{what}: {os.strerror(err)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def _locked_flags(path: str) -> int:
    """Mount flags a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)
    return flags | (MS_RELATIME if f & 4096 else 0)


def _bind_ro(src: str, dst: str) -> None:
    mount(src, dst, None, MS_BIND | MS_REC, None)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(dst)
    mount(None, dst, None, flags, None)


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
    for host in installed_packages(["/usr", *ro_paths]):
        mount("tmpfs", _mkdirs(root, host), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV,
              "size=4k,nr_inodes=16,mode=755")  # fmt: skip
    etc = _mkdirs(root, "/etc")
    if os.path.isfile("/etc/ld.so.cache"):
        _touch(os.path.join(etc, "ld.so.cache"))
        _bind_ro("/etc/ld.so.cache", os.path.join(etc, "ld.so.cache"))


def installed_packages(bases: list[str]) -> list[str]:
    """The folders of installed packages (``site-packages``, ``dist-packages``) under the
    interpreter folders ``bases`` binds: each is hidden behind an empty read-only tmpfs, so no
    program reads what is installed there (rlstream's own task files, when it is installed into
    the interpreter rather than a virtualenv, among them)."""
    found = []
    for base in bases:
        for lib in ("lib", "lib64", "local/lib", "local/lib64"):
            top = os.path.join(base, lib)
            names = sorted(os.listdir(top)) if os.path.isdir(top) else []
            for name in (n for n in names if n.startswith("python")):
                for kind in ("site-packages", "dist-packages"):
                    path = os.path.realpath(os.path.join(top, name, kind))
                    if os.path.isdir(path) and path not in found:
                        found.append(path)
    return found


def _devices(root: str) -> None:
    dev = _mkdirs(root, "/dev")
    for name in DEVICES:
        _touch(os.path.join(dev, name))
        mount(f"/dev/{name}", os.path.join(dev, name), None, MS_BIND, None)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, os.path.join(dev, name))
    os.symlink("/proc/self/fd/1", os.path.join(dev, "stdout"))
    os.symlink("/proc/self/fd/2", os.path.join(dev, "stderr"))


def _scratch(root: str, spec: dict) -> None:
    """One size-capped tmpfs shown as /work, /tmp and /dev/shm: the program's whole disk."""
    scratch = _mkdirs(root, "/.scratch")
    opts = f"size={spec['disk']},nr_inodes={spec['inodes']},mode=755"
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    owner = spec["owner"] if spec["owner"] is not None else 0  # the answer's, in a judged run
    for name, where, mode in (("work", "/work", 0o700), ("tmp", "/tmp", 0o1777),
                              ("shm", "/dev/shm", 0o1777)):  # fmt: skip
        src = os.path.join(scratch, name)
        os.mkdir(src)
        os.chmod(src, mode)
        os.chown(src, owner, owner)
        mount(src, _mkdirs(root, where), None, MS_BIND, None)
    _copy_in(spec["in_dir"], os.path.join(root, "work"), owner)
    check(libc.umount2(scratch.encode(), MNT_DETACH), "umount scratch")
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
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=755")
    _system_dirs(root, spec["ro_paths"])
    _devices(root)
    _scratch(root, spec)
    mount("proc", _mkdirs(root, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.mkdir(os.path.join(root, ".old"))
    os.chdir(root)
    check(libc.syscall(_pivot_root_nr(), b".", b".old"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _pivot_root_nr() -> int:
    return {"x86_64": 155, "aarch64": 41}[os.uname().machine]
