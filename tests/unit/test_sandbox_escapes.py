"""Escape attempts against the sandbox: each one must fail, and the judge must stay up.

Each test plays untrusted code that tries one way out (read the repository or the venv, write
into the venv, reach a loopback port, read another process's environment, exec a shell through
``_posixsubprocess``, fork-bomb, fill ``/tmp`` and ``/dev/shm``, delete or forge the status
report, outlive the wall clock with the judge killed) and then checks, from the outside, that
nothing happened and that this process (the judge's seat) still runs sandboxes.

They run in the strongest mode available: ``full`` as root (CI), else the named weaker
``userns`` mode; they are skipped only where neither can be set up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import rlstream
from rlstream.envs import sandbox
from rlstream.envs.sandbox import SandboxConfig, SandboxResult

REPO = Path(rlstream.__file__).resolve().parent
CFG = SandboxConfig(wall_timeout_s=5.0, cpu_limit_s=2, isolation="userns")


@pytest.fixture(autouse=True)
def _needs_a_boundary() -> None:
    found = sandbox.probe()
    if found["full"] and found["userns"]:
        pytest.skip(f"no namespaced sandbox here: {found}")


def attempt(code: str, cfg: SandboxConfig = CFG, **kw: object) -> SandboxResult:
    """Run one escape attempt, then check the judge's seat still works."""
    r = sandbox.run(textwrap.dedent(code), cfg, **kw)  # type: ignore[arg-type]
    assert r.mode in ("full", "userns")
    alive = sandbox.run("print('alive')", CFG)
    assert alive.status == "ok" and alive.stdout == "alive\n", "the judge's sandbox broke"
    return r


def test_cannot_read_the_repository_or_the_venv() -> None:
    targets = [REPO / "README.md", REPO / "envs" / "sandbox.py", Path(sys.prefix) / "pyvenv.cfg"]
    targets += [Path.home() / ".bashrc", Path("/etc/passwd"), Path("/etc/hostname")]
    code = f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                print('GOT', path, len(open(path).read()))
            except OSError as exc:
                print('denied', path, type(exc).__name__)
        """
    r = attempt(code)
    assert r.status == "ok" and "GOT" not in r.stdout
    assert r.stdout.count("denied") == len(targets)


def test_cannot_write_into_the_venv() -> None:
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    target = site / "site-packages" / "rlstream-escape-test.pth"
    code = f"""
        try:
            open({str(target)!r}, 'w').write('import os; os.system("id")')
            print('WROTE')
        except OSError as exc:
            print('denied', type(exc).__name__)
        """
    r = attempt(code)
    assert "WROTE" not in r.stdout and not target.exists()


def test_cannot_reach_a_loopback_port() -> None:
    """The broker listens on loopback; an empty network namespace has no route to it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(4.0)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    t = threading.Thread(target=accept)
    t.start()
    code = f"""
        import _socket
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)  # below the audit hook's reach
        s.settimeout(2)
        try:
            s.connect(('127.0.0.1', {port}))
            print('CONNECTED')
        except OSError as exc:
            print('unreachable', type(exc).__name__)
        """
    try:
        r = attempt(code, CFG.model_copy(update={"block_exec": False}))
    finally:
        t.join()
        server.close()
    assert "CONNECTED" not in r.stdout and not accepted
    assert "unreachable" in r.stdout


def test_cannot_read_another_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"sasl-secret-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", secret)
    sibling = subprocess.Popen(  # a sibling role holding the secret in its environment
        [sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ}
    )
    try:
        code = f"""
            import os
            pids = {[os.getpid(), sibling.pid, 1, 2, 3]!r} + [p for p in os.listdir('/proc') if p.isdigit()]
            for pid in pids:
                try:
                    print(pid, open(f'/proc/{{pid}}/environ', 'rb').read())
                except OSError as exc:
                    print(pid, 'denied', type(exc).__name__)
            print(dict(os.environ))
            """
        r = attempt(code)
    finally:
        sibling.kill()
        sibling.wait()
    assert r.status == "ok" and secret not in r.stdout and "SASL" not in r.stdout


@pytest.mark.parametrize("block_exec", [True])
def test_cannot_exec_a_shell_through_posixsubprocess(tmp_path: Path, block_exec: bool) -> None:
    """``_posixsubprocess.fork_exec`` bypasses the audit hook; the seccomp filter does not."""
    marker = tmp_path / "pwned"
    code = f"""
        import _posixsubprocess, os
        r, w = os.pipe()
        argv = [b'/bin/sh', b'-c', b'echo PWNED; touch {marker}']
        args = [argv, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w,
                True, False, -1, None, None, None, -1, None]
        for extra in ([], [False]):  # the signature differs between Python versions
            try:
                pid = _posixsubprocess.fork_exec(*args, *extra)
            except TypeError:
                continue
            except OSError as exc:
                print('refused', type(exc).__name__)
                break
            print('child exit', os.waitpid(pid, 0)[1] >> 8)
            break
        """
    r = attempt(code, CFG.model_copy(update={"block_exec": block_exec}))
    assert "PWNED" not in r.stdout and not marker.exists()
    assert "refused" in r.stdout or "child exit 255" in r.stdout, r.stdout + r.stderr


