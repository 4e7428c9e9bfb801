"""Line-delimited JSON messages over a TCP socket: the membership protocol's framing (never pickle).

One message = one JSON object on one line (``\\n``-terminated, UTF-8, at most :data:`MAX_LINE` bytes). Reference::

    encode(msg)  == json.dumps(msg, separators=(",", ":")).encode() + b"\\n"
    LineReader().feed(b'{"t":"hb"}\\n{"t":') == [{"t": "hb"}]      # the partial second line is kept
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["MAX_LINE", "PROTOCOL_VERSION", "LineReader", "ProtocolError", "encode", "tune_socket"]

PROTOCOL_VERSION = 1
"""Version of the membership protocol; a hello with another version is rejected."""

MAX_LINE = 1 << 16
"""Longest accepted line (bytes): membership messages are tiny; a longer line is a protocol violation."""


class ProtocolError(RuntimeError):
    """The peer sent something that is not a membership-protocol message (bad JSON, too long, not an object)."""


def encode(msg: dict[str, Any]) -> bytes:
    """Serialise one message."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Accumulates received bytes and yields complete messages."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_LINE:
                    raise ProtocolError(f"line longer than {MAX_LINE} bytes")
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError as exc:
                raise ProtocolError(f"not JSON: {line[:80]!r}") from exc
            if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
                raise ProtocolError(f"not a message object: {line[:80]!r}")
            out.append(msg)


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (tiny messages must not wait for Nagle) and keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
