"""Runs a repository's tests (pytest) inside the sandbox; in a judged run, apart from the package.

The program of every ``repo`` run is :mod:`rlstream.envs.repo_bridge` followed by this file
(standard library only, plus pytest where said; ``header`` fills in the constants):

- ``ROLE = "tool"``: a plain run in the workspace (the policy's ``test`` tool): runs the named
  tests (``TESTS``, or all) in-process and prints pytest's counts.
- ``ROLE = "list"``: a plain run (building tasks): every test's outcome and its failure's
  ``E`` lines, as one JSON line last.
- ``ROLE = "answer"``: the answer's process of a judged run, its own uid, in the patched
  repository (its source folders ``PATHS`` on ``sys.path``): serves the verdict side's requests
  on descriptors 3 and 4 (:func:`repo_bridge.serve`) until the verdict side is done. It runs no
  test and writes no report: nothing it does reaches an outcome except through the values it
  answers with.
- ``ROLE = "verdict"``: the verdict side, another uid: reads the nonce, the tests that must pass
  (FAIL_TO_PASS and PASS_TO_PASS), the pristine test files (test modules and conftests, from
  the host) and the repository's module names from stdin; lays the test files in a folder of its
  own (mode 0700); starts the answer's process (a byte on descriptor 5); runs pytest there, from
  the root-owned ``LIBRARY``, with the repository's modules imported through the bridge
  (:class:`repo_bridge.RemoteFinder`); prints ``NONCE pass`` or ``NONCE fail DETAIL``; its exit
  status is 0 only on pass. Every test, assertion and outcome is in this process, which never
  executes a line of the patch.

pytest runs with plugin autoload off (no ``*.dist-info`` entry point is read), an empty config
of its own (the repository's ``pytest.ini``/``setup.cfg`` options are not read), no cache, no
bytecode written.
"""

import json
import os
import sys

if "serve" not in globals():  # imported on its own, not as the program after the bridge
    from rlstream.envs.repo_bridge import Bridge, RemoteFinder, serve

ROLE = "verdict"
PATHS = ["."]
LIBRARY: list = []
TESTS: list = []
FROM_ANSWER, TO_ANSWER, START_ANSWER = 3, 4, 5  # the verdict side's descriptors
REQUESTS, REPLIES = 3, 4  # the answer's


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
            nodeid = report.nodeid or "<collection>"
            self.outcomes[nodeid] = "error"
            lines = str(report.longreprtext).strip().splitlines()
            self.messages.setdefault(nodeid, [ln for ln in lines if ln.startswith("E ")][:3])


def run_pytest(quiet, targets, root, paths, ini_dir="/tmp"):
    """Run ``targets`` (all when empty) under ``root``, with ``paths`` on ``sys.path``."""
    sys.dont_write_bytecode = True
    mine = [p for p in sys.path if p and not os.path.realpath(p).startswith(root)]
    sys.path[:] = mine + LIBRARY + paths
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    ini = os.path.join(ini_dir, "rlstream-pytest.ini")
    with open(ini, "w") as fh:
        fh.write("[pytest]\n")
    plugin = _Outcomes()
    args = ["-p", "no:cacheprovider", "-c", ini, "--rootdir", root, "-o", "addopts="]
    args.append("--continue-on-collection-errors")  # one unimportable file is not all
    args += ["-q", "--no-header", "-rN", "--tb=short"] if not quiet else ["-qq", "--tb=short"]
    pytest.main([*args, *(targets or [root])], plugins=[plugin])
    return plugin


def answer():
    """The answer's process: the patched package, answering the verdict side (module rules)."""
    here = os.getcwd()
    sys.dont_write_bytecode = True
    mine = [p for p in sys.path if p and not os.path.realpath(p).startswith(here)]
    sys.path[:] = mine + [os.path.join(here, p) for p in PATHS] + LIBRARY
    # what the package prints is no verdict, and must not crowd the verdict's line out of the
    # run's output cap (a correct answer would score 0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    serve(REQUESTS, REPLIES)
    os._exit(0)


def _lay(files):
    """The pristine test files in a folder only this uid can read or write; that folder."""
    import tempfile

    root = os.path.realpath(tempfile.mkdtemp(prefix="verdict-"))
    for name, text in files.items():
        path = os.path.realpath(os.path.join(root, name))
        if not path.startswith(root + os.sep):
            raise ValueError(f"a test file outside the tests: {name!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return root


def verdict():
    params = json.loads(sys.stdin.read())
    nonce, must = params["nonce"], params["tests"]
    root = _lay(params["files"])
    os.write(START_ANSWER, b"1")
    os.close(START_ANSWER)
    # never the runner's own modules (the library's: pytest, pluggy, packaging ...) from the answer
    library = {n.split(".")[0] for d in LIBRARY for n in os.listdir(d)}
    tops = set(params["modules"]) - set(sys.stdlib_module_names) - set(sys.modules) - library
    sys.meta_path.insert(0, RemoteFinder(Bridge(TO_ANSWER, FROM_ANSWER), tops))
    os.chdir(root)
    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # pytest's report is not the verdict
    # whole files, not node ids: one id pytest cannot find again would stop the whole run
    files = sorted({t.split("::", 1)[0] for t in must})
    ran = run_pytest(True, files, root, [], ini_dir=root)
    bad = [t for t in must if ran.outcomes.get(t) != "passed"]
    shown = ", ".join(f"{t} {ran.outcomes.get(t, 'not run')}" for t in bad[:3])
    detail = f"{len(bad)} of {len(must)} tests do not pass: {shown}" if bad else ""
    if params.get("outcomes"):  # building tasks: every test's outcome, judged
        os.write(out, f"\n{nonce} outcomes {json.dumps(ran.outcomes)}\n".encode())
    first = ran.messages.get(bad[0]) if bad else None
    if first:
        detail += " (" + first[0][:300] + ")"
    os.write(out, f"\n{nonce} {'pass' if not detail else 'fail ' + detail}\n".encode())
    os._exit(0 if not detail else 1)


if __name__ == "__main__":
    here = os.getcwd()
    if ROLE == "answer":
        answer()
    elif ROLE == "list":  # every test's outcome and failure lines, as one JSON line
        found = run_pytest(True, TESTS, here, [os.path.join(here, p) for p in PATHS])
        sys.stdout.write("\n" + json.dumps([found.outcomes, found.messages]) + "\n")
    elif ROLE == "tool":
        counts: dict = {}
        ran = run_pytest(False, TESTS, here, [os.path.join(here, p) for p in PATHS])
        for outcome in ran.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(" ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran")
    else:
        verdict()
