"""The sandbox's privileged part, for a role that runs as an unprivileged user of its own.

A sandbox in ``full`` isolation needs root (fresh uids, mounts, cgroups), and a root process reads
every file of the host. So a role that runs as its own OS user (``ops.run.os_users``) starts this
service while it is still root (``client.start``), then drops to its user; the service stays root
and is the only privileged part. The role's ``sandbox.run``, ``probe`` and ``library_of`` become
requests to it (``envs.sandbox.client``).

Rules a maintainer must keep:
- the caller chooses no uid, path or mount: a request carries the programs, the workspace's files
  by value, stdin and a ``SandboxConfig`` that is validated again here; its ``library`` folders
  must be ones this service made (``library_of`` here), its ``python`` one named at start;
- one connection per request: the caller passes a fresh socket over the control socket, so runs
  of a role's threads go on side by side;
- the service exits when the control socket closes (the role exited or died).
"""

from __future__ import annotations

import base64
import os
import socket
import threading
from dataclasses import asdict
from typing import Any

from rlstream.envs import sandbox
from rlstream.envs.sandbox.client import ALLOWED_ENV, ServiceError, receive, send


class _Service:
    def __init__(self, pythons: set[str]) -> None:
        self.pythons = pythons
        self.libraries: set[str] = set()

    def answer(self, request: dict[str, Any]) -> Any:
        op = request.get("op")
        if op == "probe":
            return sandbox.probe()
        if op == "library":
            path = sandbox.library_of(tuple(str(m) for m in request["modules"]))
            self.libraries.add(path)
            return path
        if op == "run":
            return self.run(request)
        raise ValueError(f"unknown request {op!r}")

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        cfg = sandbox.SandboxConfig.model_validate(request["cfg"])
        foreign = [p for p in cfg.library if p not in self.libraries]
        if foreign:
            raise ValueError(f"library {foreign[0]!r} was not made by the sandbox service")
        if cfg.python is not None and os.path.realpath(cfg.python) not in self.pythons:
            raise ValueError(f"interpreter {cfg.python!r} is not one the sandbox may run")
        files = request["files"]
        given = None if files is None else {k: base64.b64decode(v) for k, v in files.items()}
        code, answer = str(request["code"]), request["answer"]
        result = sandbox.run(code, cfg, str(request["stdin"]), given, answer)
        out = asdict(result)
        out["files"] = (
            None
            if result.files is None
            else {k: base64.b64encode(v).decode() for k, v in result.files.items()}
        )
        return out


def serve(control: socket.socket) -> None:
    """Answer requests until the control socket closes."""
    pythons = {p for p in os.environ.get(ALLOWED_ENV, "").split(os.pathsep) if p}
    service = _Service(pythons)
    while True:
        _msg, fds, _flags, _addr = socket.recv_fds(control, 16, 1)
        if not fds:
            return
        conn = socket.socket(fileno=fds[0])
        threading.Thread(target=_handle, args=(service, conn), daemon=True).start()


def _handle(service: _Service, conn: socket.socket) -> None:
    with conn:
        try:
            request = receive(conn)
            if request is None:
                return
            reply = {"ok": service.answer(request)}
        except sandbox.IsolationUnavailable as exc:
            reply = {"error": "isolation", "message": str(exc)}
        except ServiceError as exc:
            reply = {"error": exc.kind, "message": str(exc)}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": "value", "message": f"{type(exc).__name__}: {exc}"}
        except OSError as exc:
            reply = {"error": "os", "message": f"{type(exc).__name__}: {exc}"}
        send(conn, reply)
