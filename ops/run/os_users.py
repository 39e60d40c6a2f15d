"""Each role as an OS user of its own, so that a compromised role reads only what is its own.

On a host where the launcher runs as root (``rlstream demo --secure``), every role of a run runs
as ``rlstream-ROLE`` (made with ``useradd`` when missing, a system user with a home of its own
under ``/var/lib/rlstream/users``). Rules:

- the launcher starts the role as root with ``$RLSTREAM_OS_USER`` naming its user; the role
  reads its own Kafka credentials and the run's public key while still root, starts the sandbox
  service when it runs untrusted code (``envs.sandbox.service``: the only part that stays root),
  then drops to its user for good (``become``) before it connects;
- what a role keeps on disk is its user's: its home (0700), the folders it writes (``give``); a
  file it reads later where its user cannot reach the original (the learner's signing key, the
  CA its client reads, the compiled kernels) is read as root and written into its home, 0600,
  by the role once it is its user (``become``), never left readable to the other roles;
- where the host does not allow it (not root, no ``useradd``), ``unavailable`` says why, and the
  launcher records the downgrade (every role as the launcher's user) instead of failing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.producers.weights.run_keys import TRUST_DIR_ENV

OS_USER_ENV = "RLSTREAM_OS_USER"
HOMES = Path("/var/lib/rlstream/users")
#: The roles that run untrusted code in the sandbox: their sandbox service stays root.
SANDBOXED = frozenset({"rollout", "judge", "eval"})


def user_of(role: str) -> str:
    """The OS user of ``role``."""
    return f"rlstream-{role}"


def unavailable() -> str:
    """ "" when roles can run as users of their own here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"roles as OS users need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "roles as OS users need the launcher to run as root (useradd, setuid)"
    if shutil.which("useradd") is None:
        return "roles as OS users need useradd (the passwd package)"
    return ""


def ensure(role: str) -> pwd.struct_passwd:
    """``role``'s user, made when missing (a system user, its own group, a 0700 home)."""
    name = user_of(role)
    try:
        found = pwd.getpwnam(name)
    except KeyError:
        HOMES.mkdir(parents=True, exist_ok=True)
        HOMES.chmod(0o755)
        subprocess.run(
            ["useradd", "--system", "--user-group", "--create-home", "--home-dir",
             str(HOMES / name), "--shell", "/usr/sbin/nologin", name],
            check=True, capture_output=True,
        )  # fmt: skip
        found = pwd.getpwnam(name)
    home = Path(found.pw_dir)
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, found.pw_uid, found.pw_gid)
    home.chmod(0o700)
    return found


def give(path: Path, user: pwd.struct_passwd) -> None:
    """Make ``path`` (a folder, made when missing, and all under it) ``user``'s: it writes there."""
    path.mkdir(parents=True, exist_ok=True)
    for folder, _dirs, names in os.walk(path):
        os.chown(folder, user.pw_uid, user.pw_gid, follow_symlinks=False)
        for name in names:
            os.chown(os.path.join(folder, name), user.pw_uid, user.pw_gid, follow_symlinks=False)


def compiled(user: pwd.struct_passwd) -> dict[Path, bytes]:
    """The delta codec's compiled kernels (numba's cache beside their modules, made by ``make
    kernels`` as root) that ``user``'s own numba cache lacks: where each goes, and its bytes.

    Numba reads an in-tree cache only where it may also write it, so a role of its own user
    would compile every kernel again (a minute and more of CPU on its first version); a copy
    in its private cache is read as its own, and no other role can change what it runs."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("rlstream.schemas.deltacodec.kernels")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = os.path.abspath(next(iter(spec.submodule_search_locations)))
    digest = hashlib.sha1(folder.encode()).hexdigest()  # numba's user-wide cache layout
    dest = Path(user.pw_dir, ".cache", "numba", f"{Path(folder).name}_{digest}")
    out = {}
    for src in sorted(Path(folder, "__pycache__").glob("*.nb[ic]")):
        target = dest / src.name
        if not target.exists() or target.stat().st_mtime < src.stat().st_mtime:
            out[target] = src.read_bytes()
    return out


def unreachable(user: pwd.struct_passwd, paths: list[Path]) -> list[str]:
    """Which of ``paths`` ``user`` cannot read (checked by a process of that user, which also
    imports this package: a private home above the interpreter or the code shows here)."""
    probe = (
        "import os, sys, rlstream.ops.run.role_main; "
        "print('\\n'.join(p for p in sys.argv[1:] if not os.access(p, os.R_OK)))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe, *map(str, paths)],
            user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except OSError:  # the interpreter itself cannot be run as that user
        return [f"{os.path.realpath(sys.executable)} (not executable as {user.pw_name})"]
    if done.returncode != 0:
        return [f"{os.path.realpath(sys.executable)} (rlstream does not import as {user.pw_name})"]
    return [line for line in done.stdout.splitlines() if line]


def become(name: str, sandboxed: bool, carry: dict[Path, bytes] | None = None) -> None:
    """Drop this process to the user ``name`` for good, first starting the sandbox service when
    the role runs untrusted code (the service alone stays root); then write ``carry`` (files
    read as root: path -> bytes) as that user, 0600: a root process never writes into a folder
    its user controls (a planted link would send the write anywhere)."""
    user = pwd.getpwnam(name)
    if sandboxed:
        from rlstream.envs.sandbox import client

        client.start()
    os.setgroups([])
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise PermissionError(f"could not drop root for {name}")
    for path, data in (carry or {}).items():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)


@dataclass
class Users:
    """Who each role of a launch runs as: its environment (``env``) and what the run records."""

    enabled: bool
    reason: str = ""
    users: dict[str, pwd.struct_passwd] = field(default_factory=dict)

    def env(self, role: str) -> dict[str, str]:
        """What the launcher adds to ``role``'s environment (nothing when disabled): its user,
        its home, and its own trust pins there (the launcher's are not its to write)."""
        user = self.users.get(role)
        if user is None:
            return {}
        pins = str(Path(user.pw_dir) / ".config" / "rlstream" / "trust")
        return {OS_USER_ENV: user.pw_name, "HOME": user.pw_dir, TRUST_DIR_ENV: pins}

    def record(self) -> dict[str, object]:
        """``{enabled, reason, users}`` for the run's summary."""
        names = {role: u.pw_name for role, u in sorted(self.users.items())}
        return {"enabled": self.enabled, "reason": self.reason, "users": names}


def prepare(roles: list[str], writes: dict[str, list[Path]], reads: list[Path]) -> Users:
    """Each of ``roles`` a user of its own (made when missing), the folders in ``writes`` its
    own, checked by a process of such a user to reach the interpreter, this package and
    ``reads``; disabled with the reason where the host does not allow it (not root, or a
    private home such as /root above the interpreter or the run's folder), which the caller
    says loudly and records."""
    why = unavailable()
    if why:
        return Users(False, why)
    found = {role: ensure(role) for role in sorted(set(roles))}
    missing = unreachable(next(iter(found.values())), reads) if found else []
    if missing:
        return Users(
            False,
            "other users cannot read " + ", ".join(missing) + " (a private folder such as "
            "/root, 0700, lies above it: install the interpreter and the code, and put --out, "
            "where other users may read)",
        )
    for role, folders in writes.items():
        for folder in folders:
            give(folder, found[role])
    return Users(True, "", found)
