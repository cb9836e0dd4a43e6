"""Free TCP ports, for every component that starts a server on a port it picks."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free when asked (another process may take it
    before the caller binds it). ``0.0.0.0`` asks for one free on every interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
