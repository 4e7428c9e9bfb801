"""Group sessions (protocol 4) against a live in-process coordinator and standby, over raw sockets: a leader joins
its whole group, its vote commits for the group, a follower's death reported with ``lost`` takes its group out,
a leader naming another group's member is thrown out without touching that group, and a standby takes office from
the leaders' reports (one report and one promise per group)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.ft._wire import COORDINATOR_MESSAGES, PROTOCOL_VERSION, LineReader, check, encode, mac, new_nonce, verify

pytestmark = pytest.mark.timeout(60)


class _Leader:
    """A raw group session: a leader's socket, speaking for ``size`` ranks."""

    def __init__(self, coord: Coordinator, gid: int, size: int, **hello: Any) -> None:
        self.sock = socket.create_connection(("127.0.0.1", coord.port), timeout=5)
        self.reader = LineReader(1 << 24)
        self.inbox: list[dict[str, Any]] = []
        self.pings = 0
        challenge = self.read(lambda m: m["t"] == "challenge")
        mine = new_nonce()
        msg = {"t": "hello", "nonce": mine, "proof": mac(coord.token, "member", challenge["nonce"], mine),
               "proto": PROTOCOL_VERSION, "step": 0, "group": gid, "group_rank": 0, "group_size": size,
               "followers": [{"step": 0} for _ in range(size - 1)], **hello}
        self.send(msg)
        self.welcome = self.read(lambda m: m["t"] in ("welcome", "reject"))
        if self.welcome["t"] == "welcome":
            assert verify(coord.token, "coordinator", mine, challenge["nonce"], self.welcome["proof"])

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def read(self, want: Any, timeout: float = 5.0) -> dict[str, Any]:
        """The first message (kept or arriving) for which ``want`` holds; the others stay in ``inbox``."""
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.inbox):
                if want(m):
                    return self.inbox.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no such message; got {[m['t'] for m in self.inbox]}")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"closed; got {[m['t'] for m in self.inbox]}")
            got = self.reader.feed(data)
            self.pings += sum(1 for m in got if m["t"] == "ping")
            self.inbox += [check(m, COORDINATOR_MESSAGES) for m in got if m["t"] != "ping"]

    def closed(self, timeout: float = 5.0) -> bool:
        try:
            self.read(lambda m: False, timeout)
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=2, settle_s=0.0,
                                                                   grow_timeout_s=30.0))) as c:
        yield c


def _two_groups(coord: Coordinator) -> tuple[_Leader, _Leader]:
    a, b = _Leader(coord, 0, 4), _Leader(coord, 1, 4)
    assert a.welcome["t"] == "welcome" and b.welcome["t"] == "welcome", (a.welcome, b.welcome)
    return a, b


