"""The tools a task family offers the policy, and the workspace they act on.

Call syntax: with one tool, a ``<run>`` block is that tool's input; otherwise ``@NAME INPUT``
calls tool NAME and a block without ``@`` goes to the first tool. Standard tools: ``python``,
``read``, ``write``, ``ls``, ``test``. ``Environment.schemas()`` gives the tools as OpenAI
function schemas and ``Environment.call_args`` runs a call given as JSON, so both syntaxes reach
the same tool code.

Rules a maintainer must keep: ``read``, ``write`` and ``ls`` never touch the host's file system
(the workspace is held by value, bounded by ``MAX_FILES`` and ``MAX_BYTES``); a call never raises:
it returns a :class:`ToolResult` that is ``ok``, ``error`` or ``refused``.

Details: docs/task-families.md (Tools and the workspace).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlstream.envs import sandbox

MAX_FILES = 32
MAX_BYTES = 256 * 1024


@dataclass
class ToolResult:
    """What one call returned to the policy, and how it went."""

    output: str
    status: str = "ok"  # ok | error | refused
    isolation: str = "not_run"  # the sandbox mode the call ran under, if it ran code


@dataclass
class Workspace:
    """One sample's files, held by value (see the module rules)."""

    files: dict[str, bytes] = field(default_factory=dict)
    max_files: int = MAX_FILES
    max_bytes: int = MAX_BYTES

    def put(self, name: str, data: bytes) -> None:
        """Create or replace ``name``; ValueError past the name rules or the caps."""
        sandbox.check_name(name)
        others = {k: v for k, v in self.files.items() if k != name}
        under = sandbox.file_above(name, others)
        if under or any(k.startswith(name + "/") for k in others):
            raise ValueError(f"{name}: {under or name} would be a file and a folder at once")
        if len(others) + 1 > self.max_files:
            raise ValueError(f"workspace full: at most {self.max_files} files")
        if sum(map(len, others.values())) + len(data) > self.max_bytes:
            raise ValueError(f"workspace full: at most {self.max_bytes} bytes in all")
        self.files[name] = data

    def replace(self, files: dict[str, bytes]) -> None:
        """Take what a sandbox run left in ``/work``, within the caps (the rest is dropped)."""
        kept: dict[str, bytes] = {}
        for name in sorted(files):
            if (
                len(kept) < self.max_files
                and sum(map(len, kept.values())) + len(files[name]) <= self.max_bytes
            ):
                kept[name] = files[name]
        self.files = kept


ToolFn = Callable[[Workspace, str, sandbox.SandboxConfig], ToolResult]


def _single(args: dict[str, str]) -> str:
    return next(iter(args.values()), "")


def _path_then_content(args: dict[str, str]) -> str:
    return f"{args['path']}\n{args['content']}"


def json_object(args: dict[str, str]) -> str:
    """The text input of a tool of several arguments: the arguments as one JSON object."""
    return json.dumps(args)


@dataclass(frozen=True)
class Tool:
    """A named tool: ``run(workspace, input, sandbox_config)``; ``params`` its arguments (name,
    description) and ``text_of`` how a JSON call's arguments become its text input."""

    name: str
    usage: str
    run: ToolFn
    params: tuple[tuple[str, str], ...] = (("input", "the tool's input"),)
    text_of: Callable[[dict[str, str]], str] = _single
    optional: tuple[str, ...] = ()  # params a call may leave out

    def schema(self) -> dict[str, Any]:
        """The tool as an OpenAI function schema (every argument a required string)."""
        props = {n: {"type": "string", "description": d} for n, d in self.params}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.usage,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": [n for n in props if n not in self.optional],
                },
            },
        }


