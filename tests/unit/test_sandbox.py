"""The sandbox contains what untrusted code can throw at it, and the machine survives."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import pytest

from rlstream.envs import sandbox
from rlstream.envs.sandbox import SandboxConfig, classify, run

FAST = SandboxConfig(wall_timeout_s=3.0, cpu_limit_s=1)


def _pids_of(uid: int | None) -> set[int]:
    """Live processes owned by ``uid`` (the sandbox's own uid when the tests run as root)."""
    if uid is None:
        return set()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as fh:
                    status = fh.read()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in status and "\nState:\tZ" not in status:
                found.add(int(entry))
    return found


def test_ok_run_returns_output_and_isolation() -> None:
    r = run("import math\nprint(math.factorial(5))", FAST)
    assert r.status == "ok" and r.exit_code == 0
    assert r.stdout == "120\n"
    assert r.wall_s < 3.0
    if os.geteuid() == 0:
        assert r.isolation["own_uid"] and r.mode == "full"


def test_stdin_and_scrubbed_env_and_own_cwd() -> None:
    code = "import os, sys\nprint(sys.stdin.read()[::-1])\nprint(sorted(os.environ))\nprint(os.getcwd())"
    r = run(code, FAST, stdin="abc")
    lines = r.stdout.splitlines()
    assert lines[0] == "cba"
    assert lines[1] == "['HOME', 'LANG', 'PATH']"
    assert lines[2] == "/work"


def test_infinite_loop_is_stopped_by_cpu_limit() -> None:
    started = time.monotonic()
    r = run("while True:\n    pass", SandboxConfig(wall_timeout_s=10.0, cpu_limit_s=1))
    assert r.status == "timeout"
    assert time.monotonic() - started < 5.0


def test_sleep_is_stopped_by_wall_clock() -> None:
    r = run("import time\ntime.sleep(60)", SandboxConfig(wall_timeout_s=0.5, cpu_limit_s=1))
    assert r.status == "timeout" and r.reason == "wall-clock limit"
    assert r.wall_s < 3.0


def test_memory_bomb_is_oom() -> None:
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))"
    r = run(code, SandboxConfig(wall_timeout_s=10.0, memory_bytes=128 * 2**20))
    assert r.status == "oom"


def test_huge_output_is_capped() -> None:
    cfg = SandboxConfig(max_output_bytes=1000, max_file_bytes=64 * 1024, wall_timeout_s=10.0)
    r = run("while True:\n    print('x' * 999)", cfg)
    assert r.status == "killed" and "size limit" in r.reason
    assert len(r.stdout) == 1000 and r.stdout_truncated


def test_fork_bomb_is_contained_and_leaves_nothing_behind() -> None:
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # try to escape the process group
        "    except OSError:\n"
        "        pass\n"
    )
    started = time.monotonic()
    r = run(code, SandboxConfig(wall_timeout_s=1.5, cpu_limit_s=1, max_processes=8))
    assert r.status in ("timeout", "killed")
    assert time.monotonic() - started < 6.0
    time.sleep(0.2)
    assert _pids_of(r.uid) == set()
    assert run("print('alive')", FAST).stdout == "alive\n"  # the machine still forks


def test_escaped_child_dies_with_the_program() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')"
    r = run(code, FAST)
    assert r.status == "ok" and r.stdout == "parent done\n"
    time.sleep(0.2)
    assert _pids_of(r.uid) == set()


