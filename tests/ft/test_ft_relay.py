"""Vote relays (protocol 5, issue 26): a second aggregation level for the per-step vote and decision.

Unit level: a relay's chunk forwards one vote only when every connected session of it voted the same (gen, step)
(:class:`~torchnext.ft.relay.RelayChunk`); the coordinator's state machine names relays only above
``relay_min_groups``, commits only when every session is covered, routes decisions through the relays and sends the
last relayed decision directly before a new generation. Process level: the member simulator against the real
coordinator (relays on and off, a relay killed), and a real leader's relay listener (:class:`RelayHub`) refusing
unauthenticated and malformed connections.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import Any

import pytest

from torchnext.ft import Coordinator, CoordinatorConfig
from torchnext.ft._wire import PROTOCOL_VERSION, LineReader, ProtocolError, encode, mac, new_nonce
from torchnext.ft.membership import Membership, MembershipConfig
from torchnext.ft.relay import RelayChunk, SessionHandshake, answer_hello, relay_challenge, relay_hello
from torchnext.ft.relay_link import RelayHub
from torchnext.testing.member_sim import KillMode, MemberSim, SimConfig

pytestmark = pytest.mark.timeout(120)

TOKEN = "relay-test-token"


# ------------------------------------------------------------------------------------------------ RelayChunk
def test_a_chunk_votes_only_when_all_its_sessions_voted_the_same_step() -> None:
    c = RelayChunk(3, 10, [10, 11, 12])
    assert c.connect(11) and c.connect(12) and not c.connect(99)
    assert c.vote(10, 3, 5) is None
    assert c.vote(11, 3, 5) is None
    assert c.vote(12, 3, 4) is None  # another step: not the same vote
    assert c.vote(12, 2, 5) is None  # another generation: ignored
    assert c.vote(12, 3, 5) == {"t": "vote", "gen": 3, "step": 5, "chunk": True}
    assert c.vote(12, 3, 5) is None  # forwarded once
    for h in (10, 11):
        assert c.vote(h, 3, 6) is None
    assert c.vote(12, 3, 6) == {"t": "vote", "gen": 3, "step": 6, "chunk": True}


def test_a_chunk_does_not_wait_for_a_session_without_a_channel() -> None:
    c = RelayChunk(1, 0, [0, 1, 2])
    c.connect(1)
    c.connect(2)
    assert c.vote(0, 1, 0) is None
    assert c.vote(1, 1, 0) is None
    assert c.disconnect(2) == {"t": "vote", "gen": 1, "step": 0, "heads": [0, 1]}  # 2 votes directly
    assert c.vote(2, 1, 0) is None  # not connected: its vote is not the relay's to give
    c.connect(2)
    assert c.vote(2, 1, 0) == {"t": "vote", "gen": 1, "step": 0, "heads": [2]}  # late, forwarded alone
    with pytest.raises(ValueError):
        RelayChunk(1, 5, [0, 1])


def test_the_relay_handshake_without_sockets_proves_the_token_both_ways() -> None:
    challenge = new_nonce()
    shake = SessionHandshake(TOKEN, member=4, gen=2, relay=7)
    hello = shake.feed(relay_challenge(challenge))
    assert hello is not None and hello["member"] == 4 and hello["gen"] == 2
    welcome, member = answer_hello(TOKEN, challenge, 7, hello)
    assert member == 4 and welcome["t"] == "welcome"
    assert shake.feed(welcome) is None and shake.done
    reject, member = answer_hello("wrong-token", challenge, 7, hello)  # the relay side refuses a wrong proof
    assert member is None and reject == {"t": "reject", "code": "auth", "reason": "wrong job token"}
    other = SessionHandshake(TOKEN, member=4, gen=2, relay=8)  # the listener is relay 7's, not 8's
    hello = other.feed(relay_challenge(challenge))
    assert hello is not None
    with pytest.raises(ProtocolError, match="not relay 8's"):
        other.feed(answer_hello(TOKEN, challenge, 7, hello)[0])
    for bad in ({"t": "reject", "code": "auth", "reason": ""}, {"t": "decision"}, welcome):  # refused, out of order
        with pytest.raises(ProtocolError):
            SessionHandshake(TOKEN, member=4, gen=2, relay=7).feed(bad)
    forged = SessionHandshake(TOKEN, member=4, gen=2, relay=7)
    hello = forged.feed(relay_challenge(challenge))
    assert hello is not None
    with pytest.raises(ProtocolError, match="prove"):
        forged.feed(answer_hello("wrong-token", challenge, 7, dict(hello, proof=mac("wrong-token", "member",
                                                                                     challenge, hello["nonce"])))[0])


# ------------------------------------------------------------------------------------------------ Membership
def _membership(groups: int, *, relay: bool = True, min_groups: int = 4, fanout: int | None = None
                ) -> tuple[Membership, list[int]]:
    st = Membership(MembershipConfig(initial_size=groups, relay_min_groups=min_groups, relay_fanout=fanout))
    heads = []
    for g in range(groups):
        ids = st.join_group(None, 0, [(None, 0)], 0.0, group=g, relay_at=f"127.0.0.1:{7000 + g}" if relay else None)
        heads.append(ids[0])
    return st, heads


def _sent(st: Membership, kind: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for mid, msg in st.outbox:
        if msg["t"] == kind:
            out.setdefault(mid, []).append(msg)
    return out


def test_relays_are_named_above_the_threshold_only() -> None:
    st, heads = _membership(16, fanout=4)
    relays = _sent(st, "relay")
    assert st.gen == 1 and set(relays) == set(heads)
    assert len(st.chunks) == 4
    big, _ = _membership(2 * 4096, min_groups=64)  # the default fanout: ceil(sqrt(sessions)), at least 64
    assert len(big.chunks) == math.ceil(8192 / (math.isqrt(8191) + 1)) and max(map(len, big.chunks.values())) == 91
    mid, _ = _membership(200, min_groups=64)
    assert sorted(map(len, mid.chunks.values())) == [8, 64, 64, 64]
    for relay, chunk in st.chunks.items():
        assert relay == chunk[st.gen % len(chunk)] and relay in chunk
        for h in chunk:
            assert relays[h] == [{"t": "relay", "gen": 1, "relay": relay, "at": st.live[relay].relay_at,
                                  "chunk": list(chunk)}]
    small, _ = _membership(3)
    assert not small.chunks and not _sent(small, "relay")
    flat, _ = _membership(16, relay=False)  # no session offers a listener: today's path
    assert not flat.chunks


def test_a_step_commits_only_when_every_chunk_voted() -> None:
    st, heads = _membership(9, fanout=3)
    st.outbox.clear()
    relays = sorted(st.chunks)
    assert len(relays) == 3
    for r in relays[:-1]:
        st.vote(r, st.gen, 0, 1.0, chunk=True)
    assert st.step == 0 and not _sent(st, "decision")
    last = relays[-1]
    partial = [h for h in st.chunks[last] if h != last][:1]
    st.vote(last, st.gen, 0, 1.0, heads=[*partial, heads[0] if heads[0] not in st.chunks[last] else -1])
    assert st.step == 0  # a head of another chunk named in the batch does not count
    others = [h for h in st.chunks[last] if h not in partial]
    for h in others:
        st.vote(h, st.gen, 0, 1.0)  # directly (no channel to their relay)
    assert st.step == 1
    got = _sent(st, "decision")
    direct = {h for h in others if h not in st.chunks}
    assert set(got) == set(relays) | direct  # the relays fan it out; direct voters get it themselves
    assert st.relayed is not None and st.relayed["step"] == 0


def test_a_relayed_decision_goes_directly_before_a_new_generation() -> None:
    st, heads = _membership(9, fanout=3)
    for r in sorted(st.chunks):
        st.vote(r, st.gen, 0, 1.0, chunk=True)
    assert st.step == 1
    st.outbox.clear()
    old_relays = set(st.chunks)
    relay = sorted(st.chunks)[0]
    st.failure(relay, 1.1, "crashed", hung=False)
    st.tick(1.2)
    order = [(mid, msg["t"]) for mid, msg in st.outbox if msg["t"] in ("decision", "gen")]
    members = [h for h in heads if h not in old_relays and h in st.live]
    for h in members:
        kinds = [k for mid, k in order if mid == h]
        assert kinds[:2] == ["decision", "gen"], (h, kinds)
    assert st.gen == 2 and st.step == 1
    assert relay not in st.chunk_of and all(st.chunk_of[h] in st.chunks for h in st.chunk_of)


def test_a_direct_vote_for_the_step_just_relayed_gets_its_decision_again() -> None:
    st, heads = _membership(9, fanout=3)
    for r in sorted(st.chunks):
        st.vote(r, st.gen, 0, 1.0, chunk=True)
    st.outbox.clear()
    member = next(h for h in heads if h not in st.chunks)
    st.vote(member, st.gen, 0, 1.1)  # its relay channel closed after it voted through it
    assert st.outbox == [(member, st.relayed)]
    assert st.fatal is None


def test_a_relay_vote_vouches_for_its_chunk() -> None:
    """Its sessions count as heard at the vouch (applied when they would expire): alive within the timeout of it,
    expired after; a vouch within the last heartbeat interval counts as heard at the check."""
    st, _ = _membership(9, fanout=3)
    relay, other = sorted(st.chunks)[:2]
    chunk, others = st.chunks[relay], st.chunks[other]
    for r in sorted(st.chunks):
        st.vote(r, st.gen, 0, 0.0, chunk=True)  # step 0 commits (every group then holds the state)
    st.vote(relay, st.gen, 1, 5.0, chunk=True)
    st.vote(other, st.gen, 1, 5.45, chunk=True)
    st.tick(5.5)  # every session was last heard at 0.0: the vouched ones live on
    assert all(st.live[h].last_seen == 5.0 for h in chunk)  # 0.5 s ago: heard then
    assert all(st.live[h].last_seen == 5.5 for h in others)  # within an interval: heard now
    assert all(h not in st.live for h in st.chunk_of if st.chunk_of[h] not in (relay, other))  # never vouched
    st.tick(5.0 + 0.6 + 0.01)  # the timeout after its last vouch: its chunk is silent
    assert all(h not in st.live for h in chunk)
    assert all(h in st.live for h in others)


def test_a_chunk_vote_from_a_session_that_is_not_a_relay_counts_as_its_own() -> None:
    st, heads = _membership(9, fanout=3)
    member = next(h for h in heads if h not in st.chunks)
    st.vote(member, st.gen, 0, 1.0, chunk=True)
    assert st.votes == {member}


def test_a_generation_keeps_the_chunks_it_can_and_a_report_rotates_the_relays() -> None:
    st, heads = _membership(16, fanout=4)
    for r in sorted(st.chunks):
        st.vote(r, st.gen, 0, 0.05, chunk=True)  # a commit: every group holds the state
    layout = dict(st.chunks)
    victim = next(h for h in heads if h not in layout)  # not a relay
    st.failure(victim, 0.1, "crashed", hung=False)
    st.tick(0.11)
    assert st.gen == 2
    for relay, chunk in layout.items():
        if victim in chunk:
            assert st.chunks[relay] == tuple(h for h in chunk if h != victim)
        else:
            assert st.chunks[relay] == chunk  # the same relay, the same sessions: their channels go on
    dead_relay = sorted(st.chunks)[0]
    st.failure(dead_relay, 0.2, "crashed", hung=False)
    st.tick(0.21)
    assert dead_relay not in st.chunks and len(st.chunks) == len(layout)  # its chunk got another relay
    before = dict(st.chunks)
    st.report_failure(next(iter(st.chunks)), st.gen, "no commit decision within 30s", 0.3)
    st.tick(0.31)
    assert st.gen == 4 and set(st.chunks) != set(before)  # a held step: every chunk is cut and named afresh


# ------------------------------------------------------------------------------------------------ simulator
def _relay_groups(coord: Coordinator, ids: dict[int, list[int]]) -> list[int]:
    """The replica groups whose leaders are relays now."""
    assert coord._service is not None and coord._service.state is not None
    with coord._service.lock:
        relays = set(coord._service.state.chunks)
    return sorted(g for g, v in ids.items() if v[0] in relays)


@pytest.mark.parametrize("relays", [True, False])
def test_sim_commits_through_relays_and_a_killed_relay_is_replaced(relays: bool) -> None:
    groups, fanout = 16, 4
    config = MembershipConfig(initial_size=groups, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6,
                              relay_min_groups=8, relay_fanout=fanout)
    with Coordinator(CoordinatorConfig(membership=config)) as coord, \
            MemberSim(SimConfig(address=coord.address, token=coord.token, ranks=groups * 2, group_size=2,
                                relays=relays)) as sim:
        formed = sim.join(timeout_s=30)
        assert formed.ok, formed.reason
        time.sleep(0.3)  # the sessions connect to their relays
        run = sim.commit(20, timeout_s=30)
        assert run.ok and run.committed == 20, run.reason
        per_step = run.messages / 20
        if not relays:
            assert run.relay_messages == 0 and per_step >= 2 * groups
            return
        # one vote and one decision per chunk and step (plus the odd ping or heartbeat), not per group
        assert per_step < groups, per_step
        assert run.relay_messages > 0
        relay_group = _relay_groups(coord, sim.ids)[0]
        t = sim.kill_group(relay_group, KillMode.CRASH)
        nxt = sim.await_generation(formed.gen, timeout_s=10)
        assert nxt.ok, nxt.reason
        assert set(nxt.members) == set(formed.members) - set(sim.ids[relay_group])
        assert nxt.received_at is not None and nxt.received_at - t < 0.6 + 0.2
        time.sleep(0.3)
        again = sim.commit(10, timeout_s=30)
        assert again.ok and again.committed == 10, again.reason
        assert again.messages / 10 < groups
        # and a hung relay: its silence removes its group; the others go on with new relays
        relay_group = _relay_groups(coord, sim.ids)[-1]
        sim.kill_group(relay_group, KillMode.HANG)
        third = sim.await_generation(nxt.gen, timeout_s=10)
        assert third.ok, third.reason
        assert set(sim.ids[relay_group]).isdisjoint(third.members)
        time.sleep(0.3)
        last = sim.commit(5, timeout_s=30)
        assert last.ok and last.committed == 5, last.reason


def test_sim_a_dead_relay_channel_costs_two_heartbeat_timeouts_not_the_step() -> None:
    """A session's channel to its relay goes dead both ways with its sockets open (``KillMode.CUT_RELAY``: a
    partition between two leaders; both still reach the coordinator): the session hears no ping while its vote
    waits and votes directly, the relay hears no answer to its pings and stops waiting for it -- the step commits
    two heartbeat timeouts late, nobody is removed, and the next steps commit at speed."""
    groups = 16
    config = MembershipConfig(initial_size=groups, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6,
                              relay_min_groups=8, relay_fanout=4)
    with Coordinator(CoordinatorConfig(membership=config)) as coord, \
            MemberSim(SimConfig(address=coord.address, token=coord.token, ranks=groups * 2, group_size=2,
                                relays=True)) as sim:
        formed = sim.join(timeout_s=30)
        assert formed.ok, formed.reason
        time.sleep(0.3)  # the sessions connect to their relays
        warm = sim.commit(3, timeout_s=30)
        assert warm.ok and warm.committed == 3, warm.reason
        relays = _relay_groups(coord, sim.ids)
        victim = next(g for g in range(groups) if g not in relays)
        sim.kill_group(victim, KillMode.CUT_RELAY)
        run = sim.commit(5, timeout_s=10)  # without liveness: no decision ever (the sim has no commit timeout)
        assert run.ok and run.committed == 5, run.reason
        first = run.rounds_s[0]
        assert 1.2 <= first < 1.2 + 0.1 + 1.0, run.rounds_s  # 2 x the timeout (+ one check interval, + load)
        assert max(run.rounds_s[1:]) < 0.5, run.rounds_s
        assert coord.generation == formed.gen  # nobody was removed
        with pytest.raises(ValueError):
            sim.kill_rank(victim, 1, KillMode.CUT_RELAY)


# ------------------------------------------------------------------------------------------------ RelayHub
class _Up:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.delivered: list[dict[str, Any]] = []
        self.cv = threading.Condition()

    def send(self, msg: dict[str, Any]) -> None:
        with self.cv:
            self.sent.append(msg)
            self.cv.notify_all()

    def deliver(self, msg: dict[str, Any]) -> None:
        with self.cv:
            self.delivered.append(msg)
            self.cv.notify_all()

    def wait(self, what: str, n: int = 1, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(getattr(self, what)) >= n, timeout), getattr(self, what)
            return list(getattr(self, what))


def _raw(address: str) -> tuple[socket.socket, LineReader, dict[str, Any]]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    reader = LineReader()
    msgs: list[dict[str, Any]] = []
    while not msgs:
        msgs = reader.feed(sock.recv(4096))
    return sock, reader, msgs[0]


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(5)
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def test_relay_hub_forwards_votes_and_fans_out_decisions() -> None:
    up_r, up_s = _Up(), _Up()
    relay = RelayHub("127.0.0.1", TOKEN, send_up=up_r.send, deliver=up_r.deliver, name="r")
    session = RelayHub("127.0.0.1", TOKEN, send_up=up_s.send, deliver=up_s.deliver, name="s")
    try:
        relay.member, session.member = 0, 1
        named = {"t": "relay", "gen": 1, "relay": 0, "at": relay.address, "chunk": [0, 1]}
        relay.named(named, 1)
        session.named(named, 1)
        deadline = time.monotonic() + 5
        while session._link is None and time.monotonic() < deadline:  # the test waits for the channel
            time.sleep(0.01)
        assert session.vote(1, 0)  # through the channel
        assert relay.vote(1, 0)
        assert up_r.wait("sent") == [{"t": "vote", "gen": 1, "step": 0, "chunk": True}]
        relay.decided({"t": "decision", "gen": 1, "step": 0, "committed": 1, "next": None})
        assert up_s.wait("delivered")[0]["step"] == 0
        assert not up_s.sent  # nothing went to its coordinator
        assert not session.vote(2, 1)  # a generation it holds no channel for: directly
        # a listener that is another session's (it proves the token but names itself): no channel, direct votes
        session.named({"t": "relay", "gen": 3, "relay": 7, "at": relay.address, "chunk": [1, 7]}, 3)
        time.sleep(0.5)
        assert session._link is None and not session.vote(3, 0)
    finally:
        session.stop()
        relay.stop()


def test_relay_hub_refuses_unauthenticated_and_malformed_connections() -> None:
    up = _Up()
    relay = RelayHub("127.0.0.1", TOKEN, send_up=up.send, deliver=up.deliver, name="r")
    try:
        relay.member = 0
        relay.named({"t": "relay", "gen": 1, "relay": 0, "at": relay.address, "chunk": [0, 1]}, 1)
        # a wrong token: refused, and its vote never counts
        sock, _, challenge = _raw(relay.address)
        assert challenge["t"] == "challenge" and challenge["proto"] == PROTOCOL_VERSION
        sock.sendall(encode(relay_hello("wrong-token", challenge["nonce"], new_nonce(), 1, 1)))
        sock.sendall(encode({"t": "vote", "gen": 1, "step": 0}))
        assert b'"code":"auth"' in _read_until_closed(sock)
        sock.close()
        # garbage, a vote before the hello, a nested bomb, an over-long line: each closes that connection
        for junk in (b"\xff\xfe not json\n", encode({"t": "vote", "gen": 1, "step": 0}), b"[" * 100_000 + b"\n",
                     b"x" * (1 << 17)):
            sock, _, _ = _raw(relay.address)
            try:
                sock.sendall(junk)
            except OSError:
                pass
            try:
                _read_until_closed(sock)
            except OSError:
                pass
            sock.close()
        # a proof of the right token for another challenge (replay): refused
        sock, _, challenge = _raw(relay.address)
        mine = new_nonce()
        sock.sendall(encode({"t": "hello", "nonce": mine, "proof": mac(TOKEN, "member", "other", mine),
                             "proto": PROTOCOL_VERSION, "member": 1, "gen": 1}))
        assert b'"code":"auth"' in _read_until_closed(sock)
        sock.close()
        # the hub still serves: the relay's own vote waits for nobody unauthenticated (session 1 never connected)
        assert relay.vote(1, 0)
        assert up.wait("sent") == [{"t": "vote", "gen": 1, "step": 0, "heads": [0]}]
        # and an honest session is still admitted
        sock, _, challenge = _raw(relay.address)
        nonce = new_nonce()
        sock.sendall(encode(relay_hello(TOKEN, challenge["nonce"], nonce, 1, 1)))
        reader = LineReader()
        msgs: list[dict[str, Any]] = []
        sock.settimeout(5)
        while not msgs:
            msgs = reader.feed(sock.recv(4096))
        assert msgs[0]["t"] == "welcome" and msgs[0]["relay"] == 0
        sock.sendall(encode({"t": "vote", "gen": 1, "step": 0}))
        assert up.wait("sent", 2)[1] == {"t": "vote", "gen": 1, "step": 0, "heads": [1]}
        sock.close()
    finally:
        relay.stop()


def _stop_thread(hub: RelayHub) -> None:
    """The hub's thread stops (a hung relay: its sockets stay open, nothing reads or answers them)."""
    hub._stop.set()
    hub._wake()
    hub._thread.join(timeout=5)
    assert not hub._thread.is_alive()


