"""Fault-tolerant DDP: torch's DistributedDataParallel on ``ft.process_group``, 4 member processes, scripted faults.

Oracle: the exact replay of the committed steps (integer gradients, AVG over the live replica groups), computed
from each survivor's own commit record -- no committed step lost or applied twice -- and bitwise equality of all
survivors' parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchnext.comms import native as native_ext
from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.testing.faults import Fault, FaultKind, FaultPoint
from torchnext.testing.ft_parallel import ParallelSpec, ddp_expected_weights, run_parallel
from torchnext.testing.ft_workload import FTJob

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

KILL, STOP = FaultKind.KILL, FaultKind.STOP
IDLE, COLL = FaultPoint.IDLE, FaultPoint.COLLECTIVE


def _coordinator(n: int) -> Coordinator:
    return Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=n)))


def _spec(coord: Coordinator, member: int, steps: int, faults: list[Fault], **kw: Any) -> ParallelSpec:
    return ParallelSpec(coordinator=coord.address, token=coord.token, store_port=coord.store_port, member_id=member,
                        steps=steps, faults=faults, parallel="ddp", **kw)


def check_ddp_survivors(reports: dict[int, dict[str, Any]]) -> list[int]:
    """Survivors agree, hold bitwise-equal parameters, and those equal the exact replay of their commit record."""
    ok = {m: r for m, r in reports.items() if r["error"] is None}
    assert ok, f"no survivor: {reports}"
    first = next(iter(ok.values()))
    for m, r in ok.items():
        assert r["step"] == first["step"] and r["digest"] == first["digest"], f"member {m} differs from the others"
        assert r["history"] == first["history"] or r["history"] == first["history"][-len(r["history"]):], m
    steps = [s for s, _ in first["history"]]
    assert steps == list(range(first["step"])), f"gap or duplicate in the committed steps {steps}"
    replay = ddp_expected_weights([[m for g in groups for m in g] for _, groups in first["history"]])
    for i, (got, want) in enumerate(zip(first["params"], replay, strict=True)):
        assert torch.equal(torch.tensor(got, dtype=torch.float64), want), f"parameter {i} differs from the exact replay of the committed steps"
    return sorted(ok)


def _run(n: int, steps: int, faults: list[Fault], **kw: Any) -> dict[int, dict[str, Any]]:
    with _coordinator(n) as coord, FTJob() as job:
        for m in range(n):
            job.launch(_spec(coord, m, steps, faults, **kw), run_parallel)
        return job.wait(list(range(n)), timeout=150)


def test_no_fault_equals_the_replay() -> None:
    reports = _run(2, 4, [])
    assert check_ddp_survivors(reports) == [0, 1]
    assert all(len(g) == 2 for _, g in reports[0]["history"])
    if native_ext.status().available:  # the C++ comm hook (tests/ft/test_ft_ddp_native.py); no used map by default
        counts = reports[0]["ddp_counts"]
        assert counts is not None and counts["bucket_native"] > 0 and counts["used_map_native"] == 0, counts


def test_kill_inside_backward_during_bucket_all_reduce() -> None:
    """Member 2 dies inside backward of step 3 while the others are blocked in DDP's bucket all-reduces (issued by
    the C++ comm hook where the extension is available)."""
    reports = _run(4, 8, [Fault(kind=KILL, member=2, step=3, where=COLL)])
    assert check_ddp_survivors(reports) == [0, 1, 3]
    for m in (0, 1, 3):
        assert (reports[m]["ddp_counts"] is not None) == native_ext.status().available, reports[m]["ddp_counts"]
    sizes = [len(g) for _, g in reports[0]["history"]]
    assert sizes[:3] == [4, 4, 4] and sizes[-1] == 3, sizes


def test_sigstop_inside_backward_is_removed() -> None:
    """Member 1 hangs inside backward (SIGSTOP, 2 s): removed by heartbeat timeout, the others go on; when it
    resumes its late DDP all-reduces change nothing and it is told it was removed."""
    reports = _run(4, 16, [Fault(kind=STOP, member=1, step=3, where=COLL, seconds=2.0)], step_sleep_s=0.05)
    assert "you were removed" in (reports[1]["error"] or ""), reports[1]["error"]
    assert check_ddp_survivors({m: r for m, r in reports.items() if m != 1}) == [0, 2, 3]


@pytest.mark.parametrize("find_unused", [False, True], ids=["all-used", "find-unused"])
def test_two_kills_in_sequence_and_a_replacement_heals(tmp_path: Any, find_unused: bool) -> None:
    """Member 3 dies inside backward at step 2, member 0 between steps at step 5; a replacement (id 100, starting
    from garbage) joins, heals from a survivor and trains on with the same buckets -- with
    ``find_unused_parameters=False`` too: the survivors' buckets were rebuilt before their step 2, the replacement's
    first step is bucketed like theirs (ft/ddp.py pins the layout)."""
    faults = [Fault(kind=KILL, member=3, step=2, where=COLL), Fault(kind=KILL, member=0, step=5, where=IDLE)]
    stop = tmp_path / "stop"
    kw: dict[str, Any] = {"step_sleep_s": 0.01, "stop_file": str(stop), "find_unused_parameters": find_unused}
    with _coordinator(4) as coord, FTJob() as job:
        for m in range(4):
            job.launch(_spec(coord, m, 0, faults, **kw), run_parallel)
        assert coord.wait_until(lambda c: 0 not in c.members and 3 not in c.members and c.step >= 6, 90)
        job.launch(_spec(coord, 100, 0, [], **kw), run_parallel)
        assert coord.wait_until(lambda c: 100 in c.members and c.step >= 1, 90)
        step = coord.step
        stop.write_text(str(step + 4))
        reports = job.wait([0, 1, 2, 3, 100], timeout=120)
    assert sorted(reports) == [1, 2, 100]
    assert check_ddp_survivors({m: r for m, r in reports.items() if m != 100}) == [1, 2]
    assert reports[100]["digest"] == reports[1]["digest"] and reports[100]["step"] == reports[1]["step"]
    healed = [r for r in reports[100]["reconfigurations"] if r["healed"]]
    assert healed, reports[100]["reconfigurations"]
    assert [len(g) for _, g in reports[1]["history"]][-1] == 3

