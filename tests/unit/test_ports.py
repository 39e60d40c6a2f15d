"""Ports for our servers come from outside the range outgoing connections take theirs from."""

import socket

from rlstream.producers.runtime import ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_bound_port_is_not_bindable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ports.bindable(sock.getsockname()[1])


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST + 10)
    assert ports.bindable(ports.free_port())
