"""Hostile input against the coordinator's live membership port (the window TCP service: tests/comms/window/
test_window_hostile.py).

Whatever a peer sends -- before or after authenticating -- ends at most that one connection, with a logged reason;
the service keeps answering and the other members' sessions are untouched. Regression cases from issue 18 plus a
hypothesis fuzzer over the wire format (bounded: ``max_examples`` chosen so it runs in a few seconds).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.ft._wire import MAX_LINE, MEMBER_MESSAGES, PROTOCOL_VERSION, LineReader, encode, mac, new_nonce
from torchnext.ft.member import MemberClient
from torchnext.testing.sockets import read_to_close, send_all

pytestmark = pytest.mark.timeout(120)

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


# ------------------------------------------------------------------------------------------ the coordinator
class _Session:
    """A live coordinator with one legitimate member connected (its MemberClient heartbeats in the background)."""

    def __init__(self) -> None:
        self.coord = Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1,
                                                                               grow_timeout_s=30.0)))
        self.coord.start()
        self.interrupts: list[dict[str, Any]] = []
        self.member = MemberClient(self.coord.address, self.coord.token, member_id=7, step=0, connect_timeout_s=10,
                                   coordinator_timeout_s=2.0, on_interrupt=self.interrupts.append)
        assert self.coord.wait_until(lambda c: c.members == (7,), 10), self.coord.members

    def close(self) -> None:
        self.member.close()
        self.coord.stop()

    def healthy(self) -> None:
        """The service answers a new connection with a challenge, and member 7's session is untouched."""
        assert self.coord.serving(), "the coordinator's service thread died"
        with socket.create_connection(("127.0.0.1", self.coord.port), timeout=5) as s:
            first = _read_msgs(s, 1)
        assert first and first[0]["t"] == "challenge", first
        assert self.member.fatal is None, self.member.fatal
        assert 7 in self.coord.members, self.coord.members
        assert not [m for m in self.interrupts if m["t"] in ("lost", "removed", "fatal")], self.interrupts


@pytest.fixture(scope="module")
def session() -> Iterator[_Session]:
    s = _Session()
    try:
        yield s
    finally:
        s.close()


