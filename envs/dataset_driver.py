"""Runs a dataset problem's tests against an answer, inside the sandbox, unforgeably.

This file is both programs of a *judged* sandbox run (:func:`rlstream.envs.sandbox.run` with
``answer=``; standard library only; the constants below are filled in per problem and role):

- ``ROLE = "answer"``: the answer's process, its own uid, owning the workspace. It loads
  ``solution.py`` (the prompt followed by the completion) and serves calls to the entry point
  on descriptors 3 (requests) and 4 (replies). Its stdin is ``/dev/null``.
- ``ROLE = "verdict"``: the verdict side, another uid, never executing a line of the answer. It
  reads the tests and a fresh nonce from stdin, executes the trusted prompt (its helpers and
  imports) and imports every module the prompt and the tests name, and only then asks the
  sandbox to start the answer's process (a byte on descriptor 5). It binds the entry point to
  a proxy that forwards each call to the answer (descriptor 4 out, 3 in), and runs the tests:
  HumanEval's ``check(candidate)``, or top-level asserts that call the entry point by name (MBPP).

Guarantees: the verdict is the verdict side's exit status (0: every test passed) and its last
line ``NONCE pass`` or ``NONCE fail DETAIL``, which only it can write: it imports nothing from a
directory the answer can write (the sandbox gives it the interpreter's read-only ``sys.path``,
``/`` as cwd, and no bytecode writing), the answer cannot signal, trace or read it (another uid;
non-dumpable), and an answer that calls ``exit(0)``, kills what it can, or prints a fake
verdict fails. Values cross the pipes as tagged JSON (:func:`encode`): only plain data (None,
bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset) comes out of
:func:`decode`, as fresh builtin objects, so nothing the answer sends can run code in the
verdict side. An answer's exception is re-raised there as the builtin exception of that name
(else, and for ``StopIteration``/``StopAsyncIteration`` as PEP 479 does, ``RuntimeError``).
The hidden tests never enter the answer's process.
In ``visible`` mode it runs the prompt's doctest examples and ``visible_test`` instead, and
prints what failed (the policy's ``@test`` tool).
"""

import builtins
import contextlib
import json
import linecache
import os
import struct
import sys
import traceback

