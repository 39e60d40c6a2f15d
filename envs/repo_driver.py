"""Runs a repository's own tests (pytest, in-process) inside the sandbox.

This file is every program of the ``repo`` family's sandbox runs (standard library only, plus
pytest in the ``answer`` and ``tool`` roles; ``header`` puts the constants in front of it):

- ``ROLE = "tool"``: a plain run in the workspace (the policy's ``test`` tool): runs the named
  tests (``TESTS``, or all) and prints pytest's report, bounded by the caller.
- ``ROLE = "list"``: a plain run (building tasks): every test's outcome and its failure's
  ``E`` lines, as one JSON line last.
- ``ROLE = "answer"``: the answer's process of a judged run, its own uid, in the patched
  repository: runs the test files of ``TESTS`` with pytest and writes one JSON object
  ``{"outcomes": {NODEID: "passed" | "failed" | "skipped" | "error"}}`` to descriptor 4, then
  exits.
- ``ROLE = "verdict"``: the verdict side, another uid: reads the nonce and the tests that must
  pass (FAIL_TO_PASS and PASS_TO_PASS) from stdin, starts the answer's process (a byte on
  descriptor 5), reads its report from descriptor 3 (at most ``MAX_REPORT`` bytes, plain JSON
  only) and prints ``NONCE pass`` or ``NONCE fail DETAIL``; its exit status is 0 only on pass.
  It imports only the standard library, from the interpreter's read-only ``sys.path``.

pytest and what the tests need (``LIBRARY``: a root-owned copy bound read-only into the
private root, ``envs.repo``) go on ``sys.path`` of the answer's and the tool's process only,
after the standard library and before the repository's own source folders (``PATHS``; the
workspace itself is no entry), so nothing in the repository stands in for pytest, its plugins
or a module they import. pytest runs with plugin autoload off (no ``*.dist-info`` entry point is
read), an empty config of its own (the repository's ``pytest.ini``/``setup.cfg`` options,
coverage and all, are not read), no cache, no bytecode written. In the answer's process an
audit hook (:func:`_guard`, installed before anything of the repository is imported) refuses
opening a descriptor by number or a path under ``/proc`` or ``/dev/fd``, tracing, profiling
and walking the garbage collector's objects: the ways to the report descriptor and to the
runner's state that code of the answer has without naming them (what it names is refused
before the run, :mod:`rlstream.envs.patch_policy`).
"""

import json
import os
import sys

ROLE = "verdict"
PATHS = ["."]
LIBRARY: list = []
TESTS: list = []
FROM_ANSWER, START_ANSWER, REPORT = 3, 5, 4
MAX_REPORT = 1 << 22


class _Outcomes:
    """A pytest plugin: each test's worst outcome over setup, call and teardown."""

    def __init__(self):
        self.outcomes = {}
        self.messages = {}

    def pytest_runtest_logreport(self, report):
        outcome = report.outcome if report.when == "call" else ("error" if report.failed else "")
        if outcome and self.outcomes.get(report.nodeid) in (None, "passed", "skipped"):
            self.outcomes[report.nodeid] = outcome
        if report.failed and report.nodeid not in self.messages:
            lines = str(report.longreprtext).strip().splitlines()
            self.messages[report.nodeid] = [ln for ln in lines if ln.startswith("E ")][:3]

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "error"


_GUARDED = ("sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects",
            "gc.get_referrers", "gc.get_referents")  # fmt: skip


def _guard(event, args):
    """The answer's process: refuse the events of the module rules (a hook cannot be removed)."""
    if event in _GUARDED:
        raise PermissionError("sandbox: " + event + " is not allowed here")
    if event == "open":
        path = args[0]
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if isinstance(path, int) or str(path).startswith(("/proc", "/dev/fd", "/dev/std")):
            raise PermissionError("sandbox: opening " + repr(path) + " is not allowed here")


def run_pytest(quiet, targets, guard=False):
    """Run ``targets`` (all when empty) in the cwd; the plugin holding the outcomes."""
    here = os.getcwd()
    sys.dont_write_bytecode = True
    mine = [p for p in sys.path if p and not os.path.realpath(p).startswith(here)]
    sys.path[:] = mine + LIBRARY + [os.path.join(here, p) for p in PATHS]
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    if guard:
        sys.addaudithook(_guard)

    ini = os.path.join("/tmp", "rlstream-pytest.ini")
    with open(ini, "w") as fh:
        fh.write("[pytest]\n")
    plugin = _Outcomes()
    args = ["-p", "no:cacheprovider", "-c", ini, "--rootdir", here, "-o", "addopts="]
    args.append("--continue-on-collection-errors")  # one unimportable file is not all
    args += ["-q", "--no-header", "-rN", "--tb=short"] if not quiet else ["-qq", "--tb=no"]
    pytest.main([*args, *(targets or ["."])], plugins=[plugin])
    return plugin


def answer():
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # pytest's report is not the verdict
    # whole files, not node ids: one id pytest cannot find again would stop the whole run
    files = sorted({t.split("::", 1)[0] for t in TESTS})
    outcomes = run_pytest(True, files, guard=True).outcomes
    data = json.dumps({"outcomes": outcomes}).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(REPORT, view) :]
    os._exit(0)


def _report():
    data = b""
    while len(data) <= MAX_REPORT:
        chunk = os.read(FROM_ANSWER, 1 << 16)
        if not chunk:
            break
        data += chunk
    report = json.loads(data) if data and len(data) <= MAX_REPORT else None
    if type(report) is not dict or type(report.get("outcomes")) is not dict:
        return None
    return {str(k): str(v) for k, v in report["outcomes"].items()}


def verdict():
    params = json.loads(sys.stdin.read())
    nonce, must = params["nonce"], params["tests"]
    os.write(START_ANSWER, b"1")
    os.close(START_ANSWER)
    try:
        outcomes = _report()
    except (ValueError, RecursionError):
        outcomes = None
    if outcomes is None:
        detail = "the tests did not report (the answer's process died or was stopped)"
    else:
        bad = [t for t in must if outcomes.get(t) != "passed"]
        shown = ", ".join(f"{t} {outcomes.get(t, 'not run')}" for t in bad[:3])
        detail = f"{len(bad)} of {len(must)} tests do not pass: {shown}" if bad else ""
    sys.stdout.write(f"\n{nonce} {'pass' if not detail else 'fail ' + detail}\n")
    sys.stdout.flush()
    os._exit(0 if not detail else 1)


if __name__ == "__main__":
    if ROLE == "answer":
        answer()
    elif ROLE == "list":  # every test's outcome and failure lines, as one JSON line
        found = run_pytest(True, TESTS)
        sys.stdout.write("\n" + json.dumps([found.outcomes, found.messages]) + "\n")
    elif ROLE == "tool":
        counts: dict = {}
        for outcome in run_pytest(False, TESTS).outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(" ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran")
    else:
        verdict()