def test_a_leader_joins_votes_and_hears_for_its_group(coord: Coordinator) -> None:
    a, b = _two_groups(coord)
    try:
        assert a.welcome["members"] == [0, 1, 2, 3] and b.welcome["members"] == [4, 5, 6, 7]
        assert a.welcome["group_heartbeat_timeout_s"] == 0.6
        gen = a.read(lambda m: m["t"] == "gen")
        assert gen["gen"] == 1 and gen["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        b.read(lambda m: m["t"] == "gen")
        for step in range(3):
            a.send({"t": "vote", "gen": 1, "step": step})
            b.send({"t": "vote", "gen": 1, "step": step})
            for leader in (a, b):
                assert leader.read(lambda m: m["t"] == "decision")["committed"] == step + 1
        assert coord.step == 3
        assert not [m for m in a.inbox + b.inbox if m["t"] == "decision"]  # one decision per group and step
    finally:
        a.close()
        b.close()


def test_a_follower_lost_by_its_leader_takes_its_group_out(coord: Coordinator) -> None:
    a, b = _two_groups(coord)
    try:
        b.send({"t": "lost", "member": 6, "hung": False, "reason": "local channel closed"})
        removed = b.read(lambda m: m["t"] == "removed")
        assert "replica group 1 lost member 6" in removed["reason"] and "local channel closed" in removed["reason"]
        gen = a.read(lambda m: m["t"] == "gen" and m["gen"] == 2)
        assert gen["members"] == [0, 1, 2, 3] and gen["abort"]
        assert coord.members == (0, 1, 2, 3)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("msg", [{"t": "lost", "member": 1, "hung": True},     # another group's member
                                 {"t": "lost", "member": 4, "hung": True},     # itself: not a follower
                                 {"t": "fail", "gen": 1, "member": 2, "reason": "x"}])
def test_a_leader_cannot_touch_another_group(coord: Coordinator, msg: dict[str, Any]) -> None:
    a, b = _two_groups(coord)
    try:
        b.send(msg)
        assert b.closed(), "a leader naming a member outside its group must lose its session"
        gen = a.read(lambda m: m["t"] == "gen" and m["gen"] == 2)  # its group failed; group 0 is untouched
        assert gen["members"] == [0, 1, 2, 3]
        assert not [m for m in a.inbox if m["t"] in ("removed", "fatal")]
    finally:
        a.close()
        b.close()


def test_a_flat_member_cannot_report_a_loss(coord: Coordinator) -> None:
    """Group 1's ranks connect themselves (flat, as protocol 3 did) beside group 0's session: a `lost` from one of
    them is a violation (it speaks for nobody else); its group fails, group 0 goes on."""
    a = _Leader(coord, 0, 4)
    flat = [_Leader(coord, 1, 4, followers=[], group_rank=r) for r in range(4)]
    try:
        assert all(f.welcome["t"] == "welcome" and f.welcome["members"] is None for f in flat)
        assert a.read(lambda m: m["t"] == "gen")["members"] == [0, 1, 2, 3, 4, 5, 6, 7]
        flat[0].send({"t": "lost", "member": 5, "hung": False})
        assert flat[0].closed()
        assert a.read(lambda m: m["t"] == "gen" and m["gen"] == 2)["members"] == [0, 1, 2, 3]
    finally:
        a.close()
        for f in flat:
            f.close()


@pytest.mark.parametrize(("hello", "why"), [({"group_rank": 1}, "led by rank 0"), ({"group_size": 3}, "led by rank 0"),
                                            ({"group": None}, "led by rank 0")])
def test_malformed_group_sessions_are_refused(coord: Coordinator, hello: dict[str, Any], why: str) -> None:
    bad = _Leader(coord, 0, 4, **hello)
    try:
        assert bad.welcome["t"] == "reject" and bad.welcome["code"] == "bad_request"
        assert why in bad.welcome["reason"]
        assert coord.members == ()
    finally:
        bad.close()


def test_a_standby_takes_office_from_the_leaders_reports() -> None:
    """Two groups of 3 lost their coordinator after committing step 5 in generation 2: each leader reports once
    for its group and promises once; the standby takes office with all six ranks in their groups."""
    token = "group-session-token"
    entered = {"gen": 2, "term": 1, "groups": [[0, 1, 2], [3, 4, 5]], "step": 4, "joiners": []}
    report = {"term": 1, "step": 5, "synced": True, "attempted": 2, "entered": entered}
    with Coordinator(CoordinatorConfig(token=token, standby=True,
                                       membership=MembershipConfig(min_size=1, settle_s=0.0))) as standby:
        leaders = [_Leader(standby, g, 3, member=3 * g, followers=[{"member": 3 * g + r, "step": 5} for r in (1, 2)],
                           report=report, coordinators=2, step=5) for g in (0, 1)]
        try:
            for leader in leaders:
                assert leader.welcome["t"] == "welcome" and leader.welcome["role"] == "standby"
            for leader in leaders:
                prepare = leader.read(lambda m: m["t"] == "prepare")
                assert prepare["term"] == 2
                leader.send({"t": "promise", "term": 2})
            for leader in leaders:
                gen = leader.read(lambda m: m["t"] == "gen")
                assert gen["term"] == 2 and gen["gen"] == 3 and gen["abort"] and gen["step"] == 5
                assert gen["groups"] == [[0, 1, 2], [3, 4, 5]] and gen["joiners"] == []
                assert not [m for m in leader.inbox if m["t"] == "gen"]  # once per group
            assert standby.in_office and standby.members == (0, 1, 2, 3, 4, 5)
            for leader in leaders:  # the new term commits with one vote per group
                leader.send({"t": "vote", "gen": 3, "step": 5})
            assert leaders[0].read(lambda m: m["t"] == "decision")["committed"] == 6
        finally:
            for leader in leaders:
                leader.close()


def test_pings_are_paced_by_the_members_own_timeout(coord: Coordinator) -> None:
    """A hello with ``coordinator_timeout_s`` = 2 s is pinged every 0.5 s (a quarter of it), one without every
    heartbeat interval (0.1 s); both heartbeat, so both stay members."""
    paced = _Leader(coord, 0, 4, coordinator_timeout_s=2.0)
    eager = _Leader(coord, 1, 4)
    try:
        for leader in (paced, eager):
            leader.read(lambda m: m["t"] == "gen")
            leader.pings = 0
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            for leader in (paced, eager):
                leader.send({"t": "hb"})
                try:
                    leader.read(lambda m: False, 0.05)
                except TimeoutError:
                    pass
        assert 1 <= paced.pings <= 4, paced.pings
        assert eager.pings >= 9, eager.pings
        assert coord.members == (0, 1, 2, 3, 4, 5, 6, 7)
    finally:
        paced.close()
        eager.close()
