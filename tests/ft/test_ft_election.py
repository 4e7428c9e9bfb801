"""The split-brain rules as pure logic: the standby's takeover rule (:mod:`torchnext.ft.election`) and the failover
rule 2b of the coordinator in office (:mod:`torchnext.ft.membership`) -- never both sides of a partition go on."""

from __future__ import annotations

import itertools

import pytest

from torchnext.ft.election import Election, GenerationRef, Report
from torchnext.ft.membership import Membership, MembershipConfig


def _ref(gen: int, groups: list[list[int]], *, term: int = 1, step: int = 10,
         quorum: list[list[int]] | None = None) -> GenerationRef:
    g = tuple(tuple(x) for x in groups)
    return GenerationRef(gen=gen, term=term, groups=g, quorum=tuple(tuple(x) for x in (quorum or groups)), step=step)


def _report(member: int, ref: GenerationRef | None, step: int, *, vote: tuple[int, int] | None = None,
            term: int = 1, synced: bool = True) -> Report:
    return Report(member=member, term=term, step=step, synced=synced, attempted=ref.gen if ref else 0, entered=ref,
                  vote=vote)


FOUR = [[0], [1], [2], [3]]


def test_no_takeover_without_a_strict_majority_of_the_last_generation() -> None:
    ref = _ref(3, FOUR)
    e = Election(grace_s=0.0)
    for m in (2, 3):
        e.add(_report(m, ref, 11), 0.0)
    assert e.prepare(0.0) is None
    assert "2 of the 4 replica groups" in (e.shortfall({2, 3}) or "")
    e.add(_report(1, ref, 11), 0.0)
    term = e.prepare(0.0)
    assert term == 2
    for m in (1, 2, 3):
        e.promise(m, term)
    took = e.decide(0.0)
    assert took is not None and took.members == (1, 2, 3) and took.step == 11 and took.term == 2
    assert took.gen > 3 and took.quorum == ref.groups  # step 10 -> 11 was seen committed in generation 3


def test_promises_count_not_reports() -> None:
    ref = _ref(3, FOUR)
    e = Election(grace_s=0.0)
    for m in (1, 2, 3):
        e.add(_report(m, ref, 11), 0.0)
    term = e.prepare(0.0)
    assert term is not None
    e.promise(1, term)
    e.promise(2, term)
    e.promise(3, term + 1)  # a promise of another term does not count
    assert e.decide(0.0) is None
    e.promise(3, term)
    assert e.decide(0.0) is not None


def test_uncommitted_generation_needs_a_majority_of_its_quorum_too() -> None:
    """L = [0, 1, 2] formed from quorum [0..3] and never committed: the reporters must hold a strict majority of
    both."""
    ref = _ref(4, [[0], [1], [2]], quorum=FOUR, step=10)
    e = Election(grace_s=0.0)
    e.add(_report(0, ref, 10), 0.0)
    e.add(_report(1, ref, 10), 0.0)
    assert e.shortfall({0, 1}) is not None and "quorum" in (e.shortfall({0, 1}) or "")
    e.add(_report(3, _ref(3, FOUR), 10), 0.0)  # member 3 was in the quorum generation only
    assert e.shortfall({0, 1, 3}) is None


def test_pending_vote_of_a_step_someone_saw_committed_gets_its_decision() -> None:
    ref = _ref(5, FOUR, step=7)
    e = Election(grace_s=0.0)
    e.add(_report(0, ref, 8), 0.0)  # saw the decision of step 7
    e.add(_report(1, ref, 7, vote=(5, 7)), 0.0)  # voted, the decision never arrived
    e.add(_report(2, ref, 7, vote=(5, 7)), 0.0)
    e.add(_report(3, ref, 7), 0.0)  # had not voted yet: healed
    term = e.prepare(0.0)
    assert term is not None
    for m in range(4):
        e.promise(m, term)
    took = e.decide(0.0)
    assert took is not None and took.step == 8
    assert sorted(m for m, _ in took.decisions) == [1, 2]
    assert all(d == {"t": "decision", "gen": 5, "step": 7, "committed": 8} for _, d in took.decisions)
    assert took.synced == frozenset({0, 1, 2})