def test_a_session_votes_directly_when_its_relay_hangs_but_not_while_the_relay_pings() -> None:
    up_r, up_s = _Up(), _Up()
    relay = RelayHub("127.0.0.1", TOKEN, send_up=up_r.send, deliver=up_r.deliver, name="r")
    session = RelayHub("127.0.0.1", TOKEN, send_up=up_s.send, deliver=up_s.deliver, name="s")
    try:
        relay.member, session.member = 0, 1
        for hub in (relay, session):
            hub.liveness(0.05, 0.3)
            hub.named({"t": "relay", "gen": 1, "relay": 0, "at": relay.address, "chunk": [0, 1]}, 1)
        deadline = time.monotonic() + 5
        while session._link is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.vote(1, 0)
        time.sleep(0.9)  # three timeouts: the relay (a straggler itself) pings the session it holds a vote of
        assert not up_s.sent and session._link is not None
        assert relay.vote(1, 0)
        assert up_r.wait("sent") == [{"t": "vote", "gen": 1, "step": 0, "chunk": True}]
        relay.decided({"t": "decision", "gen": 1, "step": 0, "committed": 1, "next": None})
        assert up_s.wait("delivered")[0]["step"] == 0
        _stop_thread(relay)  # the relay hangs with its channel open
        t0 = time.monotonic()
        assert session.vote(1, 1)  # through the channel: nobody reads it
        assert up_s.wait("sent") == [{"t": "vote", "gen": 1, "step": 1}]  # directly, within its timeout
        assert 0.3 <= time.monotonic() - t0 < 0.3 + 0.5
        assert session._link is None and not session.vote(1, 2)  # and directly from now on
    finally:
        session.stop()
        relay.stop()


