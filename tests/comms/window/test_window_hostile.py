"""Hostile input against a live window TCP service: bad hellos (wrong proof, random bytes, the old protocol, an
8 MiB blob), nonsense requests after authenticating, and a hypothesis fuzzer over the header format. Each ends at
most its own connection; the service answers the next one and a legitimate origin's channel keeps working.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchnext.testing.sockets import read_to_close, send_all

pytestmark = pytest.mark.timeout(120)

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class _Window:
    """A live window TCP service (rank 0's segment of a world of 2) and a legitimate origin channel (rank 1)."""

    def __init__(self) -> None:
        from torchnext.comms.window.segment import Segment
        from torchnext.comms.window.tcp import TcpChannel, TcpService

        self.token = os.urandom(32)
        self.segment = Segment.create(64, torch.float32, 2)
        self.segment.data.copy_(torch.arange(64, dtype=torch.float32))
        self.service = TcpService(self.segment, self.token, "127.0.0.1", (8, 8), 2)
        self.address = self.service.address
        self.channel = TcpChannel(0, 1, self.address, self.token, 5.0, {}, {})

    def healthy(self) -> None:
        """A fresh connection gets its challenge, and the legitimate channel still reads and writes."""
        with socket.create_connection(self.address, timeout=5) as s:
            s.settimeout(5)
            assert len(s.recv(64)) > 0
        out = torch.empty(4)
        self.channel.get(4, out)
        assert out.tolist() == [4.0, 5.0, 6.0, 7.0]
        self.channel.put(60, torch.tensor([1.0, 2.0]))
        back = torch.empty(2)
        self.channel.get(60, back)
        assert back.tolist() == [1.0, 2.0]

    def close(self) -> None:
        self.channel.close()
        self.service.close()
        self.segment.close()


@pytest.fixture(scope="module")
def window() -> Iterator[_Window]:
    w = _Window()
    try:
        yield w
    finally:
        w.close()


def _window_conn(w: _Window, authenticate: bool) -> socket.socket:
    from torchnext.comms.window.tcp import CHALLENGE_BYTES, HELLO, MAGIC, proof

    s = socket.create_connection(w.address, timeout=5)
    nonce = b""
    while len(nonce) < CHALLENGE_BYTES:
        nonce += s.recv(CHALLENGE_BYTES - len(nonce))
    if authenticate:
        s.sendall(HELLO.pack(MAGIC, 1, proof(w.token, nonce, 1)))
        assert s.recv(1) == b"\x00"
    return s


@pytest.mark.parametrize("case", ["wrong_token", "random_bytes", "nested", "eight_mib", "old_protocol"])
def test_window_service_hostile_hello(window: _Window, case: str) -> None:
    from torchnext.comms.window.tcp import HELLO, MAGIC

    with _window_conn(window, authenticate=False) as s:
        data = {"wrong_token": HELLO.pack(MAGIC, 1, os.urandom(32)), "random_bytes": os.urandom(4096),
                "nested": b"[" * 100_000 + b"\n", "eight_mib": b"x" * (8 << 20),
                "old_protocol": HELLO.pack(b"TNW1", 1, window.token)}[case]
        send_all(s, data)
        got = read_to_close(s)
    assert got in (b"", b"\x01"), got[:16]
    window.healthy()


def test_window_service_hostile_requests_after_auth(window: _Window) -> None:
    """An authenticated origin sends nonsense headers: out-of-range offsets, a 16 EiB payload length, a huge
    get_rows; each gets an error status or its connection closed, never a crash or an allocation it asked for."""
    from torchnext.comms.window.tcp import REPLY, REQUEST

    for header in (REQUEST.pack(1, 0, 0, 1, -5, 4, 16), REQUEST.pack(1, 0, 0, 2, 0, 1 << 40, (1 << 64) - 1),
                   REQUEST.pack(3, 0, 0, 3, 0, 1 << 40, 8 << 40), REQUEST.pack(99, 0, 0, 4, 0, 0, 0),
                   REQUEST.pack(4, 0, 250, 5, 0, 1, 4) + b"\0" * 4):
        with _window_conn(window, authenticate=True) as s:
            send_all(s, header)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            got = read_to_close(s)
        if got:
            status = REPLY.unpack(got[:REPLY.size])[0]
            assert status != 0, got
    window.healthy()


@given(hello=st.binary(min_size=0, max_size=80), authenticate=st.booleans(),
       requests=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535),
                                   st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1),
                                   st.integers(0, (1 << 64) - 1), st.binary(max_size=64)), max_size=3))
@_FUZZ
def test_fuzz_the_window_service(window: _Window, hello: bytes, authenticate: bool,
                                 requests: list[tuple[int, int, int, int, int, int, bytes]]) -> None:
    """Random hellos (unauthenticated) or random request headers and payloads (authenticated): the service
    always answers and the legitimate origin's channel keeps working."""
    from torchnext.comms.window.tcp import REQUEST

    with _window_conn(window, authenticate) as s:
        if not authenticate:
            send_all(s, hello)
        else:
            for op, code, aux, offset, numel, plen, payload in requests:
                send_all(s, REQUEST.pack(op, code, aux, 1, offset, numel, plen) + payload)
        with contextlib.suppress(OSError):  # the service may have closed it already
            s.shutdown(socket.SHUT_WR)
        try:
            read_to_close(s, timeout=2.0)
        except TimeoutError:
            pass  # the service waits for the rest of a payload we declared: our close ends it
    window.healthy()