def test_a_step_nobody_saw_committed_is_not_committed() -> None:
    ref = _ref(5, FOUR, step=7)
    e = Election(grace_s=0.0)
    for m in range(4):
        e.add(_report(m, ref, 7, vote=(5, 7) if m < 3 else None), 0.0)
    term = e.prepare(0.0)
    assert term is not None
    for m in range(4):
        e.promise(m, term)
    took = e.decide(0.0)
    assert took is not None and took.step == 7 and not took.decisions


def test_a_report_of_a_newer_term_restarts_the_preparation() -> None:
    ref = _ref(3, FOUR)
    e = Election(grace_s=0.0)
    for m in (0, 1, 2):
        e.add(_report(m, ref, 11), 0.0)
    assert e.prepare(0.0) == 2
    assert e.add(_report(3, _ref(9, FOUR, term=4), 11, term=4), 0.0) is None  # another standby's term 4
    assert e.term is None
    assert e.prepare(0.0) == 5


def test_grace_waits_for_the_rest_of_the_generation() -> None:
    ref = _ref(3, FOUR)
    e = Election(grace_s=0.5)
    for m in (0, 1, 2):
        e.add(_report(m, ref, 11), 0.0)
    term = e.prepare(0.0)
    assert term is not None
    for m in (0, 1, 2):
        e.promise(m, term)
    assert e.decide(0.1) is None  # member 3 may be a few ms late
    assert e.decide(0.6) is not None


def _office(n: int) -> Membership:
    m = Membership(MembershipConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=100.0, initial_size=n,
                                    settle_s=0.0))
    m.failover = True
    for i in range(n):
        m.join(i, 0, 0.0)
    for i in range(n):
        m.vote(i, 1, 0, 0.0)  # generation 1 commits: it is the quorum
    m.outbox.clear()
    return m


@pytest.mark.parametrize(("n", "lost", "goes_on"), [(2, 1, True), (4, 2, True), (4, 3, False), (3, 2, False),
                                                     (5, 2, True), (5, 3, False)])
def test_failover_rule_keeps_the_office_going_with_half_of_the_quorum(n: int, lost: int, goes_on: bool) -> None:
    m = _office(n)
    for i in range(lost):
        m.failure(n - 1 - i, 1.0, "partitioned", hung=True)
    m.tick(1.0)
    fatal = [msg for _, msg in m.outbox if msg["t"] == "fatal"]
    if goes_on:
        assert m.gen == 2 and not fatal and len(m.members) == n - lost
    else:
        assert fatal and fatal[0]["code"] == "quorum_lost" and "failover rule" in fatal[0]["reason"]


@pytest.mark.parametrize("n", range(1, 9))
def test_the_two_sides_of_any_split_never_both_go_on(n: int) -> None:
    """For every split of n groups into the coordinator's side and the standby's side: the office may continue
    (rule 2b) and the standby may take over (takeover rule) -- never both; and a whole side always goes on."""
    groups = [[g] for g in range(n)]
    ref = _ref(3, groups)
    office = Membership(MembershipConfig())
    office.failover = True
    office.quorum = groups
    for k in range(n + 1):
        for office_side in itertools.combinations(range(n), k):
            other = sorted(set(range(n)) - set(office_side))
            office_goes_on = office._quorum_short(list(office_side)) is None
            e = Election(grace_s=0.0)
            for m in other:
                e.add(_report(m, ref, 11), 0.0)
            standby_takes_over = e.shortfall(set(other)) is None
            assert not (office_goes_on and standby_takes_over), (n, office_side)
            if k == n:
                assert office_goes_on
            if k == 0:
                assert standby_takes_over