ENTRY = "f"
ROLE = "verdict"
# the family's packages: a root-owned read-only folder, on the path after the standard library
LIBRARY = None
SOLUTION = "solution.py"  # in the answer's cwd, the workspace
REQUESTS, REPLIES = 3, 4  # the answer's descriptors
FROM_ANSWER, TO_ANSWER, START_ANSWER = 3, 4, 5  # the verdict side's
MAX_MESSAGE = 1 << 24
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def encode(value, depth=0):
    """A JSON-able tree of plain data; TypeError for anything else (see the module rules)."""
    if depth > 50:
        raise TypeError("nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [encode(v, depth + 1) for v in value]
    if type(value) in (tuple, set, frozenset):
        return {type(value).__name__: [encode(v, depth + 1) for v in value]}
    if type(value) is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if type(value) is bytes:
        return {"bytes": value.hex()}
    if type(value) is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(type(value).__name__)


def decode(tree):
    """The value :func:`encode` made; ValueError/TypeError for anything malformed."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is list:
        return [decode(v) for v in tree]
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError("not an encoded value")
    ((tag, body),) = tree.items()
    if tag in _TAGS and type(body) is list:
        return _TAGS[tag](decode(v) for v in body)
    if tag == "dict" and type(body) is list:
        return {decode(k): decode(v) for k, v in body}
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and all(type(x) is float for x in body):
        return complex(*body)
    raise ValueError(f"unknown tag {tag!r}")


def _send(fd, message):
    data = json.dumps(message).encode()
    os.write(fd, struct.pack("<I", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _recv(fd):
    """The next message (a JSON list), None at EOF; ValueError when it is malformed."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    if n > MAX_MESSAGE:
        raise ValueError("message too large")
    body = _read_exactly(fd, n)
    if body is None:
        return None
    message = json.loads(body)
    if type(message) is not list or not message or type(message[0]) is not str:
        raise ValueError("not a message")
    return message


def _read_exactly(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve_answer():
    """The answer's process: load the answer and serve calls to the entry point."""
    try:
        with open(SOLUTION, encoding="utf-8") as fh:
            source = fh.read()
        ns = {"__name__": "solution"}
        exec(compile(source, "solution.py", "exec"), ns)
        fn = ns[ENTRY]
    except BaseException:
        _send(REPLIES, ["load_error", traceback.format_exc(limit=-3)[-2000:]])
        os._exit(0)
    _send(REPLIES, ["loaded"])
    while True:
        request = _recv(REQUESTS)
        if request is None:
            os._exit(0)
        args, kwargs = decode(request[1])
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            _send(REPLIES, ["raise", type(exc).__name__, str(exc)[:500]])
            continue
        try:
            _send(REPLIES, ["ok", encode(value)])
        except TypeError as exc:
            _send(REPLIES, ["unsupported", str(exc)])


class Candidate:
    """The entry point as the tests see it: each call runs in the answer's process."""

    def __init__(self):
        self.__name__ = ENTRY

    def __call__(self, *args, **kwargs):
        try:
            request = encode((args, kwargs))
        except TypeError:
            raise TypeError("the test driver passes plain data only") from None
        _send(TO_ANSWER, ["call", request])
        try:
            reply = _recv(FROM_ANSWER)
            value = decode(reply[1]) if reply and reply[0] == "ok" and len(reply) == 2 else None
        except (ValueError, TypeError, RecursionError):
            raise RuntimeError("the answer's process sent an unreadable reply") from None
        if reply is None:
            raise RuntimeError("the answer's process exited during a call")
        if reply[0] == "ok":
            return value
        if reply[0] == "raise" and len(reply) == 3:
            kind = getattr(builtins, str(reply[1]), None)
            # PEP 479: an answer's StopIteration must not end the tests' map/filter/zip early
            if kind in (StopIteration, StopAsyncIteration):
                kind = None
            if isinstance(kind, type) and issubclass(kind, Exception):
                raise kind(str(reply[2]))
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        raise TypeError(f"the answer returned an unsupported value ({str(reply[-1])[:100]})")


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


def prepare(params):
    """The tests' namespace, made before the answer's process exists: the trusted prompt
    executed (its helpers and imports), and every module the prompt and the tests import
    (anywhere in their code) imported, so no import happens once the answer runs."""
    import ast
    import importlib

    if params["mode"] == "visible":
        import doctest  # noqa: F401
    names = set()
    for code in (params.get("prompt"), params.get("test"), params.get("visible_test")):
        with contextlib.suppress(SyntaxError, ValueError):
            for node in ast.walk(ast.parse(code or "")):
                if isinstance(node, ast.Import):
                    names |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
                    names |= {f"{node.module}.{alias.name}" for alias in node.names}
    for name in sorted(names):
        with contextlib.suppress(Exception):  # a missing module fails the tests that use it
            importlib.import_module(name)
    ns = {"__name__": "tests"}
    with contextlib.suppress(SyntaxError):  # a prompt in prose: no helpers to define
        exec(compile(params.get("prompt") or "", "<prompt>", "exec"), ns)
    return ns


def run_tests(params, ns, candidate):
    """Run the hidden (or visible) tests; returns the failure detail, '' when all passed."""
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
    import ast  # imported by prepare, before the answer ran

    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return prompt
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    return "\n".join(d for d in docs if d)


def _visible(params, ns):
    import doctest  # imported by prepare, before the answer ran

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
    """The verdict side (see the module docstring)."""
    params = json.loads(sys.stdin.read())
    nonce = params["nonce"]
    ns = prepare(params)
    os.write(START_ANSWER, b"1")
    os.close(START_ANSWER)
    try:
        first = _recv(FROM_ANSWER)
    except (ValueError, TypeError, RecursionError):
        first = ["load_error", "an unreadable message"]
    if first is None or first[0] != "loaded":
        detail = str(first[-1]) if first else "the answer's process exited while loading"
        print(
            f"\n{nonce} fail the answer does not load: {(detail.strip().splitlines() or [''])[-1]}"
        )
        sys.stdout.flush()
        os._exit(1)
    detail = run_tests(params, ns, Candidate())
    verdict = "pass" if not detail else "fail " + " ".join(detail.split())
    sys.stdout.write(f"\n{nonce} {verdict}\n")
    sys.stdout.flush()
    os._exit(0 if not detail else 1)


if __name__ == "__main__":
    if LIBRARY:
        sys.path.append(LIBRARY)
    if ROLE == "answer":
        serve_answer()
    else:
        main()
