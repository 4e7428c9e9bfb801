"""Group sessions (protocol 4, issue 26) in the coordinator's decision logic (no sockets): a replica group's leader
joins, heartbeats and votes for its group; a follower's death is reported by its leader; the coordinator's messages
go once per session. The reference is the flat protocol: the same events must give the same generations and
commits (``test_group_sessions_decide_as_flat_members_under_random_events``)."""

from __future__ import annotations

import random

import pytest

from torchnext.ft import FaultTolerantConfig
from torchnext.ft._wire import (
    COORDINATOR_MESSAGES,
    MEMBER_MESSAGES,
    ProtocolError,
    apply_delta,
    check,
    decode,
    encode,
)
from torchnext.ft.membership import Membership, MembershipConfig, Rejected


def _mk(**kw: object) -> Membership:
    kw.setdefault("heartbeat_interval_s", 1.0)
    kw.setdefault("heartbeat_timeout_s", 100.0)
    kw.setdefault("settle_s", 0.0)
    return Membership(MembershipConfig(**kw))  # type: ignore[arg-type]


def _received(msg: dict, base: int, base_groups: list[list[int]]) -> dict:
    """``msg`` as a member receives it: encoded, decoded, checked and, if a delta, applied to what it holds."""
    got = check(decode(encode(msg)[:-1]), COORDINATOR_MESSAGES)
    return apply_delta(got, base, base_groups)


def _sessions(groups: int, size: int, **kw: object) -> tuple[Membership, list[list[int]]]:
    """``groups`` group sessions of ``size`` ranks, formed; returns the state and the ids by group and rank."""
    m = _mk(initial_size=groups, **kw)
    ids = [m.join_group(None, 0, [(None, 0)] * (size - 1), 0.0, group=g) for g in range(groups)]
    return m, ids


def test_a_group_session_forms_with_one_message_per_group() -> None:
    m, ids = _sessions(3, 4)
    assert m.gen == 1 and len(m.members) == 12
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert m.heads == (0, 4, 8)
    gens = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "gen"]
    assert [mid for mid, _ in gens] == [0, 4, 8]  # to the leaders only, the same message
    assert gens[0][1]["groups"] == ids and gens[0][1]["donors"] == ids[0]
    assert m.session_of(5) == 4 and m.session_of(4) == 4 and m.session_of(99) is None


def test_a_leaders_vote_stands_for_its_group_and_a_follower_cannot_vote() -> None:
    m, _ids = _sessions(2, 4)
    m.outbox.clear()
    m.vote(1, 1, 0, 0.1)  # a follower's id: ignored (a leader votes for the group)
    m.vote(0, 1, 0, 0.1)
    assert m.step == 0 and m.votes == {0}
    m.vote(4, 1, 0, 0.2)
    assert m.step == 1
    decisions = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "decision"]
    assert [mid for mid, _ in decisions] == [0, 4] and decisions[0][1]["committed"] == 1


def test_followers_are_never_expired_by_silence_only_their_leader() -> None:
    m, _ids = _sessions(2, 3, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    for t in (0.3, 0.6, 0.9):  # leaders heartbeat; followers never do (their leader watches them)
        m.heartbeat(0, t)
        m.heartbeat(3, t)
        m.tick(t)
    assert m.gen == 1 and len(m.live) == 6
    m.heartbeat(0, 1.2)  # leader 3 falls silent: a group failure, detected as today
    m.tick(1.6)
    assert 3 not in m.live and 4 not in m.live and 5 not in m.live
    fenced = dict(m.to_fence)
    assert fenced[3]["t"] == "removed" and "missed heartbeats" in fenced[3]["reason"]
    assert "replica group 1 lost member 3" in fenced[4]["reason"]
    m.tick(1.6)
    assert m.gen == 2 and m.members == (0, 1, 2) and m.heads == (0,)


@pytest.mark.parametrize("hung", [False, True])
def test_a_follower_lost_by_its_leader_takes_the_group_out(hung: bool) -> None:
    m, ids = _sessions(3, 4)
    m.outbox.clear()
    m.failure(6, 1.0, "lost by its leader 4: local channel closed", hung=hung)
    assert not any(x in m.live for x in ids[1])
    assert "replica group 1 lost member 6" in dict(m.to_fence)[4]["reason"]
    m.tick(1.0)
    gens = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "gen"]
    assert m.gen == 2 and [mid for mid, _ in gens] == [0, 8]
    assert gens[0][1]["base"] == 1 and gens[0][1]["drop"] == ids[1]  # a delta: the leaders hold generation 1
    full = _received(gens[0][1], 1, ids)
    assert full["groups"] == [ids[0], ids[2]] and full["abort"] and full["members"] == ids[0] + ids[2]
    for leader in (0, 8):
        m.vote(leader, 2, 0, 1.1)
    assert m.step == 1  # the survivors commit in the new generation


