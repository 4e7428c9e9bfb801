"""Fault-tolerant HSDP: FSDP2 inside each replica group (2 ranks), ``ft.device_mesh`` across groups.

Oracles: plain data parallelism computed in this process (no faults: FT-HSDP must match it), and counterpart
equality -- rank r of every live replica group holds bitwise the same parameter shards and Adam state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.testing.faults import Fault, FaultKind, FaultPoint
from torchnext.testing.ft_parallel import ParallelSpec, check_sessions, hsdp_reference, run_parallel
from torchnext.testing.ft_workload import FTJob

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

KILL, IDLE, COLL = FaultKind.KILL, FaultPoint.IDLE, FaultPoint.COLLECTIVE


def _coordinator(groups: int) -> Coordinator:
    return Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=groups)))


SESSIONS = pytest.mark.parametrize("sessions", [False, True], ids=["flat", "group-sessions"])
"""Every rank its own coordinator connection (switched off: ``group_session=False``), or the default -- one group
session per replica group (protocol 4), its leader's address derived through the group's store."""


def _spec(coord: Coordinator, group: int, rank: int, steps: int, *, incarnation: int = 0, sessions: bool = True,
          **kw: Any) -> ParallelSpec:
    member = 2 * group + rank + 100 * incarnation
    return ParallelSpec(coordinator=coord.address, token=coord.token, store_port=coord.store_port, member_id=member,
                        steps=steps, parallel="hsdp", group=group, group_rank=rank, group_size=2,
                        incarnation=incarnation, group_session=None if sessions else False, **kw)


def _full(shards: list[list[Any]]) -> list[torch.Tensor]:
    """Unshard: FSDP2 shards every parameter on dim 0 (rank 0's rows first)."""
    return [torch.cat([torch.tensor(s[i]) for s in shards]) for i in range(len(shards[0]))]


@SESSIONS
def test_no_fault_matches_plain_data_parallel(sessions: bool) -> None:
    steps = 4
    with _coordinator(2) as coord, FTJob() as job:
        for g in range(2):
            for r in range(2):
                job.launch(_spec(coord, g, r, steps, sessions=sessions), run_parallel)
        reports = job.wait([0, 1, 2, 3], timeout=150)
    assert all(r["error"] is None and r["step"] == steps for r in reports.values()), reports
    check_sessions(reports, sessions)
    # the replica group's agreement on the attempt's generation: one all_reduce per attempt with flat sessions;
    # in a group session only before the first attempt (every later one follows a clean commit)
    assert {r["lockstep_rounds"] for r in reports.values()} == ({1} if sessions else {steps}), reports
    assert reports[0]["digest"] == reports[2]["digest"] and reports[1]["digest"] == reports[3]["digest"]
    assert reports[0]["digest"] != reports[1]["digest"]  # the two shards of one group differ
    got = _full([reports[0]["params"], reports[1]["params"]])
    want = [p.reshape(-1) if p.dim() == 1 else p for p in hsdp_reference(2, 2, steps)]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")


@SESSIONS
def test_kill_one_rank_then_the_group_rejoins_and_heals(tmp_path: Any, sessions: bool) -> None:
    """Rank 1 of group 1 dies inside backward at step 3: its sibling is removed with it (shared fate), group 0
    trains on alone. Group 1 restarts (new processes, garbage-free fresh model and no optimizer state), heals shard
    by shard from group 0, and both groups train on together: every rank then holds bitwise the parameters and
    Adam state of its counterpart."""
    stop = tmp_path / "stop"
    faults = [Fault(kind=KILL, member=3, step=3, where=COLL)]
    kw: dict[str, Any] = {"stop_file": str(stop), "step_sleep_s": 0.02, "faults": faults, "sessions": sessions}
    with _coordinator(2) as coord, FTJob() as job:
        for g in range(2):
            for r in range(2):
                job.launch(_spec(coord, g, r, 0, **kw), run_parallel)
        assert coord.wait_until(lambda c: 3 not in c.members and 2 not in c.members and c.step >= 5, 90), \
            coord.members
        for r in range(2):
            job.launch(_spec(coord, 1, r, 0, incarnation=1, **kw), run_parallel)
        assert coord.wait_until(lambda c: {102, 103} <= set(c.members), 90), coord.members
        target = coord.step + 4
        stop.write_text(str(target))
        reports = job.wait([0, 1, 2, 3, 102, 103], timeout=120)
        failures = [h for h in coord.history() if h["event"] == "failure"]
    assert failures and failures[0]["member"] == 3, failures
    # group sessions: member 3's death was seen and reported by its group's leader (member 2), not by the coordinator
    assert ("lost by its leader 2" in failures[0]["why"]) == sessions, failures[0]
    assert sorted(reports) == [0, 1, 2, 102, 103], sorted(reports)
    check_sessions(reports, sessions)
    assert "removed" in (reports[2]["error"] or ""), reports[2]["error"]  # shared fate with member 3
    for m in (0, 1, 102, 103):
        assert reports[m]["error"] is None and reports[m]["step"] == target, (m, reports[m]["error"])
    assert reports[0]["digest"] == reports[102]["digest"], "rank 0 of the healed group differs from its counterpart"
    assert reports[1]["digest"] == reports[103]["digest"], "rank 1 of the healed group differs from its counterpart"
    sizes = [len(g) for _, g in reports[0]["history"]]
    assert sizes[:3] == [2, 2, 2] and 1 in sizes and sizes[-1] == 2, sizes
    joined = [r for r in reports[102]["reconfigurations"] if 102 in r["joiners"]]
    assert joined and joined[0]["healed"], reports[102]["reconfigurations"]
    assert reports[102]["history"] and all(len(g) == 2 for _, g in reports[102]["history"])
    # healed shard by shard: each joiner received about half of the parameters + Adam moments, never all of them
    from torchnext.testing.ft_parallel import hsdp_model

    whole = 3 * 4 * sum(p.numel() for p in hsdp_model().parameters())  # fp32 params, exp_avg, exp_avg_sq
    for m in (102, 103):
        got = next(r for r in reports[m]["reconfigurations"] if m in r["joiners"])["healed"][0]
        assert 0.4 * whole < got < 0.6 * whole + 1024, (m, got, whole)
