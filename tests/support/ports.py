"""Ports for the servers tests start: free on 127.0.0.1 only, never another interface."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 right now (for a server that must be told its port before it
    starts, such as the daemon's ``[daemon] http``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