def test_a_group_joins_whole_or_not_at_all() -> None:
    m, _ids = _sessions(1, 2)
    before = dict(m.live)
    with pytest.raises(Rejected, match="twice"):
        m.join_group(50, 0, [(50, 0)], 1.0, group=7)
    with pytest.raises(Rejected, match="already connected"):
        m.join_group(60, 0, [(1, 0)], 1.0, group=7)  # a follower asks for a live id
    with pytest.raises(Rejected, match="already connected"):
        m.join_group(None, 0, [(None, 0)], 1.0, group=0)  # group 0's ranks are taken
    with pytest.raises(Rejected, match="same shard count"):
        m.join_group(None, 0, [(None, 0), (None, 0)], 1.0, group=9)  # 3 ranks where groups have 2
    with pytest.raises(Rejected, match="replica group id"):
        m.join_group(None, 0, [(None, 0)], 1.0, group=-1)
    with pytest.raises(Rejected, match="step"):
        m.join_group(None, 0, [(None, -1)], 1.0, group=7)
    m.failure(1, 1.0, "closed", hung=False)
    with pytest.raises(Rejected, match="removed"):
        m.join_group(None, 0, [(1, 0)], 1.1, group=7)  # a banned id: a restarted process needs a new one
    assert set(m.live) == set(before) - {0, 1}  # nothing of the refused groups was admitted
    assert m.join_group(None, 0, [(3, 0)], 1.2, group=7) == [2, 3]  # assigned ids avoid the requested ones


def test_flat_members_and_group_sessions_in_one_generation() -> None:
    m = _mk(initial_size=3)
    g = m.join_group(None, 0, [(None, 0)], 0.0, group=0)
    m.join(10, 0, 0.0, group=1, group_rank=0, group_size=2)  # a group whose ranks connect themselves (flat)
    m.join(11, 0, 0.0, group=1, group_rank=1, group_size=2)
    m.join_group(20, 0, [(21, 0)], 0.0, group=2)
    assert m.gen == 1 and m.heads == (g[0], 10, 11, 20)
    for head in (g[0], 10, 20):
        m.vote(head, 1, 0, 0.1)
    assert m.step == 0  # flat member 11 has not voted
    m.vote(11, 1, 0, 0.1)
    assert m.step == 1


def test_finish_by_a_leader_finishes_its_group_and_notices_go_once_per_session() -> None:
    m, ids = _sessions(2, 3)
    m.outbox.clear()
    for mid in ids[0]:  # what the service does for a group session's `bye` with `done`
        m.finish(mid, 1.0)
    assert m.finished_step == 0 and not any(x in m.live for x in ids[0])
    notices = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "finished"]
    assert [mid for mid, _ in notices] == [3]
    assert all(x in m.live for x in ids[1])


def _flat_twin(groups: int, size: int) -> Membership:
    m = _mk(initial_size=groups)
    for g in range(groups):
        for r in range(size):
            m.join(g * size + r, 0, 0.0, group=g, group_rank=r, group_size=size)
    return m