def test_fork_bomb_is_contained_and_leaves_nothing_behind() -> None:
    code = """
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()
            except OSError:
                pass
        """
    started = time.monotonic()
    r = attempt(code, CFG.model_copy(update={"wall_timeout_s": 1.5, "max_processes": 16}))
    assert r.status in ("timeout", "killed")
    assert time.monotonic() - started < 10.0
    time.sleep(0.2)
    if r.uid is not None:
        assert not _pids_of_uid(r.uid)


def test_filling_tmp_and_shm_hits_the_disk_limit_and_leaves_nothing() -> None:
    cfg = CFG.model_copy(update={"disk_bytes": 8 * 2**20, "max_file_bytes": 2**30})
    before = set(os.listdir("/dev/shm")), set(os.listdir("/tmp"))
    code = """
        for d in ('/tmp', '/dev/shm', '/work'):
            n = 0
            try:
                with open(d + '/rlstream-fill', 'wb') as f:
                    while True:
                        f.write(b'x' * 2**20)
                        f.flush()
                        n += 1
            except OSError as exc:
                print(d, n, exc.errno)
        """
    r = attempt(code, cfg)
    assert r.status == "ok"
    written = sum(int(line.split()[1]) for line in r.stdout.splitlines())
    assert written <= 8, "the three places share one 8 MiB disk"
    assert "rlstream-fill" not in os.listdir("/dev/shm") and "rlstream-fill" not in os.listdir(
        "/tmp"
    )
    assert set(os.listdir("/dev/shm")) - before[0] == set()


def test_cannot_delete_or_forge_the_status_report() -> None:
    """The verdict travels on a descriptor the program never holds; its exit code stands."""
    code = """
        import glob, json, os, shutil
        for fd in range(3, 1024):  # forge: write an 'exit 0' report to every descriptor
            try:
                os.write(fd, json.dumps({'status': 0, 'cpu': 0.0}).encode())
                print('wrote to', fd)
            except OSError:
                pass
        for path in glob.glob('/tmp/rlstream-sbx-*') + glob.glob('/tmp/*/status'):
            shutil.rmtree(path, ignore_errors=True)  # delete: nothing of the host is here
            print('found', path)
        raise SystemExit(3)
        """
    r = attempt(code)
    assert r.status == "crash" and r.exit_code == 3
    assert "wrote to" not in r.stdout and "found" not in r.stdout


def test_cannot_outlive_the_wall_clock_even_when_the_judge_dies(tmp_path: Path) -> None:
    """A judge is SIGKILLed mid-run; its sandbox still ends at the wall clock, leaving nothing."""
    judge = tmp_path / "judge.py"
    judge.write_text(
        textwrap.dedent(
            """
            import sys, threading
            from rlstream.envs import sandbox
            code = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n" \\
                   "    time.sleep(600)\\ntime.sleep(600)\\n"
            cfg = sandbox.SandboxConfig(wall_timeout_s=2.0, isolation='userns')
            threading.Thread(target=sandbox.run, args=(code, cfg), daemon=True).start()
            print('started', flush=True)
            threading.Event().wait()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(judge)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 20
    tree: set[int] = set()
    while time.monotonic() < deadline and len(tree) < 4:  # helper, launcher, init, program
        time.sleep(0.2)
        tree = _descendants(proc.pid)
    assert len(tree) >= 4, f"sandbox tree not found: {tree}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    killed_at = time.monotonic()
    while _alive(tree) and time.monotonic() - killed_at < 8:
        time.sleep(0.2)
    assert not _alive(tree), f"outlived the wall clock: {_alive(tree)}"
    assert time.monotonic() - killed_at < 6


# ---------------------------------------------------------------- process helpers


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st[0]
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if (st := _stat(p)) is not None and st[1] != "Z"}


def _pids_of_uid(uid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{entry}/status").read_text()
                if f"\nUid:\t{uid}\t" in status and "\nState:\tZ" not in status:
                    found.add(int(entry))
    return found


def test_report_is_json_of_the_isolation_used() -> None:
    r = attempt("print('hello')")
    assert json.loads(json.dumps(r.isolation))["private_root"] is True
