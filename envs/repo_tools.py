"""The ``repo`` family's editing tools, and the test runner they and the scorer share.

Tools (each takes JSON arguments in a chat model's tool-call format, or, in rlstream's tags,
``@NAME`` followed by a JSON object or by the one required argument's value):

- ``view {"path", "lines"?}``: the file with line numbers, ``lines`` ``"START-END"`` (default
  the first ``VIEW_LINES``);
- ``search {"pattern", "path"?}``: lines containing ``pattern`` (plain text), ``PATH:LINE: text``,
  in every file or one, at most ``SEARCH_HITS``;
- ``replace {"path", "old", "new"}``: replaces ``old``, which must occur exactly once;
- ``create {"path", "content"}``: a new file (refused when it exists);
- ``apply_patch {"patch"}``: applies a unified diff (:mod:`rlstream.envs.patches`), all or nothing;
- ``test {"tests"?}``: runs the repository's tests (space-separated pytest node ids, default
  all) in the sandbox and shows the tail of pytest's report.

Every output is bounded (``MAX_OUTPUT`` characters; the harness caps what the policy sees
again). Edits act on the workspace held by value, never on the host. The test runner is
:mod:`rlstream.envs.repo_driver` (after :mod:`rlstream.envs.repo_bridge`): for the tools pytest
runs in-process in the sandboxed interpreter, reading pytest and what the tests need from
``test_library()``: a copy made once per process, owned by
root and writable by no one else, which the sandbox binds read-only (``SandboxConfig.library``).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlstream.envs import patches, sandbox
from rlstream.envs.tools import Environment, Tool, ToolResult, Workspace, json_object
from rlstream.schemas.derive import derive

DRIVER = Path(__file__).resolve().parent / "repo_driver.py"
BRIDGE = DRIVER.with_name("repo_bridge.py")
#: What the tests of a repository need, copied into the sandbox's read-only library folder.
LIBRARY_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
VIEW_LINES = 80
SEARCH_HITS = 40
MAX_OUTPUT = 6000
MAX_FILES = 64  # the sandbox's workspace cap
MAX_BYTES = 2 * 2**20


def test_library() -> str:
    """A root-owned copy of ``LIBRARY_MODULES`` no one else can write (one per process, the
    same folder for every caller: ``sandbox.library_of``)."""
    import importlib.util

    specs = {m: importlib.util.find_spec(m) for m in LIBRARY_MODULES}
    present = tuple(m for m, spec in specs.items() if spec is not None and spec.origin)
    return sandbox.library_of(present)  # `py` is gone from newer pytest installs


def driver(role: str, paths: list[str], tests: list[str]) -> str:
    """The program of one ``repo_driver`` role, its constants filled in."""
    source = DRIVER.read_text(encoding="utf-8")
    head = 'ROLE = "verdict"\nPATHS = ["."]\nLIBRARY: list = []\nTESTS: list = []\n'
    lib = [test_library()]
    mine = f"ROLE = {role!r}\nPATHS = {paths!r}\nLIBRARY = {lib!r}\nTESTS = {tests!r}\n"
    if head not in source:
        raise RuntimeError(f"{DRIVER} lost its constants block")
    return BRIDGE.read_text(encoding="utf-8") + "\n\n" + source.replace(head, mine, 1)


def prompt(problem_statement: str, repo: str) -> str:
    """What the policy sees."""
    return (
        f"{problem_statement.strip()}\n\nThe repository ({repo}) is your workspace. Change its "
        "source so that the issue is fixed and its tests pass; your answer is your change."
    )


def _args(arg: str, names: tuple[str, ...], need: int = 1) -> dict[str, str]:
    """A tool's arguments: a JSON object, or the text as its first argument; ValueError unless
    the first ``need`` of ``names`` are there."""
    value: object = {names[0]: arg.strip()}
    if arg.lstrip().startswith("{"):
        value = json.loads(arg)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError("arguments must be a JSON object of strings")
    missing = [n for n in names[:need] if n not in value]
    if missing:
        raise ValueError(f"missing arguments: {missing} (takes {list(names)})")
    return value


def _text(ws: Workspace, path: str) -> str:
    name = sandbox.check_name(path.strip())
    if name not in ws.files:
        raise ValueError(f"no such file: {name}")
    return ws.files[name].decode("utf-8", errors="replace")


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n[... cut]"


def _view(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    a = _args(arg, ("path", "lines"))
    lines = _text(ws, a["path"]).splitlines()
    first, _, last = a.get("lines", f"1-{VIEW_LINES}").partition("-")
    lo = max(1, int(first or 1))
    hi = min(len(lines), int(last) if last else lo + VIEW_LINES - 1)
    shown = [f"{n:5} {lines[n - 1]}" for n in range(lo, hi + 1)]
    return ToolResult(_bounded("\n".join(shown) + f"\n({len(lines)} lines)"))


def _search(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    a = _args(arg, ("pattern", "path"))
    names = [sandbox.check_name(a["path"])] if a.get("path") else sorted(ws.files)
    hits = [
        f"{name}:{n}: {line.strip()}"
        for name in names
        for n, line in enumerate(_text(ws, name).splitlines(), 1)
        if a["pattern"] in line
    ]
    more = f"\n[{len(hits) - SEARCH_HITS} more]" if len(hits) > SEARCH_HITS else ""
    return ToolResult(_bounded("\n".join(hits[:SEARCH_HITS]) + more or "no match"))


def _replace(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    a = _args(arg, ("path", "old", "new"), 3)
    text = _text(ws, a["path"])
    count = text.count(a["old"]) if a["old"] else 0
    if count != 1:
        return ToolResult(f"[error: 'old' occurs {count} times in {a['path']}; need 1]", "error")
    ws.put(a["path"], text.replace(a["old"], a["new"]).encode())
    return ToolResult(f"replaced 1 occurrence in {a['path']}")


def _create(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    a = _args(arg, ("path", "content"), 2)
    if sandbox.check_name(a["path"]) in ws.files:
        return ToolResult(f"[error: {a['path']} exists; use replace or apply_patch]", "error")
    ws.put(a["path"], a["content"].encode())
    return ToolResult(f"created {a['path']}")


def _apply(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    files = {k: v.decode("utf-8", errors="replace") for k, v in ws.files.items()}
    try:
        new = patches.apply(files, arg)
    except patches.PatchError as exc:
        return ToolResult(f"[error: {exc}]", "error")
    staged = Workspace({}, ws.max_files, ws.max_bytes)
    for name, text in new.items():
        staged.put(name, text.encode())  # ValueError past the caps: nothing applied
    ws.files = staged.files
    return ToolResult(f"applied to {', '.join(patches.touched(arg))}")


def _tester(paths: list[str], limits: sandbox.SandboxConfig) -> Tool:
    def run(ws: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
        tests = _args(arg, ("tests",)).get("tests", "").split() if arg.strip() else []
        cfg = derive(limits, isolation=box.isolation)
        result = sandbox.run(driver("tool", paths, tests), cfg, files=dict(ws.files))
        text = result.stdout + result.stderr
        if result.status != "ok":
            text += f"[{result.status}: {result.reason}]"
        return ToolResult(
            text[-MAX_OUTPUT:], "ok" if result.status == "ok" else "error", result.mode
        )

    return Tool(
        "test",
        "@test [NODE IDS] (runs the repository's tests, all or named)",
        run,
        (("tests", "pytest node ids, space-separated (default: all)"),),
        json_object,
        ("tests",),
    )


_PATH = ("path", "a file of the repository")
VIEW = Tool(
    "view",
    '@view {"path", "lines": "START-END"} (a file with line numbers)',
    _view,
    (_PATH, ("lines", "START-END, default the first lines")),
    json_object,
    ("lines",),
)
SEARCH = Tool(
    "search",
    '@search {"pattern", "path"} (lines containing pattern)',
    _search,
    (("pattern", "plain text to find"), ("path", "one file (default: all)")),
    json_object,
    ("path",),
)
REPLACE = Tool(
    "replace",
    '@replace {"path", "old", "new"} (old must occur once)',
    _replace,
    (_PATH, ("old", "the exact text to replace"), ("new", "its replacement")),
    json_object,
)
CREATE = Tool(
    "create",
    '@create {"path", "content"} (a new file)',
    _create,
    (_PATH, ("content", "the file's content")),
    json_object,
)
APPLY = Tool("apply_patch", "@apply_patch UNIFIED DIFF", _apply, (("patch", "a unified diff"),))


def environment(
    files: dict[str, str], paths: list[str], limits: sandbox.SandboxConfig
) -> Environment:
    """The tools on a workspace holding ``files``; the answer is its diff against them."""

    def final(ws: Workspace) -> str:
        now = {k: v.decode("utf-8", errors="replace") for k, v in ws.files.items()}
        return patches.diff(files, now)

    return Environment(
        (VIEW, SEARCH, REPLACE, CREATE, APPLY, _tester(paths, limits)),
        dict(files),
        final=final,
        max_files=MAX_FILES,
        max_bytes=MAX_BYTES,
    )