@pytest.mark.parametrize("seed", range(6))
def test_group_sessions_decide_as_flat_members_under_random_events(seed: int) -> None:
    """The reference: the same job run flat (every rank votes and is watched itself). Events -- commit rounds, a
    leader crash or hang, a follower lost -- drive both; their generations, members and commits stay equal."""
    rng = random.Random(seed)
    groups, size = 6, 3
    hier, _ = _sessions(groups, size)
    flat = _flat_twin(groups, size)
    now = 0.0
    for i in range(25):
        now += 1.0
        assert (hier.gen, hier.members, hier.step) == (flat.gen, flat.members, flat.step)
        live_groups = sorted({hier.live[x].group for x in hier.members})
        roll = rng.random()
        if i == 0 or roll < 0.6 or len(live_groups) <= 1:  # first a commit: every group then holds the state
            for head in hier.heads:
                hier.vote(head, hier.gen, hier.step, now)
            for x in flat.members:
                flat.vote(x, flat.gen, flat.step, now)
        else:
            g = rng.choice(live_groups)
            leader = g * size
            victim = leader + (0 if roll < 0.75 else rng.randrange(1, size))
            hung = rng.random() < 0.5
            why = "closed" if not hung else "missed heartbeats"
            hier.failure(victim, now, why if victim == leader else f"lost by its leader {leader}: {why}", hung=hung)
            flat.failure(victim, now, why, hung=hung)
            hier.tick(now)
            flat.tick(now)
        assert hier.fatal is None and flat.fatal is None
    assert hier.step > 0 and hier.gen > 2  # commits and at least two failures happened


def test_the_new_messages_are_checked() -> None:
    ok = check({"t": "lost", "member": 3, "hung": True, "reason": "silent"}, MEMBER_MESSAGES)
    assert ok == {"t": "lost", "member": 3, "hung": True, "reason": "silent"}
    for bad in ({"t": "lost", "member": -1, "hung": True}, {"t": "lost", "member": 1},
                {"t": "lost", "member": 1, "hung": "yes"}, {"t": "fail", "gen": 1, "member": "x"},
                {"t": "hello", "nonce": "n", "proof": "p", "proto": 4, "step": 0, "followers": [{"member": 1}]},
                {"t": "hello", "nonce": "n", "proof": "p", "proto": 4, "step": 0, "followers": [{"step": 0}] * 1024},
                {"t": "hello", "nonce": "n", "proof": "p", "proto": 4, "step": 0, "followers": {"step": 0}}):
        with pytest.raises(ProtocolError):
            check(bad, MEMBER_MESSAGES)


def test_heartbeat_levels_are_validated() -> None:
    with pytest.raises(ValueError, match="group_heartbeat_timeout_s"):
        MembershipConfig(group_heartbeat_interval_s=0.5, group_heartbeat_timeout_s=0.6)
    with pytest.raises(ValueError, match="group_heartbeat_interval_s"):
        MembershipConfig(group_heartbeat_interval_s=0.0)
    # unset, the local level follows the coordinator's: a job that raised its heartbeat timeout (the demo: 2 s on an
    # oversubscribed machine) does not lose a group to a shorter stall of a follower
    slow = MembershipConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0)
    assert (slow.group_heartbeat_interval_s, slow.group_heartbeat_timeout_s) == (0.25, 2.0)
    assert MembershipConfig(heartbeat_timeout_s=2.0, group_heartbeat_timeout_s=0.6).group_heartbeat_timeout_s == 0.6
    cfg = FaultTolerantConfig(coordinator="127.0.0.1:1", token="t", timeout_s=5.0, coordinator_timeout_s=2.0)
    base = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.6, "quorum_timeout_s": None,
            "grow_timeout_s": None}
    cfg.check_timeouts(**base, group_heartbeat_interval_s=0.5, group_heartbeat_timeout_s=3.0)
    with pytest.raises(ValueError, match=r"timeout_s=5.0 must be > the coordinator's group_heartbeat_timeout_s"):
        cfg.check_timeouts(**base, group_heartbeat_interval_s=0.5, group_heartbeat_timeout_s=6.0)
    with pytest.raises(ValueError, match=r"coordinator_timeout_s=2.0 must be > .*2 \* group_heartbeat_interval_s"):
        cfg.check_timeouts(**base, group_heartbeat_interval_s=1.0, group_heartbeat_timeout_s=3.0)


