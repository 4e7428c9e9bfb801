"""The member's side of the wire against a scripted coordinator: bytes split where a real network may split them."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from torchnext.ft._wire import PROTOCOL_VERSION, LineReader, decode, encode, mac, new_nonce
from torchnext.ft.member import MemberClient

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0ken"


def _scripted_coordinator(listener: socket.socket, after_welcome: list[bytes], got: list[dict[str, Any]]) -> None:
    """Accept one member, challenge it, welcome it -- the first chunk of ``after_welcome`` in the welcome's own
    send -- then send the other chunks 0.2 s apart and read what the member sends until it hangs up."""
    conn, _ = listener.accept()
    with conn:
        nonce = new_nonce()
        conn.sendall(encode({"t": "challenge", "nonce": nonce, "proto": PROTOCOL_VERSION}))
        reader = LineReader()
        hello: list[dict[str, Any]] = []
        while not hello:
            hello = reader.feed(conn.recv(1 << 16))
        welcome = {"t": "welcome", "proof": mac(TOKEN, "coordinator", hello[0]["nonce"], nonce), "member": 5,
                   "store_port": 1, "proto": PROTOCOL_VERSION, "role": "office", "term": 1,
                   "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "quorum_timeout_s": None,
                   "grow_timeout_s": None}
        conn.sendall(encode(welcome) + after_welcome[0])
        for chunk in after_welcome[1:]:
            time.sleep(0.2)
            conn.sendall(chunk)
        conn.settimeout(5.0)
        try:
            while data := conn.recv(1 << 16):
                got.extend(m for m in reader.feed(data) if m["t"] != "hb")
        except OSError:
            pass


@pytest.mark.parametrize("cut", [1, 9, -1])
def test_a_message_split_right_after_the_welcome_arrives_whole(cut: int) -> None:
    """The start of a message read with the welcome (the same ``recv``) stays with the session: before the fix the
    session began with a fresh reader, read the message's tail as a line of garbage and dropped its coordinator."""
    decision = encode({"t": "decision", "gen": 1, "step": 0, "committed": 1})
    ping = encode({"t": "ping"})
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[dict[str, Any]] = []
    t = threading.Thread(target=_scripted_coordinator, daemon=True,
                         args=(listener, [decision[:cut], decision[cut:] + ping], got))
    t.start()
    lost: list[dict[str, Any]] = []
    host, port = listener.getsockname()
    client = MemberClient(f"{host}:{port}", TOKEN, member_id=None, step=0, connect_timeout_s=5.0,
                          coordinator_timeout_s=5.0, on_interrupt=lost.append)
    try:
        first = client.next_event(5.0)
        assert first is not None and {k: first[k] for k in ("t", "gen", "step", "committed")} == decode(decision), first
        assert client.report()["attempted"] == 0 and lost == []  # no failover: the connection was kept
        assert client.fatal is None and client.failovers == 0
    finally:
        client.close()
        t.join(10)
        listener.close()
    assert got and got[-1] == {"t": "bye", "done": False}, got  # the same session said goodbye


def test_a_member_skips_its_heartbeat_while_other_messages_say_it_is_alive() -> None:
    """Protocol 4: any message counts as a heartbeat. A member voting every 30 ms sends (almost) no ``hb``; silent
    for 0.5 s it sends one every 0.1 s again. Its hello tells its own ``coordinator_timeout_s``."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[tuple[float, str]] = []
    hellos: list[dict[str, Any]] = []

    def coordinator() -> None:
        conn, _ = listener.accept()
        with conn:
            nonce = new_nonce()
            conn.sendall(encode({"t": "challenge", "nonce": nonce, "proto": PROTOCOL_VERSION}))
            reader = LineReader()
            while not hellos:
                hellos.extend(reader.feed(conn.recv(1 << 16)))
            conn.sendall(encode({"t": "welcome", "proof": mac(TOKEN, "coordinator", hellos[0]["nonce"], nonce),
                                 "member": 5, "store_port": 1, "proto": PROTOCOL_VERSION, "role": "office",
                                 "term": 1, "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}))
            conn.settimeout(0.05)
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    conn.sendall(encode({"t": "ping"}))
                    continue
                except OSError:  # the member closed without a goodbye (a reset): the test is over
                    return
                if not data:
                    return
                seen.extend((time.monotonic(), m["t"]) for m in reader.feed(data))

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    host, port = listener.getsockname()
    client = MemberClient(f"{host}:{port}", TOKEN, member_id=None, step=0, connect_timeout_s=5.0,
                          coordinator_timeout_s=2.0, on_interrupt=lambda m: None)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # training: a vote every 30 ms
            client.send({"t": "vote", "gen": 1, "step": 0})
            time.sleep(0.03)
        t1 = time.monotonic()
        time.sleep(0.8)  # idle
        t2 = time.monotonic()
    finally:
        client.close(graceful=False)
        t.join(5)
        listener.close()
    assert hellos[0]["coordinator_timeout_s"] == 2.0
    busy = [k for at, k in seen if t0 + 0.1 < at < t1 and k == "hb"]
    idle = [k for at, k in seen if t1 + 0.2 < at < t2 and k == "hb"]
    assert len(busy) <= 2, busy  # the votes said it
    assert len(idle) >= 4, idle  # every 0.1 s again once nothing else is sent