def _read_msgs(s: socket.socket, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    reader, out = LineReader(), []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = s.recv(1 << 16)
        except (TimeoutError, ConnectionResetError):
            break
        if not data:
            break
        out += reader.feed(data)
    return out


def _authenticated(coord: Coordinator, **hello: Any) -> socket.socket:
    """A raw connection that passed the challenge-response (a joined member, no heartbeat thread)."""
    s = socket.create_connection(("127.0.0.1", coord.port), timeout=5)
    challenge = _read_msgs(s, 1)[0]
    mine = new_nonce()
    msg = {"t": "hello", "nonce": mine, "proof": mac(coord.token, "member", challenge["nonce"], mine),
           "proto": PROTOCOL_VERSION, "step": 0, **hello}
    s.sendall(encode(msg))
    welcome = _read_msgs(s, 1)[0]
    assert welcome["t"] == "welcome", welcome
    return s


@pytest.mark.parametrize(("depth", "reason"), [(100_000, "line longer than"), (60_000, "nested deeper than")])
def test_deeply_nested_line_before_hello(session: _Session, caplog: pytest.LogCaptureFixture, depth: int,
                                         reason: str) -> None:
    """Issue 18: one line of 100 000 '[' used to kill the service thread (RecursionError in json.loads). It is now
    refused for its length; 60 000 '[' (under MAX_LINE) for its depth, before json.loads sees it."""
    with caplog.at_level(logging.WARNING, logger="torchnext.ft"), \
            socket.create_connection(("127.0.0.1", session.coord.port), timeout=5) as s:
        _read_msgs(s, 1)
        send_all(s, b"[" * depth + b"\n")
        lines = [json.loads(x) for x in read_to_close(s).splitlines()]
    assert lines and lines[-1]["t"] == "reject" and lines[-1]["code"] == "bad_request", lines
    assert reason in lines[-1]["reason"]
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    session.healthy()


def test_vote_with_a_string_generation_after_hello(session: _Session, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 18: after the hello, {"t": "vote", "gen": "abc"} used to raise ValueError in the service thread."""
    s = _authenticated(session.coord)
    with caplog.at_level(logging.WARNING, logger="torchnext.ft"), s:
        s.sendall(b'{"t":"vote","gen":"abc"}\n')
        read_to_close(s)  # closed by the service
    assert any("vote.gen must be an int" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    session.healthy()


@pytest.mark.parametrize("case", ["random_bytes", "eight_mib_line", "bad_json", "wrong_token", "pickle"])
def test_other_hostile_inputs(session: _Session, case: str) -> None:
    with socket.create_connection(("127.0.0.1", session.coord.port), timeout=5) as s:
        challenge = _read_msgs(s, 1)[0]
        if case == "random_bytes":
            send_all(s, os.urandom(4096) + b"\n")
        elif case == "eight_mib_line":
            send_all(s, b"x" * (8 << 20) + b"\n")
        elif case == "bad_json":
            send_all(s, b'{"t": "hello", "nonce": \n')
        elif case == "pickle":
            send_all(s, b"\x80\x04\x95pickle\n")
        else:
            mine = new_nonce()
            send_all(s, encode({"t": "hello", "nonce": mine, "proof": mac("not-the-token", "member",
                                                                             challenge["nonce"], mine),
                                 "proto": PROTOCOL_VERSION, "step": 0}))
        got = read_to_close(s)
    if got:
        last = json.loads(got.splitlines()[-1])
        assert last["t"] == "reject", last
        if case == "wrong_token":
            assert last["code"] == "auth"
    session.healthy()


def test_many_idle_unauthenticated_connections_do_not_block_members(session: _Session) -> None:
    """More silent connections than MAX_UNAUTHENTICATED: the oldest are shed, members and new peers are served."""
    from torchnext.ft.service import MAX_UNAUTHENTICATED

    socks = [socket.create_connection(("127.0.0.1", session.coord.port), timeout=5)
             for _ in range(MAX_UNAUTHENTICATED + 16)]
    try:
        time.sleep(0.3)
        session.healthy()
    finally:
        for s in socks:
            s.close()


# the fuzzer: messages shaped like the protocol's, with hostile field values
_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
_kinds = st.sampled_from([*MEMBER_MESSAGES, "gen", "decision", "x" * 50, ""])
_fields = st.sampled_from(["gen", "step", "term", "member", "group", "group_rank", "group_size", "report", "reason",
                           "done", "nonce", "proof", "proto", "coordinators", "entered", "vote", "groups"])
_messages = st.builds(lambda kind, body: json.dumps({"t": kind, **body}).encode() + b"\n", _kinds,
                      st.dictionaries(_fields, _values, max_size=6))
_raw = st.binary(max_size=512) | st.binary(max_size=64).map(lambda b: b + b"\n") | st.sampled_from([
    b"[" * 5000 + b"\n", b"{" * 100 + b"\n", b'{"t":1}\n', b"null\n", b'"t"\n', b'{"t":"hb","x":NaN}\n',
    b'{"t":"vote","gen":' + b"9" * 5000 + b',"step":0}\n', b"\xff\xfe\n", b"\n" * 100, b" " * (MAX_LINE + 8),
    b'{"t":"hello","nonce":"\\ud800"}\n',
])


@given(payload=st.lists(_messages | _raw, min_size=1, max_size=4), authenticate=st.booleans())
@_FUZZ
def test_fuzz_the_membership_port(session: _Session, payload: list[bytes], authenticate: bool) -> None:
    """Random protocol-shaped and raw lines, before and after authenticating: the service always answers, member 7
    is untouched."""
    s = _authenticated(session.coord) if authenticate else socket.create_connection(
        ("127.0.0.1", session.coord.port), timeout=5)
    with s:
        if not authenticate:
            _read_msgs(s, 1)
        for chunk in payload:
            send_all(s, chunk)
    session.healthy()