def test_the_vote_fast_path_decodes_as_json_does() -> None:
    """``decode`` parses a vote without ``json.loads`` (every session sends one per step): on votes as encoded and
    on near misses (leading zeros, 19+ digits, spaces, other keys) it answers exactly what the JSON path answers."""
    import json

    from torchnext.ft._wire import _VOTE, decode, encode

    rng = random.Random(3)
    lines = [encode({"t": "vote", "gen": rng.randrange(10**18), "step": rng.randrange(1 << 40)})[:-1]
             for _ in range(200)]
    lines += [b'{"t":"vote","gen":0,"step":0}', b'{"t":"vote","gen":01,"step":2}', b'{"t":"vote","gen":1,"step":-2}',
              b'{"t":"vote","gen":1234567890123456789,"step":2}', b'{"t":"vote", "gen":1,"step":2}',
              b'{"t":"vote","gen":1,"step":2,"x":1}', b'{"t":"vote","gen":1.0,"step":2}',
              b'{"t":"vote","step":2,"gen":1}', b'{"t":"vote","gen":9223372036854775807,"step":1}']
    fast = 0
    for line in lines:
        try:
            want: object = json.loads(line)
        except ValueError:
            want = ProtocolError
        try:
            got: object = decode(line)
        except ProtocolError:
            got = ProtocolError
        assert got == want, line
        fast += _VOTE.fullmatch(line) is not None
    assert fast == 201  # the 200 encoded votes and gen 0 / step 0; every near miss took the JSON path


@pytest.mark.parametrize("seed", range(8))
def test_every_session_expands_each_delta_to_the_full_generation(seed: int) -> None:
    """The reference is the full message: under random joins, crashes, hangs and commits, every session that holds
    the previous generation gets a delta, and that delta -- through the wire, applied to what the session holds --
    is exactly the full generation; a session that does not hold it gets the full form."""
    rng = random.Random(seed)
    m = _mk(initial_size=4)
    held: dict[int, tuple[int, list[list[int]]]] = {}  # session -> (generation, groups) it holds
    next_group = 0
    deltas = 0
    now = 0.0

    def join_group() -> None:
        nonlocal next_group
        m.join_group(None, 0, [(None, 0)] * 2, now, group=next_group)
        next_group += 1

    fulls: dict[int, dict] = {}  # generation -> the full message the state machine built
    build = m._new_generation

    def recording(*args: object, **kw: object) -> dict | None:
        msg = build(*args, **kw)  # type: ignore[arg-type]
        if msg is not None:
            fulls[msg["gen"]] = msg
        return msg

    m._new_generation = recording  # type: ignore[method-assign]
    for _ in range(4):
        join_group()
    for i in range(60):
        now += 1.0
        roll = rng.random()
        if (i == 0 or roll < 0.4) and m.heads:  # first a commit: every group then holds the state
            for head in m.heads:
                m.vote(head, m.gen, m.step, now)
        elif roll < 0.65:
            join_group()
        elif m.live and len({x.group for x in m.live.values()}) > 3:
            victim = rng.choice(sorted(m.live))
            m.failure(victim, now, "closed", hung=rng.random() < 0.5)
        now += 2.0  # past the grow timeout: an idle joiner is admitted with abort
        m.tick(now)
        for head, msg in m.outbox:
            if msg["t"] == "decision" and msg.get("next") is not None:
                msg = msg["next"]  # a grow between steps: always the full form
            elif msg["t"] != "gen":
                continue
            if "base" in msg:
                deltas += 1
                assert head in held and held[head][0] == msg["base"], (head, msg, held.get(head))
                got = _received(msg, *held[head])
            else:
                got = check(decode(encode(msg)[:-1]), COORDINATOR_MESSAGES)
            want = check(decode(encode(fulls[msg["gen"]])[:-1]), COORDINATOR_MESSAGES)
            assert got == want, (head, msg)
            held[head] = (got["gen"], got["groups"])
        m.outbox.clear()
        if m.fatal is not None:
            break
    assert deltas > 0


@pytest.mark.parametrize(("change", "why"), [
    ({"base": 7}, "against generation 7"),
    ({"drop": [0]}, "drops part of replica group"),
    ({"drop": [90, 91, 92]}, "does not hold"),
    ({"add": [[0, 99]]}, "disjoint"),
    ({"quorum_base": True, "quorum": [[0, 1, 2]]}, "both quorum and quorum_base"),
])
def test_a_delta_that_does_not_fit_is_refused(change: dict[str, object], why: str) -> None:
    delta = {"t": "gen", "gen": 2, "step": 0, "donor": 0, "abort": True, "term": 1, "joiners": [], "base": 1,
             "drop": [3, 4, 5], "add": [], **change}
    with pytest.raises(ProtocolError, match=why):
        _received(delta, 1, [[0, 1, 2], [3, 4, 5]])
