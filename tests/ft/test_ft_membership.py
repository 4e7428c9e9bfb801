"""The coordinator's decision logic (no sockets): generations, quorum, commits, fencing; and the wire framing."""

from __future__ import annotations

import pytest

from torchnext.ft._wire import LineReader, ProtocolError, encode
from torchnext.ft.membership import Membership, MembershipConfig, Rejected


def _mk(**kw: object) -> Membership:
    kw.setdefault("heartbeat_interval_s", 1.0)  # the fake clock below never sends heartbeats
    kw.setdefault("heartbeat_timeout_s", 100.0)
    return Membership(MembershipConfig(**kw))  # type: ignore[arg-type]


def _gens(m: Membership) -> list[tuple[int, dict]]:
    out = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "gen"]
    m.outbox.clear()
    return out


def _formed(n: int, **kw: object) -> Membership:
    m = _mk(initial_size=n, **kw)
    for i in range(n):
        m.join(i, 0, 0.0)
    m.outbox.clear()
    return m


def test_formation_waits_for_initial_size_and_picks_donor_with_most_steps() -> None:
    m = _mk(min_size=2, initial_size=3)
    m.join(None, 0, 0.0)
    m.join(None, 5, 0.0)
    assert m.gen == 0 and not m.outbox
    m.join(None, 5, 0.0)
    gens = _gens(m)
    assert m.gen == 1 and m.members == (0, 1, 2)
    msg = gens[0][1]
    assert msg["donor"] == 1 and msg["joiners"] == [0, 2] and msg["step"] == 5 and not msg["abort"]
    assert sorted(mid for mid, _ in gens) == [0, 1, 2]


def test_crash_shrinks_after_settle_and_batches_simultaneous_failures() -> None:
    m = _formed(4, min_size=2, settle_s=0.01)
    m.failure(2, 1.0, "closed", hung=False)
    m.tick(1.005)
    assert m.gen == 1  # still settling
    m.failure(3, 1.006, "closed", hung=False)
    m.tick(1.011)
    gens = _gens(m)
    assert m.gen == 2 and m.members == (0, 1)
    assert {mid for mid, _ in gens} == {0, 1} and all(msg["abort"] for _, msg in gens)
    assert m.to_close == [2, 3]


def test_report_regenerates_same_members_and_stale_report_ignored() -> None:
    m = _formed(3, settle_s=0.0)
    m.report_failure(1, 0, "stale", 1.0)
    m.tick(1.0)
    assert m.gen == 1
    m.report_failure(1, 1, "PeerFailure", 1.0)
    m.tick(1.0)
    assert m.gen == 2 and m.members == (0, 1, 2)


def test_heartbeat_expiry_fences_and_removed_id_is_rejected() -> None:
    m = _formed(3, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, settle_s=0.0)
    for i in (0, 1):
        m.heartbeat(i, 0.45)
    m.tick(0.55)
    assert m.members == (0, 1) and m.gen == 2
    assert m.to_fence and m.to_fence[0][0] == 2 and m.to_fence[0][1]["t"] == "removed"
    with pytest.raises(Rejected, match="you were removed") as info:
        m.join(2, 0, 1.0)
    assert info.value.code == "removed"
    with pytest.raises(Rejected) as dup:
        m.join(0, 0, 1.0)
    assert dup.value.code == "duplicate"


