"""Runs a dataset problem's tests against an answer, inside the sandbox, unforgeably.

This file is the sandboxed program the dataset family runs (standard library only; the two
constants below are filled in per problem). It forks: the *child* alone runs the answer
(``/work/solution.py``: the prompt followed by the completion) and serves calls to the entry
point over a pipe; the *parent* never executes a line of the answer. The parent reads the test
code and a fresh nonce from stdin only after the child exists (the child's stdin is
``/dev/null`` before any answer code runs, and both processes are non-dumpable, so the child can
read neither), executes the trusted prompt (its helper functions), binds the entry point to a
proxy that forwards each call to the child, and runs the tests: HumanEval's
``check(candidate)``, or top-level asserts that call the entry point by name (MBPP).

Guarantees: the verdict is the parent's exit status (0: every test passed) and its last line
``NONCE pass`` or ``NONCE fail DETAIL``, which only the parent can write; an answer that calls
``exit(0)``, kills its parent, or prints a fake verdict fails. Values cross the pipe with
``marshal`` and only plain data (None, bool, int, float, complex, str, bytes, tuple, list, dict,
set, frozenset) is accepted; an answer's exception is re-raised in the parent as the builtin
exception of that name (else ``RuntimeError``). The hidden tests never enter the child.
In ``visible`` mode it runs the prompt's doctest examples and ``visible_test`` instead, and
prints what failed (the policy's ``@test`` tool).
"""

import builtins
import contextlib
import json
import linecache
import marshal
import os
import struct
import sys
import traceback

ENTRY = "f"
SOLUTION = "/work/solution.py"
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _send(fd, message):
    data = marshal.dumps(message)
    os.write(fd, struct.pack("<I", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _recv(fd, cap=1 << 24):
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    if n > cap:
        raise ValueError("message too large")
    body = _read_exactly(fd, n)
    return None if body is None else marshal.loads(body)


def _read_exactly(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _plain(value, depth=0):
    if depth > 50:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def child(req_r, resp_w):
    """Load the answer and serve calls to the entry point (never returns)."""
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        with open(SOLUTION, encoding="utf-8") as fh:
            source = fh.read()
        ns = {"__name__": "solution"}
        exec(compile(source, "solution.py", "exec"), ns)
        fn = ns[ENTRY]
    except BaseException:
        _send(resp_w, ("load_error", traceback.format_exc(limit=-3)[-2000:]))
        os._exit(0)
    _send(resp_w, ("loaded",))
    while True:
        request = _recv(req_r)
        if request is None:
            os._exit(0)
        args, kwargs = request
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", value) if _plain(value) else ("unsupported", type(value).__name__)
        except BaseException as exc:
            reply = ("raise", type(exc).__name__, str(exc)[:500])
        _send(resp_w, reply)


class Candidate:
    """The entry point as the tests see it: each call runs in the child."""

    def __init__(self, req_w, resp_r):
        self.req_w, self.resp_r = req_w, resp_r
        self.__name__ = ENTRY

    def __call__(self, *args, **kwargs):
        if not _plain((args, kwargs)):
            raise TypeError("the test driver passes plain data only")
        _send(self.req_w, (args, kwargs))
        reply = _recv(self.resp_r)
        if reply is None:
            raise RuntimeError("the answer's process exited during a call")
        if reply[0] == "ok" and _plain(reply[1]):
            return reply[1]
        if reply[0] == "raise":
            kind = getattr(builtins, str(reply[1]), None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                raise kind(reply[2])
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        raise TypeError(f"the answer returned an unsupported value ({reply[1]})")


def _where(tb, source):
    """The innermost test line of a traceback: ``code (test line N)``."""
    line = None
    for frame in traceback.extract_tb(tb):
        if frame.filename == "<test>":
            line = frame.lineno
    if line is None:
        return ""
    text = source.splitlines()[line - 1].strip() if 0 < line <= len(source.splitlines()) else ""
    return f"{text} (test line {line})"


def run_tests(params, candidate):
    """Run the hidden (or visible) tests; returns the failure detail, '' when all passed."""
    ns = {"__name__": "tests"}
    prompt = params.get("prompt") or ""
    with contextlib.suppress(SyntaxError):  # a prompt in prose: no helpers to define
        exec(compile(prompt, "<prompt>", "exec"), ns)
    ns[ENTRY] = candidate
    if params["mode"] == "visible":
        return _visible(params, ns)
    test = params["test"]
    linecache.cache["<test>"] = (len(test), None, test.splitlines(True), "<test>")
    try:
        exec(compile(test, "<test>", "exec"), ns)
        check = ns.get("check")
        if callable(check):
            check(candidate)
    except AssertionError as exc:
        where = _where(exc.__traceback__, test)
        return f"assertion failed: {where}" + (f": {exc}" if str(exc) else "")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc} at {_where(exc.__traceback__, test)}"[:1000]
    return ""


def _docstrings(prompt):
    """The docstrings of the prompt (where its examples are); the prompt itself if prose."""
    import ast

    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return prompt
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    return "\n".join(d for d in docs if d)


def _visible(params, ns):
    import doctest

    parser, out = doctest.DocTestParser(), []
    examples = parser.get_doctest(
        _docstrings(params.get("prompt") or ""), ns, "examples", "<prompt>", 0
    )
    runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS)
    runner.run(examples, out=out.append)
    failed = runner.failures
    visible = params.get("visible_test") or ""
    if visible:
        try:
            exec(compile(visible, "<test>", "exec"), ns)
        except Exception as exc:
            out.append(
                f"visible test: {type(exc).__name__}: {exc} at {_where(exc.__traceback__, visible)}"
            )
            failed += 1
    summary = f"{len(examples.examples)} examples, {failed} failed"
    print("".join(out)[-3000:] + summary)
    return "" if not failed else summary


def main():
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(resp_r)
        child(req_r, resp_w)
    os.close(req_r)
    os.close(resp_w)
    params = json.loads(sys.stdin.read())
    nonce = params["nonce"]
    first = _recv(resp_r)
    if first is None or first[0] != "loaded":
        detail = first[1] if first else "the answer's process exited while loading"
        print(f"\n{nonce} fail the answer does not load: {detail.strip().splitlines()[-1]}")
        sys.stdout.flush()
        os._exit(1)
    detail = run_tests(params, Candidate(req_w, resp_r))
    verdict = "pass" if not detail else "fail " + " ".join(detail.split())
    sys.stdout.write(f"\n{nonce} {verdict}\n")
    sys.stdout.flush()
    os._exit(0 if not detail else 1)


if __name__ == "__main__":
    main()