@dataclass(frozen=True)
class Environment:
    """What one sample may use: tools (the first is the default) and its starting files."""

    tools: tuple[Tool, ...]
    files: dict[str, str] = field(default_factory=dict)
    uses_workspace: bool = True
    #: the answer when it is the workspace (e.g. its diff against the base), else None: the
    #: policy's text is the answer
    final: Callable[[Workspace], str] | None = None
    max_files: int = MAX_FILES  # the workspace's caps
    max_bytes: int = MAX_BYTES
    #: seconds the environment's own work for a group goes on after generation (sandboxes on
    #: machines of their own finishing), by group size and the task's seed; the rollout worker
    #: waits it out, or with ``rollout.env_overlap`` generates on meanwhile. None: nothing after.
    settle: Callable[[int, int], float] | None = None

    def workspace(self) -> Workspace:
        files = {k: v.encode() for k, v in self.files.items()}
        return Workspace(files, self.max_files, self.max_bytes)

    @property
    def help(self) -> str:
        return "; ".join(t.usage for t in self.tools)

    def parse(self, text: str) -> tuple[Tool | None, str]:
        """(tool, input) of one call; (None, why) for an unknown tool."""
        if len(self.tools) == 1 or not text.startswith("@"):
            return self.tools[0], text
        head, _, rest = text[1:].partition("\n")
        name, _, inline = head.partition(" ")
        arg = inline + ("\n" + rest if rest else "") if inline else rest
        for tool in self.tools:
            if tool.name == name.strip():
                return tool, arg
        return None, f"unknown tool @{name.strip()} (tools: {self.help})"

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool as an OpenAI function schema, in order."""
        return [t.schema() for t in self.tools]

    def call(
        self, workspace: Workspace, text: str, box: sandbox.SandboxConfig
    ) -> tuple[str, ToolResult]:
        """Run one call: (tool name, result). Never raises."""
        tool, arg = self.parse(text)
        if tool is None:
            return "?", ToolResult(arg, "error")
        return self._run(tool, workspace, arg, box)

    def call_args(
        self, workspace: Workspace, name: str, args: Any, box: sandbox.SandboxConfig
    ) -> tuple[str, ToolResult]:
        """Run one call given as a tool name and its JSON arguments (module rules). Never raises."""
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            known = ", ".join(t.name for t in self.tools)
            return "?", ToolResult(f"[error: unknown tool {name!r} (tools: {known})]", "error")
        wanted = [n for n, _ in tool.params]
        if not isinstance(args, dict):
            return tool.name, ToolResult("[error: arguments must be a JSON object]", "error")
        wrong = sorted((set(args) - set(wanted)) | (set(wanted) - set(tool.optional) - set(args)))
        bad = [k for k, v in args.items() if not isinstance(v, str)]
        if wrong or bad:
            why = f"takes {wanted}" + (f"; not strings: {bad}" if bad else "")
            return tool.name, ToolResult(f"[error: {tool.name} {why}]", "error")
        return self._run(tool, workspace, tool.text_of(args), box)

    def _run(
        self, tool: Tool, workspace: Workspace, arg: str, box: sandbox.SandboxConfig
    ) -> tuple[str, ToolResult]:
        try:
            return tool.name, tool.run(workspace, arg, box)
        except sandbox.IsolationUnavailable as exc:
            return tool.name, ToolResult(f"[refused: {exc}]", "refused")
        except ValueError as exc:
            return tool.name, ToolResult(f"[error: {exc}]", "error")


def sandbox_output(result: sandbox.SandboxResult) -> ToolResult:
    """A sandbox run as a tool result: stdout, stderr and, unless ok, ``[status]``."""
    text = result.stdout + result.stderr
    if result.status != "ok":
        text += f"[{result.status}]"
    return ToolResult(text, "ok" if result.status == "ok" else "error", result.mode)


def _python(workspace: Workspace, code: str, box: sandbox.SandboxConfig) -> ToolResult:
    result = sandbox.run(code, box, files=dict(workspace.files))
    if result.files is not None and result.status != "error":
        workspace.replace(result.files)
    return sandbox_output(result)


def _python_no_workspace(workspace: Workspace, code: str, box: sandbox.SandboxConfig) -> ToolResult:
    return sandbox_output(sandbox.run(code, box))


def _read(workspace: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    name = sandbox.check_name(arg.strip())
    if name not in workspace.files:
        return ToolResult(f"[no such file: {name}]", "error")
    return ToolResult(workspace.files[name].decode("utf-8", errors="replace"))


def _write(workspace: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    name, _, content = arg.partition("\n")
    workspace.put(name.strip(), content.encode())
    return ToolResult(f"wrote {name.strip()} ({len(content.encode())} bytes)")


def _ls(workspace: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
    return ToolResult("\n".join(f"{n} {len(d)}" for n, d in sorted(workspace.files.items())))


_CODE = (("code", "Python source to run"),)
_PATH = (("path", "a workspace file name"),)
PYTHON = Tool("python", "@python CODE (runs it; /work is the workspace)", _python, _CODE)
PYTHON_ONLY = Tool("python", "CODE (runs it)", _python_no_workspace, _CODE)
READ = Tool("read", "@read PATH", _read, _PATH)
WRITE = Tool(
    "write",
    "@write PATH then the content on the next lines",
    _write,
    (*_PATH, ("content", "the file's new content")),
    _path_then_content,
)
LS = Tool("ls", "@ls", _ls, ())


def code_only() -> Environment:
    """One tool, Python code with no workspace: the ``fx`` environment (``<run>CODE</run>``)."""
    return Environment((PYTHON_ONLY,), uses_workspace=False)


def unavailable(reason: str) -> Environment:
    """An environment that could not be built: every call is refused with ``reason``."""

    def refuse(workspace: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
        return ToolResult(f"[environment unavailable: {reason}]", "refused")

    return Environment((Tool("unavailable", "(no tools)", refuse),), uses_workspace=False)