def test_forgive_after_coordinator_stall() -> None:
    m = _formed(2, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    m.forgive(2.0)
    m.tick(2.1)
    assert m.members == (0, 1) and m.gen == 1


def test_commit_needs_every_vote_and_stale_votes_do_not_count() -> None:
    m = _formed(3)
    m.vote(0, 1, 0, 1.0)
    m.vote(1, 1, 0, 1.0)
    m.vote(2, 0, 0, 1.0)  # stale generation
    assert m.step == 0 and not m.outbox
    m.vote(2, 1, 0, 1.0)
    assert m.step == 1
    decisions = [(mid, msg) for mid, msg in m.outbox if msg["t"] == "decision"]
    assert sorted(mid for mid, _ in decisions) == [0, 1, 2]
    assert all(msg["step"] == 0 and msg["committed"] == 1 for _, msg in decisions)


def test_vote_for_wrong_step_is_fatal_for_that_member() -> None:
    m = _formed(2)
    m.vote(0, 1, 7, 1.0)
    assert m.outbox == [(0, {"t": "fatal", "code": "step_mismatch",
                             "reason": "member 0 voted for step 7 but the committed step count is 0"})]


def test_joiner_enters_at_the_next_commit_decision() -> None:
    m = _formed(2)
    m.vote(0, 1, 0, 1.0)
    m.vote(1, 1, 0, 1.0)  # members 0, 1 hold the committed state now
    m.outbox.clear()
    m.join(None, 0, 1.1)
    assert m.gen == 1 and not m.outbox
    m.vote(0, 1, 1, 1.2)
    m.vote(1, 1, 1, 1.2)
    assert m.gen == 2 and m.members == (0, 1, 2)
    by_member = {mid: msg for mid, msg in m.outbox}
    assert by_member[2]["t"] == "gen" and by_member[2]["joiners"] == [2] and by_member[2]["donor"] == 0
    assert by_member[0]["t"] == "decision" and by_member[0]["next"]["gen"] == 2 and not by_member[0]["next"]["abort"]


def test_idle_group_grows_after_grow_timeout() -> None:
    m = _formed(2, grow_timeout_s=0.5)
    m.join(None, 0, 1.0)
    m.tick(1.2)
    assert m.gen == 1
    m.tick(1.6)
    assert m.gen == 2 and m.members == (0, 1, 2) and _gens(m)[0][1]["abort"]


def test_quorum_rule_waits_then_fails() -> None:
    m = _formed(3, min_size=2, settle_s=0.0, quorum_timeout_s=5.0)
    m.failure(1, 1.0, "closed", hung=False)
    m.failure(2, 1.0, "closed", hung=False)
    m.tick(1.0)
    assert m.gen == 1 and [msg["t"] for _, msg in m.outbox] == ["wait"]
    m.outbox.clear()
    m.tick(7.0)
    assert m.fatal is not None and m.outbox[0][1]["code"] == "quorum_lost"
    with pytest.raises(Rejected):
        m.join(None, 0, 8.0)


def test_quorum_regained_by_a_joiner() -> None:
    m = _formed(2, min_size=2, settle_s=0.0)
    m.vote(0, 1, 0, 0.5)
    m.vote(1, 1, 0, 0.5)
    m.failure(1, 1.0, "closed", hung=False)
    m.tick(1.0)
    m.outbox.clear()
    m.join(None, 0, 2.0)
    gens = _gens(m)
    assert m.gen == 2 and m.members == (0, 2) and gens[0][1]["donor"] == 0 and gens[0][1]["joiners"] == [2]


def test_every_state_holder_lost_is_fatal() -> None:
    m = _formed(2, settle_s=0.0)
    m.vote(0, 1, 0, 0.5)
    m.vote(1, 1, 0, 0.5)
    m.join(None, 0, 0.6)  # joiner not yet healed
    m.failure(0, 1.0, "closed", hung=False)
    m.failure(1, 1.0, "closed", hung=False)
    m.tick(1.0)
    assert m.fatal is not None and "committed state" in m.fatal


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="at least twice"):
        MembershipConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=0.6)
    with pytest.raises(ValueError, match="min_size"):
        MembershipConfig(min_size=0)
    with pytest.raises(ValueError, match="initial_size"):
        MembershipConfig(min_size=3, initial_size=2)


def test_wire_framing() -> None:
    r = LineReader()
    data = encode({"t": "hb"}) + encode({"t": "vote", "gen": 1, "step": 2})
    assert r.feed(data[:5]) == []
    assert r.feed(data[5:]) == [{"t": "hb"}, {"t": "vote", "gen": 1, "step": 2}]
    with pytest.raises(ProtocolError, match="not JSON"):
        LineReader().feed(b"\x80\x04pickle\n")
    with pytest.raises(ProtocolError, match="not a message"):
        LineReader().feed(b"[1, 2]\n")
    with pytest.raises(ProtocolError, match="longer"):
        LineReader().feed(b"x" * (1 << 17))


def test_finish_ends_the_job_without_reconfiguring() -> None:
    m = _formed(3, min_size=2, settle_s=0.0)
    for mid in (0, 1, 2):
        m.vote(mid, 1, 0, 1.0)
    assert m.step == 1
    m.outbox.clear()
    m.finish(0, 2.0)
    assert m.finished_step == 1 and m.to_close == [0]
    m.failure(1, 2.1, "closed", hung=False)  # a plain exit after the end: not a failure
    m.tick(50.0)  # and silence (member 2 sends no heartbeats on this clock) changes nothing either
    m.tick(500.0)
    assert m.gen == 1 and not _gens(m) and m.fatal is None
    events = [h["event"] for h in m.history]
    assert events.count("finish") == 1 and events.count("left_after_finish") == 2 and "failure" not in events
    with pytest.raises(Rejected) as exc:
        m.join(None, 1, 600.0)
    assert exc.value.code == "finished"


