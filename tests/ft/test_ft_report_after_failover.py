"""A failure report made around a coordinator failover is repeated once the next coordinator is in office.

Found by the demo's ``--fault coordinator@STEP`` e2e test (1 run in ~10): two members reported generation 1 broken
while the primary was dying; the standby drops failure reports until it takes office and a member's failover
report does not carry them, so both waited 60 s for a generation that never came (QuorumLost)."""

from __future__ import annotations

from collections import deque
from typing import Any

from torchnext.ft.fault_tolerant import TRAIL_KEPT, FaultTolerant


class _Client:
    def __init__(self) -> None:
        self.failovers = 0
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)


def _member(gen: int) -> tuple[FaultTolerant, _Client]:
    ft = FaultTolerant.__new__(FaultTolerant)  # the report logic only: no coordinator, no generation to enter
    client = _Client()
    ft._client = client  # type: ignore[assignment]
    ft._gen = {"gen": gen, "members": [0, 1]}
    ft._newest_gen = gen
    ft._reported = (-1, 0, "")
    ft.trail = deque(maxlen=TRAIL_KEPT)
    return ft, client


def test_a_report_is_sent_once_and_again_only_after_a_failover() -> None:
    ft, client = _member(gen=1)
    ft._report("all_reduce failed: peer 1 died")
    ft._report("all_reduce failed again")  # once per generation
    ft._report_again_after_failover()  # no failover since: nothing
    assert [m["t"] for m in client.sent] == ["fail"] and client.sent[0]["gen"] == 1
    client.failovers = 1  # a standby took office
    ft._report_again_after_failover()
    ft._report_again_after_failover()  # once per failover
    assert len(client.sent) == 2
    assert client.sent[1]["gen"] == 1 and "after a failover" in client.sent[1]["reason"]
    assert "peer 1 died" in client.sent[1]["reason"]


def test_no_repeat_without_a_report_or_once_a_newer_generation_is_known() -> None:
    ft, client = _member(gen=3)
    client.failovers = 2
    ft._report_again_after_failover()  # never reported: nothing to repeat
    assert client.sent == []
    ft._report("x")
    ft._newest_gen = 4  # the next generation is announced: the coordinator already acted
    client.failovers = 3
    ft._report_again_after_failover()
    assert len(client.sent) == 1


def test_a_generation_is_reported_as_itself_when_its_build_failed() -> None:
    ft, client = _member(gen=1)
    ft._report("all_reduce failed: peer 1 died")  # generation 1 broke; generation 2 is announced ...
    ft._newest_gen = 2
    ft._report("building generation 2 failed", gen=2)  # ... and its build failed here: say so about 2
    ft._report("building generation 2 failed again", gen=2)  # once per generation
    ft._report("late news about 1")  # 2 is known: a report of 1 is pointless
    assert [(m["gen"], m["reason"]) for m in client.sent] == [
        (1, "all_reduce failed: peer 1 died"), (2, "building generation 2 failed")]
