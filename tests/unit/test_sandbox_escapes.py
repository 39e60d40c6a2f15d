"""Escape attempts against the sandbox: each one must fail, and the judge must stay up.

Each test plays untrusted code that tries one way out (read the repository or the venv, write
into the venv, reach a loopback port, read another process's environment, exec a shell through
``_posixsubprocess``, fork-bomb, fill ``/tmp`` and ``/dev/shm``, delete or forge the status
report, outlive the wall clock with the judge killed, switch the audit hook off, take more than
the sandbox's CPU or memory through children) or, as a wrong dataset answer, tries to forge its
verdict (modules named after the standard library planted as source, bytecode or ``site``
start-up files wherever an importer might look; signalling and opening every process it sees;
in every isolation mode, and through ``rlstream env score``), and then checks, from the
outside, that nothing happened and that this process (the judge's seat) still runs sandboxes.

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
from rlstream.envs.dataset import DatasetConfig, DatasetFamily, Problem
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


# ---------------------------------------------------------------- the verdict side
#
# A dataset answer runs in one process and the tests in another (the verdict side). These
# answers are WRONG and try to reach the verdict side instead: modules named after the standard
# library planted where an importer looks, a bytecode-only module, ``site`` start-up files,
# signals, the audit hook, the CPU, memory and process budgets. None may score a pass.

HUMANEVAL_SHAPED = [  # prompts and tests that import, as HumanEval's do
    {
        "task_id": "he/typing",
        "prompt": "from typing import List\n\n\ndef total(nums: List[int]) -> int:\n"
        '    """The sum of nums.\n    >>> total([1, 2])\n    3\n    """\n',
        "entry_point": "total",
        "test": "def check(candidate):\n    assert candidate([]) == 0\n"
        "    assert candidate([1, 2, 3]) == 6\n",
        "canonical_solution": "    return sum(nums)\n",
    },
    {
        "task_id": "he/imports",
        "prompt": 'def total(nums):\n    """The sum of nums."""\n',
        "entry_point": "total",
        "test": "import collections, re, json, site, fractions\n\n\ndef check(candidate):\n"
        "    import statistics, doctest\n    assert candidate([1, 2, 3]) == 6\n",
        "canonical_solution": "    return sum(nums)\n",
    },
]


def _problem(row: dict[str, str]) -> Problem:
    return Problem(row["task_id"], row["prompt"], row["entry_point"], row["test"])


@pytest.mark.parametrize("kind", ["source", "bytecode", "startup"])
@pytest.mark.parametrize("row", HUMANEVAL_SHAPED, ids=lambda r: r["task_id"])
def test_planted_modules_cannot_forge_a_pass(kind: str, row: dict[str, str]) -> None:
    from rlstream.envs.sandbox.attacks import planted_stdlib_answer

    fam = DatasetFamily("mini", DatasetConfig())
    problem = _problem(row)
    good = fam.score_problem(problem, row["canonical_solution"], "userns")
    assert good.passed, good.rationale  # the problem is solvable: a pass is possible
    attack = planted_stdlib_answer(problem.entry_point, kind)  # type: ignore[arg-type]
    verdict = fam.score_problem(problem, attack, "userns")
    assert not verdict.passed, f"a wrong answer forged a pass with planted {kind} modules"
    assert verdict.rationale.startswith("assertion failed"), verdict.rationale
    assert run_alive()


def test_planted_modules_through_env_score(tmp_path: Path) -> None:
    """The public path (`rlstream env score`): every planted-module answer scores a fail."""
    from rlstream.envs.sandbox.attacks import KINDS, planted_stdlib_answer

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in HUMANEVAL_SHAPED))
    answers = tmp_path / "answers.jsonl"
    rows = [
        {"task_id": r["task_id"], "completion": planted_stdlib_answer(r["entry_point"], k)}
        for r in HUMANEVAL_SHAPED
        for k in KINDS
    ]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(
        [sys.executable, "-m", "rlstream", "env", "score", "--tasks", str(tasks),
         "--answers", str(answers), "--json", "--isolation", "userns"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[-1] == {"tasks": len(rows), "passed": 0, "errors": 0}, done.stdout + done.stderr


KILLER = textwrap.dedent(
    """
    def total(nums):
        return None

    import os, signal
    for _pid in [int(p) for p in os.listdir('/proc') if p.isdigit()] + [os.getppid(), -1]:
        if _pid != os.getpid():
            for _what in ('mem', 'fd/0', 'environ'):
                try:
                    open(f'/proc/{_pid}/{_what}', 'rb').read(1)
                    print('OPENED', _pid, _what)
                except OSError:
                    pass
            for _sig in (signal.SIGSTOP, signal.SIGKILL):
                try:
                    os.kill(_pid, _sig)
                except OSError:
                    pass
    """
)  # a wrong answer that signals and opens every process it can see, then kills itself


def test_answer_cannot_kill_or_trace_the_verdict_side() -> None:
    """The verdict side survives the answer's attack and runs the tests to the end."""

    fam = DatasetFamily("mini", DatasetConfig(wall_timeout_s=10.0))
    verdict = fam.score_problem(_problem(HUMANEVAL_SHAPED[0]), KILLER, "userns")
    assert not verdict.passed
    assert verdict.rationale.startswith(("assertion failed", "RuntimeError")), verdict.rationale