def test_vote_after_finish_is_refused_and_joiners_are_told() -> None:
    m = _formed(2, settle_s=0.0)
    m.join(7, 0, 0.5)  # a joiner waiting for the next decision
    m.outbox.clear()
    m.finish(0, 1.0)
    told = {mid: msg for mid, msg in m.outbox}
    assert told[7]["t"] == "fatal" and told[7]["code"] == "finished" and 7 in m.to_close
    m.outbox.clear()
    m.vote(1, 1, 0, 1.1)
    assert m.outbox and m.outbox[0][1]["code"] == "finished" and m.step == 0


def test_finish_during_an_open_vote_is_an_ordinary_leave() -> None:
    m = _formed(3, min_size=2, settle_s=0.0)
    for mid in (0, 1, 2):
        m.vote(mid, 1, 0, 0.5)  # step 0 committed: every member holds the state
    m.vote(1, 1, 1, 1.0)  # member 1 already voted for the next step: member 0 leaving now is a departure
    m.finish(0, 1.1)
    m.tick(1.1)
    assert m.finished_step is None and m.gen == 2 and m.members == (1, 2)
    assert any(h["event"] == "failure" and h["why"] == "left" for h in m.history)


def test_failure_report_after_finish_is_answered_finished() -> None:
    m = _formed(2, settle_s=0.0)
    m.finish(0, 1.0)
    m.outbox.clear()
    m.report_failure(1, 1, "peer closed", 1.1)
    m.tick(2.0)
    assert m.outbox == [(1, {"t": "fatal", "code": "finished", "reason": "the job finished at step 0: no new generation"})]
    assert m.gen == 1


# ------------------------------------------------------------------------------------------- replica groups
def _groups(n_groups: int, size: int, **kw: object) -> Membership:
    """``n_groups`` replica groups of ``size`` ranks; member id = 10 * group + rank."""
    m = _mk(initial_size=n_groups, **kw)
    for g in range(n_groups):
        for r in range(size):
            m.join(10 * g + r, 0, 0.0, group=g, group_rank=r, group_size=size)
    return m


def test_a_replica_group_takes_part_only_whole() -> None:
    m = _mk(initial_size=2)
    m.join(0, 0, 0.0, group=0, group_rank=0, group_size=2)
    m.join(1, 0, 0.0, group=0, group_rank=1, group_size=2)
    m.join(10, 0, 0.0, group=1, group_rank=0, group_size=2)
    assert m.gen == 0  # group 1 is not whole yet: one group of the two needed
    m.join(11, 0, 0.0, group=1, group_rank=1, group_size=2)
    gens = _gens(m)
    assert m.gen == 1 and m.members == (0, 1, 10, 11)
    msg = gens[0][1]
    assert msg["groups"] == [[0, 1], [10, 11]] and msg["donors"] == [0, 1] and msg["joiners"] == [10, 11]


def test_a_failed_rank_takes_its_whole_group_out_and_the_others_go_on() -> None:
    m = _groups(2, 2, min_size=1, settle_s=0.0)
    m.outbox.clear()
    m.failure(11, 1.0, "closed", hung=False)
    assert m.to_close == [11]
    fenced = dict(m.to_fence)
    assert list(fenced) == [10] and fenced[10]["t"] == "removed"
    assert "replica group 1 lost member 11" in fenced[10]["reason"]
    m.tick(1.0)
    gens = _gens(m)
    assert m.gen == 2 and m.members == (0, 1) and {mid for mid, _ in gens} == {0, 1}
    assert gens[0][1]["groups"] == [[0, 1]] and gens[0][1]["abort"]
    # the restarted group rejoins as new members: healed from the donor group, rank by rank, at the next commit
    m.join(20, 0, 2.0, group=1, group_rank=0, group_size=2)
    m.join(21, 0, 2.0, group=1, group_rank=1, group_size=2)
    for mid in (0, 1):
        m.vote(mid, 2, 0, 2.1)
    nxt = next(msg for mid, msg in m.outbox if mid == 20 and msg["t"] == "gen")
    assert nxt["members"] == [0, 1, 20, 21] and nxt["joiners"] == [20, 21] and nxt["donors"] == [0, 1]
    assert nxt["groups"] == [[0, 1], [20, 21]] and not nxt["abort"]


