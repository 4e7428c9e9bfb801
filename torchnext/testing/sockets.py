"""Raw-socket helpers for tests that talk to a listening service as a hostile or careless peer would."""

from __future__ import annotations

import socket

__all__ = ["read_to_close", "send_all"]


def read_to_close(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the peer closes (``TimeoutError`` if it keeps the connection open)."""
    got = b""
    s.settimeout(timeout)
    while True:
        try:
            data = s.recv(1 << 16)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


def send_all(s: socket.socket, data: bytes) -> None:
    """``s.sendall(data)``, ignoring a peer that closes before reading everything (the service may)."""
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
