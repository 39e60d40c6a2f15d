"""The role's end of the sandbox service (``envs.sandbox.service``): start it as root, then send
it requests, each on a connection of its own. Imports nothing of the sandbox, which calls it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

from rlstream.schemas.errors import RlstreamError

_LEN = struct.Struct("!Q")
MAX_MESSAGE = 1 << 30
ALLOWED_ENV = "RLSTREAM_SANDBOX_PYTHONS"  # the interpreters a request may name (os.pathsep)
_MAIN = (
    "import socket, sys; from rlstream.envs.sandbox.service import serve; "
    "serve(socket.socket(fileno=int(sys.argv[1])))"
)


class ServiceError(RlstreamError, RuntimeError):
    """The service refused or failed a request: ``kind`` is ``isolation``, ``value`` or ``os``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Client:
    """The role's end of a running service."""

    def __init__(self, proc: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.proc, self.control = proc, control
        self.lock = threading.Lock()

    def ask(self, request: dict[str, Any]) -> Any:
        """Send ``request`` on a connection of its own; the answer, or ``ServiceError``."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine:
            with self.lock, theirs:
                socket.send_fds(self.control, [b"r"], [theirs.fileno()])
            send(mine, request)
            answer = receive(mine)
        if answer is None:
            raise ServiceError("os", "the sandbox service closed the connection (it exited)")
        if "error" in answer:
            raise ServiceError(answer["error"], answer["message"])
        return answer["ok"]

    def close(self) -> None:
        """Close the control socket (the service exits on it) and reap the service."""
        self.control.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_CLIENT: Client | None = None


def active() -> Client | None:
    """This process's service, when it runs its sandboxes through one."""
    return _CLIENT


def use(client: Client | None) -> None:
    """Run this process's sandboxes through ``client`` (None: here, as before ``start``)."""
    global _CLIENT
    _CLIENT = client


def start(pythons: tuple[str, ...] = ()) -> Client:
    """Start the service (as root, before the caller drops its privileges); the sandbox calls of
    this process go to it from now on. ``pythons``: interpreters a request may name besides the
    default one."""
    if os.geteuid() != 0:
        raise PermissionError("the sandbox service must be started as root")
    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    allowed = os.pathsep.join(os.path.realpath(p) for p in pythons)
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _MAIN, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", ALLOWED_ENV: allowed},
            start_new_session=True,  # the role's signals to its group do not reach it
        )
    use(Client(proc, control))
    assert _CLIENT is not None
    return _CLIENT


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """One length-prefixed JSON message."""
    data = json.dumps(message).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """One message, or None at the end of the stream."""
    head = _exactly(sock, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE:
        raise ServiceError("value", f"a sandbox message of {size} bytes is over the limit")
    data = _exactly(sock, size)
    return None if data is None else json.loads(data)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