def test_an_incomplete_joining_group_waits_and_min_size_counts_groups() -> None:
    m = _groups(2, 2, min_size=2, settle_s=0.0)
    for mid in (0, 1, 10, 11):  # one commit: both groups hold the state
        m.vote(mid, 1, 0, 0.5)
    m.failure(1, 1.0, "closed", hung=False)
    m.tick(1.0)
    assert m.waiting_since is not None  # one group left, min_size=2 groups: wait for joiners
    m.join(30, 0, 1.5, group=3, group_rank=1, group_size=2)
    assert m.waiting_since is not None  # half a group is no quorum
    m.join(31, 0, 1.6, group=3, group_rank=0, group_size=2)
    assert m.waiting_since is None and m.members == (10, 11, 30, 31)


@pytest.mark.parametrize(("kwargs", "code", "text"), [
    ({"group": 0, "group_rank": 0, "group_size": 3}, "bad_request", "same shard count"),
    ({"group": 0, "group_rank": 0, "group_size": 2}, "duplicate", "rank 0 of replica group 0"),
    ({"group": 5, "group_rank": 2, "group_size": 2}, "bad_request", "out of range"),
    ({"group": -1, "group_rank": 0, "group_size": 2}, "bad_request", "replica group id"),
    ({"group": None, "group_rank": 1, "group_size": 2}, "bad_request", "without a replica group"),
    ({"group": 5, "group_rank": "0", "group_size": 2}, "bad_request", "group_rank"),
])
def test_malformed_or_inconsistent_group_joins_are_rejected(kwargs: dict, code: str, text: str) -> None:
    m = _mk(initial_size=1)
    m.join(0, 0, 0.0, group=0, group_rank=0, group_size=2)
    with pytest.raises(Rejected, match=text) as info:
        m.join(None, 0, 0.0, **kwargs)
    assert info.value.code == code


def test_live_indexes_match_a_full_scan_under_random_events() -> None:
    """The indexes that make a tick and a join O(1) amortised (``live.whole``/``groups``, ``live.heard``, the pending
    joiners) agree with the reference full scans after every event of a random schedule: joins, heartbeats with
    clocks that sometimes go backwards, failures (whole groups leave), forgiveness, ticks."""
    import random

    rng = random.Random(26)
    for trial in range(20):
        m = Membership(MembershipConfig(min_size=1, initial_size=3, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
                                        grow_timeout_s=100.0))
        now, next_group = 0.0, 0
        for _ in range(300):
            if m.fatal is not None:  # every holder of the state failed: the job is over, nothing more to check
                break
            op = rng.random()
            now += rng.uniform(-0.05, 0.2) if trial % 2 else rng.uniform(0.0, 0.2)
            if op < 0.2:
                for r in range(2):
                    m.join(None, 0, now, group=next_group, group_rank=r, group_size=2)
                next_group += 1
            elif op < 0.7 and m.live:
                mid = rng.choice(sorted(m.live))
                m.heartbeat(mid, now)
            elif op < 0.8 and m.live:
                m.failure(rng.choice(sorted(m.live)), now, "killed", hung=False)
            elif op < 0.85:
                m.forgive(now)
            else:
                cutoff = now - m.config.heartbeat_timeout_s
                assert sorted(m.live.silent_since(cutoff)) == sorted(i for i, x in m.live.items()
                                                                     if x.last_seen < cutoff)
                m.tick(now)
                assert all(now - x.last_seen <= m.config.heartbeat_timeout_s for x in m.live.values())
            m.outbox.clear()
            assert m.live.whole_members() == m._complete(sorted(m.live))
            assert m._joiners() == sorted(i for i in m.live if i not in m.members)
            assert {g: sorted(r.values()) for g, r in m.live.groups.items()} == {
                g: sorted(i for i, x in m.live.items() if x.group == g) for g in {x.group for x in m.live.values()}}