@pytest.mark.parametrize("block_exec", [True, False])
def test_network_is_unreachable(block_exec: bool) -> None:
    """A server on the host's loopback cannot be reached, with or without the audit hook."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3.0)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    t = threading.Thread(target=accept)
    t.start()
    code = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(1)\n"
        f"s.connect(('127.0.0.1', {port}))\n"
        "print('connected')"
    )
    r = run(code, SandboxConfig(wall_timeout_s=3.0, block_exec=block_exec))
    t.join()
    server.close()
    assert "connected" not in r.stdout
    assert r.status == "crash"
    assert not accepted
    if not block_exec:
        assert r.isolation["network_namespace"], "without the hook only the namespace guards"


def test_subprocess_is_refused_by_the_audit_hook() -> None:
    r = run("import subprocess\nsubprocess.run(['true'])\nprint('ran')", FAST)
    assert r.status == "crash" and "not allowed" in r.stderr and "ran" not in r.stdout


def test_workspace_files_go_in_and_come_back_by_value() -> None:
    code = (
        "import os\n"
        "print(open('a.txt').read())\n"
        "open('a.txt', 'a').write('+')\n"
        "os.mkdir('sub')\n"
        "open('sub/b.txt', 'w').write('b')\n"
        "os.symlink('/etc/passwd', 'link')\n"
        "os.mkfifo('pipe')\n"
    )
    r = run(code, FAST, files={"a.txt": "A"})
    assert r.status == "ok" and r.stdout == "A\n"
    assert r.files == {"a.txt": b"A+", "sub/b.txt": b"b"}
    assert sorted(r.files_skipped) == ["link", "pipe"]  # links and FIFOs never come back
    assert run("print(1)", FAST).files is None  # no workspace asked for, none returned


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../b", ".hidden", "a//b"])
def test_bad_workspace_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="bad workspace file name"):
        run("print(1)", FAST, files={name: "x"})


def test_classify_rules() -> None:
    cfg = SandboxConfig(cpu_limit_s=2)
    killed = signal.SIGKILL  # wait status for "killed by signal n" is n itself
    assert classify(0, 0.1, cfg, timed_out=True)[0] == "timeout"
    assert classify(None, 0.0, cfg, timed_out=False)[0] == "killed"
    assert classify(int(signal.SIGXCPU), 2.0, cfg, False)[0] == "timeout"
    assert classify(int(killed), 2.5, cfg, False)[0] == "timeout"
    assert classify(int(killed), 0.1, cfg, False)[0] == "killed"
    assert classify(int(signal.SIGSEGV), 0.1, cfg, False)[0] == "crash"
    assert classify(sandbox.OOM_EXIT << 8, 0.1, cfg, False)[0] == "oom"
    assert classify(0, 0.1, cfg, False)[0] == "ok"
    assert classify(3 << 8, 0.1, cfg, False)[:2] == ("crash", 3)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid sweep needs a root parent")
def test_rlimits_mode_sweeps_the_uid() -> None:
    """The weaker rlimits mode (no PID namespace) still kills what the program left running."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('done')"
    r = sandbox._run_in("rlimits", code, FAST, "", None)
    assert r.status == "ok" and r.mode == "rlimits" and not r.isolation["pid_namespace"]
    time.sleep(0.1)
    assert _pids_of(r.uid) == set()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    cfg = SandboxConfig(wall_timeout_s=1.0, cpu_limit_s=1, max_processes=8)
    r = sandbox._run_in("rlimits", bomb, cfg, "", None)
    assert r.status in ("timeout", "killed")
    time.sleep(0.1)
    assert _pids_of(r.uid) == set()


def test_refuses_when_full_isolation_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent fallback: a weaker mode runs only when the config names it."""
    found = {"full": "needs root", "userns": "user namespaces disabled", "rlimits": ""}
    monkeypatch.setattr(sandbox, "probe_mode", found.__getitem__)
    with pytest.raises(sandbox.IsolationUnavailable, match="full: needs root") as err:
        run("print(1)", FAST)
    assert "isolation = 'userns' or 'rlimits'" in str(err.value)
    with pytest.raises(sandbox.IsolationUnavailable):
        run("print(1)", FAST.model_copy(update={"isolation": "userns"}))
    r = run("print(1)", FAST.model_copy(update={"isolation": "rlimits"}))
    assert r.status == "ok" and r.mode == "rlimits"


def test_userns_mode_is_a_boundary_too() -> None:
    """The named weaker mode a non-root user gets: private root, no network, no capabilities."""
    if sandbox.probe()["userns"]:
        pytest.skip(f"user namespaces unavailable: {sandbox.probe()['userns']}")
    code = (
        "import os\n"
        f"print(os.path.exists({str(sandbox._BOOT)!r}), os.getuid())\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    r = sandbox._run_in("userns", code, FAST, "", None)
    assert r.status == "ok" and r.mode == "userns" and r.isolation["user_namespace"]
    assert r.stdout.split() == ["False", "0", "0000000000000000"]


def test_seccomp_program_is_well_formed() -> None:
    from rlstream.envs.sandbox import boot as sandbox_boot

    for machine in ("x86_64", "aarch64"):
        prog = sandbox_boot.seccomp_program(machine)
        assert len(prog) % 8 == 0 and 10 < len(prog) // 8 < 256


def test_a_judged_run_without_two_uids_in_rlimits_mode_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rlimits mode as a non-root user has one uid for both sides: it refuses to judge."""
    monkeypatch.setattr(sandbox, "choose_mode", lambda cfg: "rlimits")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(sandbox.IsolationUnavailable, match="judged run in rlimits mode needs root"):
        run("print(1)", FAST, answer="print(2)")
