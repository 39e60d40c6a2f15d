"""The sandbox service: a process that dropped root still runs ``full`` sandboxes through it,
and cannot make it bind a folder or run an interpreter of its own choosing.

Each case runs a child process that starts the service as root, drops to an unused uid (no
``/etc/passwd`` entry needed) and reports what its sandbox calls did, one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the service drops it")

CHILD = """
import json, os, sys
from rlstream.envs import sandbox
from rlstream.envs.sandbox import client as service
uid = 1_900_123
if sys.argv[1] == "service":
    service.start()
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
out = {"probe": sandbox.probe()}
def attempt(name, **kw):
    try:
        r = sandbox.run("import os; print(os.getuid())", sandbox.SandboxConfig(**kw),
                        answer="print('answer')")
        out[name] = [r.status, r.mode, r.isolation.get("verdict_own_uid"), r.stdout.strip()]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
attempt("judged")
attempt("bind_root", library=("/root",))
attempt("own_python", python="/tmp/python")
if sys.argv[1] == "service":
    attempt("own_library", library=(sandbox.library_of(("colorsys",)),))
    out["files"] = sorted(sandbox.run("print(1)", files={"a/b.txt": b"x"}).files or {})
print(json.dumps(out))
"""


def _child(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_that_dropped_root_runs_full_sandboxes_through_the_service() -> None:
    found = _child("service")
    assert found["probe"]["full"] == ""
    status, mode, verdict_own_uid, uid = found["judged"]
    assert (status, mode, verdict_own_uid) == ("ok", "full", True)
    assert int(uid) not in (0, 1_900_123)  # the verdict side's own fresh uid
    assert found["own_library"][:2] == ["ok", "full"]  # a library the service made
    assert found["files"] == ["a/b.txt"]  # the workspace comes back by value


def test_the_service_refuses_paths_and_interpreters_the_caller_chose() -> None:
    found = _child("service")
    assert found["bind_root"][0] == "ValueError" and "not made by" in found["bind_root"][1]
    assert found["own_python"][0] == "ValueError" and "may run" in found["own_python"][1]


def test_without_the_service_a_dropped_process_gets_no_full_sandbox() -> None:
    found = _child("none")  # the negative control: the role's own calls, no root left
    assert "needs root" in found["probe"]["full"]
    assert found["judged"][0] == "IsolationUnavailable"