@pytest.mark.parametrize("seed", range(8))
def test_a_generation_on_the_wire_expands_back_to_itself(seed: int) -> None:
    """The compact wire form (groups once; members, donors, quorum derived; joiners or their complement) checked
    back into exactly the message the state machine produced, for random generations: formation, grow, shrink."""
    import random

    from torchnext.ft._wire import COORDINATOR_MESSAGES, MAX_GENERATION_LINE, LineReader, check, encode

    rng = random.Random(seed)
    size = rng.choice([1, 2, 8])
    groups = rng.randint(2, 40)
    m = Membership(MembershipConfig(min_size=1, initial_size=groups, settle_s=0.0, heartbeat_interval_s=10.0,
                                    heartbeat_timeout_s=100.0))
    for g in range(groups):
        for r in range(size):
            m.join(None, rng.randint(0, 3), 0.0, group=g if size > 1 else None, group_rank=r, group_size=size)
    seen = []

    def vote_all(now: float) -> None:
        for mid in m.members:
            m.vote(mid, m.gen, m.step, now)

    for round_ in range(4):
        for _, msg in m.outbox:
            if msg["t"] in ("gen", "decision"):
                (raw,) = LineReader(MAX_GENERATION_LINE).feed(encode(msg))
                got = check(raw, COORDINATOR_MESSAGES)
                want = dict(msg)
                if "next" in msg:  # a nested record is checked without its "t" (as before the compact form)
                    want["next"] = {k: v for k, v in msg["next"].items() if k != "t"}
                assert {k: v for k, v in got.items() if v is not None or k in msg} == want
                seen.append(msg["t"] + ("+next" if "next" in msg else ""))
        m.outbox.clear()
        if round_ == 0:  # a commit: every member holds the state
            vote_all(0.5)
        elif round_ == 1:  # shrink: a member fails, its group leaves, the quorum is the old generation's
            m.failure(rng.choice(sorted(m.live)), 1.0, "killed", hung=False)
            m.tick(1.0)
        elif round_ == 2:  # grow at a commit: a new group joins, the decision carries the next generation
            for r in range(size):
                m.join(None, 0, 2.0, group=1000 if size > 1 else None, group_rank=r, group_size=size)
            vote_all(2.0)
    assert {"gen", "decision", "decision+next"} <= set(seen), seen


@pytest.mark.parametrize(("change", "why"), [
    ({"members": [0, 1, 2, 99]}, "members are not the ids"),
    ({"joiners": [99]}, "joiners names a member outside"),
    ({"synced": [99]}, "synced names a member outside"),
    ({"synced": [0], "joiners": [1]}, "both joiners and synced"),
    ({"donor": 99}, "is in none of its replica groups"),
])
def test_a_contradictory_compact_generation_is_refused(change: dict[str, object], why: str) -> None:
    from torchnext.ft._wire import COORDINATOR_MESSAGES, ProtocolError, check

    msg = {"t": "gen", "gen": 1, "step": 0, "donor": 0, "abort": False, "groups": [[0, 1], [2, 3]], "term": 1,
           **change}
    with pytest.raises(ProtocolError, match=why):
        check(msg, COORDINATOR_MESSAGES)


def test_a_generation_after_hundreds_of_failures_still_fits_the_wire() -> None:
    """Found by bench_scale at 2,048 ranks: 200 members missing heartbeats in one settle window gave a generation
    whose reason (every failure, joined) exceeded the wire's 2,000 characters, and every member dropped the
    coordinator with a ProtocolError. The message's reason is clipped; the history keeps it whole."""
    from torchnext.ft._wire import COORDINATOR_MESSAGES, LineReader, check, encode

    m = _formed(400, heartbeat_interval_s=10.0, heartbeat_timeout_s=100.0)
    for mid in range(1, 400, 2):  # the donor (member 0) survives
        m.failure(mid, 1.0, "missed heartbeats for 0.618s (timeout 0.6s)", hung=True)
    m.tick(2.0)
    gens = _gens(m)
    assert gens and m.members == tuple(range(0, 400, 2))
    (raw,) = LineReader().feed(encode(gens[0][1]))
    msg = check(raw, COORDINATOR_MESSAGES)
    assert len(msg["reason"]) <= 2000 and "more characters" in msg["reason"]
    assert len(next(h for h in m.history if h["event"] == "generation" and h["gen"] == 2)["reason"]) > 2000