def test_a_relay_stops_waiting_for_a_session_silent_in_an_open_round() -> None:
    up = _Up()
    relay = RelayHub("127.0.0.1", TOKEN, send_up=up.send, deliver=up.deliver, name="r")
    try:
        relay.member = 0
        relay.liveness(0.05, 0.3)
        relay.named({"t": "relay", "gen": 1, "relay": 0, "at": relay.address, "chunk": [0, 1]}, 1)
        sock, reader, challenge = _raw(relay.address)
        sock.sendall(encode(relay_hello(TOKEN, challenge["nonce"], new_nonce(), 1, 1)))
        sock.settimeout(5)
        msgs: list[dict[str, Any]] = []
        while not msgs:
            msgs = reader.feed(sock.recv(4096))
        assert msgs[0]["t"] == "welcome"
        assert relay.vote(1, 0)  # the relay's own vote: it waits for session 1 (a straggler that answers pings)
        pings, end = 0, time.monotonic() + 0.9
        sock.settimeout(0.1)
        while time.monotonic() < end:
            try:
                got = reader.feed(sock.recv(4096))
            except TimeoutError:
                continue
            pings += sum(m["t"] == "ping" for m in got)
            sock.sendall(encode({"t": "hb"}) * len(got))
        assert pings >= 3 and not up.sent  # alive: still waited for
        t0 = time.monotonic()  # now it stops answering (a hung session, its socket open)
        assert up.wait("sent") == [{"t": "vote", "gen": 1, "step": 0, "heads": [0]}]
        assert time.monotonic() - t0 < 0.3 + 0.5
        sock.close()
    finally:
        relay.stop()
