"""Partitions of a real network: members and coordinators on different "hosts" (Linux network namespaces joined by
veth pairs to a bridge, :class:`torchnext.testing.netns.NetLab`), talking over the veth addresses, never loopback.

Hosts 0-3 run one member each, host 4 the coordinator in office, host 5 the standby. Faults are link faults: a
host's link goes down (its packets vanish: no RST, no error), or the bridge splits in two islands.

Skipped only where network namespaces cannot be made (not root, no iproute2), with the reason; CI runs as root,
so a skip there is a failure to investigate.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.ft_workload import FTJob, WorkerSpec, check_commit_logs
from torchnext.testing.netns import NetLab, available

_OK, _WHY = available()
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")]

TOKEN = "netns-test-token"
PRIMARY, STANDBY = 4, 5


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab(6) as lab:
        yield lab
        leftover = lab.name
    assert not [ns for ns in os.popen("ip netns list").read().split() if ns.startswith(leftover)], \
        "the lab left namespaces behind"


def _coordinators(lab: NetLab) -> tuple[CoordinatorProcess, CoordinatorProcess]:
    primary = CoordinatorProcess(TOKEN, host=lab.address(PRIMARY), initial_size=4, min_size=1,
                                 prefix=lab.prefix(PRIMARY)).launch()
    standby = CoordinatorProcess(TOKEN, host=lab.address(STANDBY), standby=True, prefix=lab.prefix(STANDBY))
    try:
        standby.launch().wait_ready()
        primary.wait_ready()
    except BaseException:
        primary.close()
        standby.close()
        raise
    return primary, standby


def _spec(lab: NetLab, addresses: str, member: int, host: int, log: str, **kw: Any) -> WorkerSpec:
    base: dict[str, Any] = {"steps": 60, "step_sleep_s": 0.02, "failover_timeout_s": 3.0, "timeout_s": 20.0,
                            "run_until_s": 90.0}
    base.update(kw)
    return WorkerSpec(coordinator=addresses, token=TOKEN, member_id=member, netns=lab.netns(host), event_log=log,
                      **base)


def _events(path: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(x) for x in fh if x.strip()]


def _wait_for_lines(path: str, n: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as fh:
                lines = [json.loads(x) for x in fh if x.strip()]
            if len(lines) >= n:
                return lines
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} generation records within {timeout}s")


def test_isolated_host_is_removed_within_a_second_and_rejoins_by_healing(lab: NetLab, tmp_path: Any) -> None:
    """Host 3's link goes down: the coordinator removes member 3 within 1 s (heartbeat_timeout_s=0.6 at the
    default settings), members 0-2 keep committing; member 3, cut off from both coordinators, stops with
    CoordinatorLost, entering no later generation. The link comes back; a replacement on host 3 joins through
    the veth network and is healed to the survivors' exact state."""
    log = str(tmp_path / "events.jsonl")
    primary, standby = _coordinators(lab)
    with primary, standby, FTJob() as job:
        addresses = f"{primary.address},{standby.address}"
        for m in range(4):
            job.launch(_spec(lab, addresses, m, m, log, run_until_member=103))
        _wait_for_lines(log, 4, 90)
        time.sleep(0.3)  # a few steps in generation 1
        cut = time.monotonic()
        lab.isolate([3])
        job.wait_exited([3], 30)
        lab.reconnect([3])
        job.launch(_spec(lab, addresses, 103, 3, log, run_until_size=4))
        reports = job.wait([0, 1, 2, 3, 103], timeout=120)
        assert primary.alive() and standby.alive()
    err = reports[3]["error"] or ""
    assert err.startswith("CoordinatorLost"), err
    assert check_commit_logs(reports, survivors=[0, 1, 2, 103], events=_events(log)) == [0, 1, 2, 103]
    assert check_commit_logs({m: r for m, r in reports.items() if m != 103}, survivors=[0, 1, 2])
    # removal: the generation without member 3 reached the survivors within 1 s of the cut
    without = [r for r in reports[0]["reconfigurations"] if 3 not in r["members"] and 103 not in r["members"]]
    assert without, reports[0]["reconfigurations"]
    gen = without[0]["gen"]
    # the cut-off member never entered or committed in a generation after the cut (a step decided before it -- the
    # decision waiting in its socket -- it may apply: check_commit_logs proved it is the survivors' step)
    assert max(reports[3]["generations"]) < gen and all(g < gen for g, _, _ in reports[3]["commits"])
    removed_after = min(r["timings"]["interrupt"] for m in (0, 1, 2) for r in reports[m]["reconfigurations"]
                        if r["gen"] == gen) - cut
    assert 0.0 < removed_after < 1.0, removed_after
    # the three continued: they committed in the generation without member 3
    assert any(g == without[0]["gen"] for g, _, _ in reports[0]["commits"])
    # the replacement was healed over the veth network and ends in the 4-member generation
    assert reports[103]["members"] == [0, 1, 2, 103]
    assert any(r["healed"] for r in reports[103]["reconfigurations"])


def test_even_split_never_lets_both_sides_commit_and_the_cut_side_rejoins(lab: NetLab, tmp_path: Any) -> None:
    """Split 2|2 with the coordinator on one side and the standby on the other: the coordinator's side goes on
    (half of the groups, rule 2b); the standby's side reports to the standby, which must not take office (2 of 4 is
    no strict majority), so members 2 and 3 stop with CoordinatorLost and never commit in a later generation. The network
    heals; replacements on hosts 2 and 3 rejoin by healing."""
    log = str(tmp_path / "events.jsonl")
    primary, standby = _coordinators(lab)
    with primary, standby, FTJob() as job:
        addresses = f"{primary.address},{standby.address}"
        for m in range(4):
            job.launch(_spec(lab, addresses, m, m, log, run_until_size=4))
        _wait_for_lines(log, 4, 90)
        time.sleep(0.3)
        cut = time.monotonic()
        lab.partition([[0, 1, PRIMARY], [2, 3, STANDBY]])
        job.wait_exited([2], 30)
        job.wait_exited([3], 30)
        lab.heal()
        for m in (2, 3):
            job.launch(_spec(lab, addresses, 100 + m, m, log, run_until_size=4))
        reports = job.wait([0, 1, 2, 3, 102, 103], timeout=120)
        standby_out = standby.output()
    split_gen = min(r["gen"] for r in reports[0]["reconfigurations"] if 2 not in r["members"])
    for m in (2, 3):
        err = reports[m]["error"] or ""
        assert err.startswith("CoordinatorLost"), (m, err)
        assert max(reports[m]["generations"]) < split_gen, (m, reports[m]["generations"], split_gen)
        assert all(g < split_gen for g, _, _ in reports[m]["commits"]), f"member {m} committed after the split"
    assert "took office" not in standby_out, standby_out
    # one history: no step in two generations across all six logs; survivors bitwise equal to the replay
    assert check_commit_logs(reports, survivors=[0, 1, 102, 103], events=_events(log)) == [0, 1, 102, 103]
    after = [(g, s) for g, s, t in reports[0]["commits"] if t > cut]
    assert after, "the coordinator's side did not go on"
    assert reports[0]["members"] == [0, 1, 102, 103]
    for m in (102, 103):
        assert any(r["healed"] for r in reports[m]["reconfigurations"]), m
