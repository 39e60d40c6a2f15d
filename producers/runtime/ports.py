"""Loopback ports for the servers we start (brokers, links, engines, HTTP services).

A port picked now and bound later (a broker's listener, written into its properties before it
starts) can be taken in between. Asking the kernel for port 0 returns one from the *ephemeral*
range, the same range every outgoing connection takes its local port from, so on a busy host
(Kafka clients open hundreds of connections) such a port is often gone before our server binds
it. ``free_port`` picks from below that range instead, where only listeners that name their port
live, and checks the port can be bound now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 200) -> int:
    """A loopback port free now and outside the ephemeral range (see the module note); the
    kernel's choice when that range leaves no room below it."""
    high = _ephemeral_low()
    if high - LOWEST >= 1000:
        for _ in range(tries):
            port = random.randrange(LOWEST, high)
            if bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