@pytest.mark.parametrize("mode", sandbox.MODES)
def test_the_verdict_holds_in_every_mode(
    mode: sandbox.Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each isolation mode keeps the verdict out of the answer's reach, or refuses to score."""
    from rlstream.envs.sandbox.attacks import planted_stdlib_answer

    if sandbox.probe_mode(mode):
        pytest.skip(f"{mode} unavailable here: {sandbox.probe_mode(mode)}")
    monkeypatch.setattr(sandbox, "choose_mode", lambda cfg: mode)
    fam = DatasetFamily("mini", DatasetConfig(wall_timeout_s=10.0))
    row = HUMANEVAL_SHAPED[0]
    problem = _problem(row)
    if mode == "rlimits" and os.geteuid() != 0:
        with pytest.raises(sandbox.IsolationUnavailable, match="needs root"):
            fam.score_problem(problem, row["canonical_solution"], "rlimits")
        return
    good = fam.score_problem(problem, row["canonical_solution"], "rlimits")
    assert good.passed and good.isolation == mode, good
    # rlimits mode shares the host's /tmp: plant in the workspace only, not for other programs
    planted = planted_stdlib_answer(problem.entry_point, everywhere=mode != "rlimits")
    for attack in (planted, KILLER):
        verdict = fam.score_problem(problem, attack, "rlimits")
        assert not verdict.passed, (mode, verdict)
        assert verdict.rationale.startswith(("assertion failed", "RuntimeError")), verdict


def test_the_audit_hook_cannot_be_switched_off() -> None:
    """Neither a global of ``__main__`` nor the hook's own code: a socket stays refused."""
    code = """
        import gc, sys, types
        import __main__
        try:
            __main__._DENY_EVENTS = ()
        except Exception as exc:
            print('global refused', type(exc).__name__)
        for obj in [o for o in gc.get_objects() if isinstance(o, types.FunctionType)]:
            if 'audit' in obj.__name__:
                try:
                    obj.__code__ = (lambda event, args: None).__code__
                    print('CODE REPLACED')
                except Exception as exc:
                    print('code refused', type(exc).__name__)
                for cell in obj.__closure__ or ():
                    cell.cell_contents = ()
        import socket
        try:
            socket.socket()
            print('SOCKET')
        except PermissionError:
            print('socket refused')
        """
    r = attempt(code)
    assert "SOCKET" not in r.stdout and "CODE REPLACED" not in r.stdout, r.stdout + r.stderr
    assert "socket refused" in r.stdout, r.stdout + r.stderr


SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5:\n    pass\n"


def test_children_share_the_cpu_budget() -> None:
    """Three children spinning under cpu_limit_s=1: one budget for all, counted in cpu_s."""
    code = (
        "import os\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
        + textwrap.indent(SPIN, "        ")
        + "        os._exit(0)\n    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n"
        "print('all children done')\n"
    )
    cfg = CFG.model_copy(update={"wall_timeout_s": 20.0, "cpu_limit_s": 1})
    r = attempt(code, cfg)
    assert r.status == "timeout" and "cpu" in r.reason, (r.status, r.reason, r.cpu_s)
    assert 0.9 <= r.cpu_s < 2.0, r.cpu_s
    assert "all children done" not in r.stdout


def test_memory_spread_over_children_is_capped_for_the_sandbox() -> None:
    """Each child holds 60 MiB, under its own address-space limit; together they may not."""
    code = """
        import os, time
        r, w = os.pipe()
        kids = []
        for i in range(4):
            pid = os.fork()
            if pid == 0:
                block = bytearray(60 * 2**20)
                block[::4096] = b'x' * len(block[::4096])
                os.write(w, bytes([i]))
                time.sleep(8)
                os._exit(0)
            kids.append(pid)
        os.close(w)
        done, deadline = b"", time.monotonic() + 3
        while len(done) < 4 and time.monotonic() < deadline:
            done += os.read(r, 64)
        time.sleep(0.5)
        alive = [i for i, pid in enumerate(kids) if os.waitpid(pid, os.WNOHANG) == (0, 0)]
        print('held', len(set(done) & set(alive)))
        """
    cfg = CFG.model_copy(update={"memory_bytes": 128 * 2**20, "wall_timeout_s": 15.0})
    r = attempt(code, cfg)
    assert r.stdout.startswith("held"), (r.status, r.stdout, r.stderr)
    held = int(r.stdout.split()[-1])
    assert held * 60 <= 128, f"{held} children held 60 MiB each in a 128 MiB sandbox"
    assert r.memory_peak_bytes is not None and r.memory_peak_bytes <= 128 * 2**20


def test_fork_bomb_is_capped_for_the_whole_sandbox() -> None:
    code = """
        import os, time
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print('forked', n)
        """
    cfg = CFG.model_copy(update={"max_processes": 8, "wall_timeout_s": 3.0})
    r = attempt(code, cfg)
    assert r.stdout.startswith("forked") and int(r.stdout.split()[1]) <= 8, r.stdout
    time.sleep(0.2)
    if r.uid is not None:
        assert not _pids_of_uid(r.uid)


def run_alive() -> bool:
    r = sandbox.run("print('alive')", CFG)
    return r.status == "ok" and r.stdout == "alive\n"