def test_the_depth_check_equals_its_reference_on_random_lines() -> None:
    """``_depth_ok`` (regex-stripped strings, brackets walked) against the byte-by-byte reference: random lines of
    brackets, quotes, backslashes and text, including unterminated strings and escaped quotes."""
    import random

    from torchnext.ft._wire import _depth_ok, _depth_ok_reference

    rng = random.Random(7)
    alphabet = [b"[", b"]", b"{", b"}", b'"', b"\\\\", b"a", b",", b":", b"1", b"[[[[", b"]]]]"]
    for _ in range(5000):
        line = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert _depth_ok(line) == _depth_ok_reference(line), line
    deep = b'{"t":"x","s":"' + b"[" * 50 + b'","v":' + b"[" * 9 + b"]" * 9 + b"}"
    assert not _depth_ok(deep) and not _depth_ok_reference(deep)
    assert _depth_ok(b'{"s":"\\\\"' + b"[" * 20 + b'"}') == _depth_ok_reference(b'{"s":"\\\\"' + b"[" * 20 + b'"}')


def test_the_line_reader_equals_its_reference_on_random_chunkings() -> None:
    """``LineReader.feed``'s one-whole-line fast path and its buffered loop give what splitting the stream at
    newlines gives, whatever the chunking: empty lines skipped, a partial line kept, an over-long line refused."""
    import json
    import random

    rng = random.Random(11)
    pool = [b'{"t":"hb"}', b'{"t":"vote","gen":3,"step":7}', b"", b"  ", b'{"t":"x","v":[1,2]}', b'{"t":"ping"}']
    for _ in range(2000):
        lines = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        stream = b"".join(x + b"\n" for x in lines) + rng.choice([b"", b'{"t":'])
        want = [json.loads(x) for x in lines if x.strip()]
        reader, got, i = LineReader(max_line=40), [], 0
        while i < len(stream):
            n = rng.choice([1, 3, len(stream)])
            got += reader.feed(stream[i:i + n])
            i += n
        assert got == want, (lines, stream)
    with pytest.raises(ProtocolError, match="longer"):
        LineReader(max_line=10).feed(b'{"t":"hb","x":1}\n')
    assert LineReader(max_line=11).feed(b'{"t":"hb"}\n') == [{"t": "hb"}]


def test_a_member_silent_right_after_a_takeover_is_removed() -> None:
    """A member that promised the new coordinator and then hangs (SIGSTOP) is removed after the heartbeat timeout,
    as any member: take_office counts it as heard from at the takeover, and expiry sees it from there."""
    from torchnext.ft.election import GenerationRef, Takeover

    cfg = MembershipConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    st = Membership(cfg)
    st.failover = True
    groups = ((0,), (144,), (182,), (185,))
    ref = GenerationRef(gen=191, term=3, groups=groups, quorum=groups, step=100)
    takeover = Takeover(term=4, latest=ref, step=100, gen=192, members=(0, 144, 182, 185),
                        synced=frozenset({0, 144, 182, 185}), decisions=(), quorum=groups, reason="took office")
    t = 1000.0
    st.take_office(takeover, {m: (None, 0, 1) for m in takeover.members}, t)
    assert (st.gen, st.members) == (192, (0, 144, 182, 185))
    for _ in range(5):  # 0.5 s: within the timeout
        t += 0.1
        for m in (0, 144, 185):
            st.heartbeat(m, t)
        st.tick(t)
    assert st.members == (0, 144, 182, 185)
    for _ in range(3):
        t += 0.1
        for m in (0, 144, 185):
            st.heartbeat(m, t)
        st.tick(t)
    assert (st.gen, st.members) == (193, (0, 144, 185))
    assert any(h["event"] == "failure" and h["member"] == 182 and h["hung"] for h in st.history)


def test_the_coordinators_history_is_bounded() -> None:
    """Weeks of faults: the coordinator keeps the last HISTORY_EVENTS events, the newest ones."""
    from torchnext.ft.membership import HISTORY_EVENTS

    m = Membership(MembershipConfig(min_size=1))
    anchor = m.join(None, 0, 0.0)  # holds the state throughout
    t = 0.0
    for _ in range(HISTORY_EVENTS // 2 + 10):  # a join and a failure per cycle, generations between
        mid = m.join(None, 0, t)
        t += 2.0  # past grow_timeout_s: the joiner enters a generation
        m.heartbeat(anchor, t)
        m.tick(t)
        m.leave(mid, t)
        t += 1.0
        m.heartbeat(anchor, t)
        m.tick(t)
    assert anchor in m.members
    assert len(m.history) == HISTORY_EVENTS
    assert m.history[-1]["at"] == max(h["at"] for h in m.history)
    assert m.history[0]["at"] > 0.0  # the first events were dropped
