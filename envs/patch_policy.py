"""What a repo answer may not add: a check of the patched tree before its tests run.

A repo answer's code runs in the process that runs the tests, so what the verdict can trust
rests on the answer not reaching the test runner. The structure does most of it (the driver
puts the test library before the repository on ``sys.path``, turns plugin autoload off and
guards the answer's process with an audit hook: :mod:`rlstream.envs.repo_driver`); this module
refuses, before anything runs, what no fix of a package's bug needs and what a forged verdict
does. Rules (``check`` returns the reasons, empty when the tree is acceptable):

- **Paths**: no file or folder named like the test machinery or an interpreter start-up hook
  (``pytest*``, ``_pytest``, ``pluggy``, ``py.py``, ``*.dist-info``, ``*.egg-info``, ``*.pth``,
  ``sitecustomize.py``, ``usercustomize.py``), anywhere in the tree; no file whose path runs
  through another file (``pkg/__init__.py/x``).
- **Python source**, for each ``.py`` file the answer changed or added, counted only where the
  use is new (absent from the same file of the base tree): imports of process, interpreter and
  test-runner modules (``DENIED_MODULES``); ``os``/``sys`` attributes that reach descriptors,
  processes or the interpreter's machinery (``DENIED_ATTRS``), and those modules used as values
  (``getattr(os, ...)``, ``m = sys``); the builtins that run or find code by name
  (``DENIED_NAMES``); the attributes that walk frames, code objects and class graphs
  (``DENIED_DUNDERS``); path literals under ``/proc`` and ``/dev/fd``. A file that does not
  parse is left to the tests (it fails them).

This is a filter in front of the run, not the boundary: docs/sandbox.md says what it covers and
what would close the rest.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping

from rlstream.envs import sandbox


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


DENIED_MODULES = _words(
    "_io _posixsubprocess _pytest _thread atexit builtins ctypes faulthandler fcntl gc "
    "importlib inspect mmap multiprocessing pluggy posix pty pytest resource signal socket "
    "subprocess threading tracemalloc"
)
DENIED_ATTRS = {
    "os": _words(
        "_exit abort close closerange dup dup2 execl execle execlp execv execve execvp fdopen "
        "fork forkpty kill killpg open openpty pipe pipe2 popen posix_spawn pwrite read "
        "sendfile spawnl spawnv system write writev __dict__"
    ),
    "sys": _words(
        "_current_frames _getframe addaudithook breakpointhook displayhook excepthook exit "
        "meta_path modules monitoring path_hooks path_importer_cache setprofile settrace "
        "stdout stderr __stdout__ __stderr__ __dict__"
    ),
}
DENIED_NAMES = _words("__builtins__ __import__ breakpoint compile eval exec globals")
DENIED_DUNDERS = _words(
    "__closure__ __code__ __globals__ __subclasses__ __loader__ __spec__ ag_frame cr_frame "
    "f_back f_builtins f_globals f_locals gi_frame tb_frame"
)
_PATH_PART = re.compile(
    r"^(pytest.*|_pytest|pluggy|py\.py|sitecustomize\.py|usercustomize\.py"
    r"|.*\.dist-info|.*\.egg-info|.*\.pth)$",
    re.IGNORECASE,
)


def check(base: Mapping[str, str], files: Mapping[str, str]) -> list[str]:
    """Why the tree ``files`` (base + the answer's patch) is refused; [] when it is not."""
    reasons = [f"{name}: {why}" for name, why in _bad_paths(files)]
    for name in sorted(files):
        if name.endswith(".py") and files[name] != base.get(name):
            new = _uses(files[name]) - _uses(base.get(name, ""))
            reasons += [f"{name}: uses {use} (no fix needs it; refused)" for use in sorted(new)]
    return reasons


def _bad_paths(files: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    for name in sorted(files):
        parts = name.split("/")
        if any(_PATH_PART.match(part) for part in parts):
            yield name, "named like the test runner or an interpreter start-up hook"
        above = sandbox.file_above(name, files)
        if above:
            yield name, f"{above} is a file, so nothing can lie under it"


def _uses(source: str) -> set[str]:
    """The refused uses in ``source`` (module rules); empty when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    aliases: dict[str, str] = {}  # a local name of os or sys -> which
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in DENIED_MODULES:
                    found.add(f"import {a.name}")
                if top in DENIED_ATTRS:
                    aliases[a.asname or top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top in DENIED_MODULES:
                found.add(f"from {node.module} import")
            for a in node.names:
                if top in DENIED_ATTRS and (a.name == "*" or a.name in DENIED_ATTRS[top]):
                    found.add(f"from {node.module} import {a.name}")
    owners: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owners.add(id(node.value))
            if node.attr in DENIED_DUNDERS:
                found.add(f".{node.attr}")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in aliases and node.attr in DENIED_ATTRS[aliases[owner]]:
                found.add(f"{aliases[owner]}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in DENIED_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Constant) and str(node.value).startswith(("/proc", "/dev/fd")):
            found.add(f"the path {str(node.value)[:40]!r}")
    # os or sys named other than as os.ATTR: a way around DENIED_ATTRS (getattr(os, 'wr'+'ite'))
    found |= {
        f"{aliases[n.id]} as a value"
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id in aliases and id(n) not in owners
    }
    return found
