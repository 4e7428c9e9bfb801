"""Fault tolerance end to end: 4 member processes, an in-process coordinator, scripted faults.

After every scenario the survivors must agree on generation and members, hold bitwise-equal states, and their
weights must equal the exact replay of the committed steps (no committed step lost or applied twice).
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest
import torch

from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.testing.faults import Fault, FaultKind, FaultPoint
from torchnext.testing.ft_workload import FTJob, WorkerSpec, expected_weights

pytestmark = pytest.mark.timeout(240)

KILL, STOP, RAISE = FaultKind.KILL, FaultKind.STOP, FaultKind.RAISE
IDLE, COLL, RECONF, HEAL = FaultPoint.IDLE, FaultPoint.COLLECTIVE, FaultPoint.RECONFIGURE, FaultPoint.HEALING


def _coordinator(n: int, min_size: int = 2, **kw: Any) -> Coordinator:
    return Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=min_size, initial_size=n, **kw)))


def _spec(coord: Coordinator, member: int, steps: int, faults: list[Fault], **kw: Any) -> WorkerSpec:
    return WorkerSpec(coordinator=coord.address, token=coord.token, member_id=member, steps=steps, faults=faults,
                      **kw)


def check_survivors(reports: dict[int, dict[str, Any]], history: list[dict[str, Any]],
                    expect_members: list[int] | None = None) -> list[int]:
    """Agreement, bitwise-equal state, exact replay of the committed steps. Returns the survivors' member ids."""
    ok = {m: r for m, r in reports.items() if r["error"] is None}
    assert ok, f"no survivor: {reports}"
    first = next(iter(ok.values()))
    for m, r in ok.items():
        assert r["generation"] == first["generation"], (m, r["generation"], first["generation"])
        assert r["members"] == first["members"], (m, r["members"], first["members"])
        assert r["digest"] == first["digest"], f"member {m}'s state differs"
        assert r["step"] == first["step"] and r["applied"] == r["step"], (m, r["step"], r["applied"])
    if expect_members is not None:
        assert first["members"] == expect_members
    # The coordinator's record: generation -> members, and the first step each generation committed.
    gen_members = {h["gen"]: h["members"] for h in history if h["event"] == "generation"}
    firsts = sorted((h["step"], h["gen"]) for h in history if h["event"] == "first_commit")
    final = first["step"]
    step_gen = {s: max(g for f, g in firsts if f <= s) for s in range(final)}
    # Every survivor's own commit log must be gap-free and agree with the coordinator's record.
    for m, r in ok.items():
        steps = [s for _, s, _ in r["commits"]]
        assert steps == list(range(steps[0], steps[0] + len(steps))), f"member {m}: gap or duplicate in {steps}"
        for g, s, _ in r["commits"]:
            assert step_gen[s - 1] == g, f"member {m} committed step {s - 1} in generation {g}, not {step_gen[s - 1]}"
            assert r["generations"].get(g, gen_members[g]) == gen_members[g]
    replay = expected_weights([gen_members[step_gen[s]] for s in range(final)])
    assert torch.equal(replay, torch.tensor(first["w"], dtype=torch.float64)), "weights differ from the exact replay"
    return sorted(ok)


def _run(n: int, steps: int, faults: list[Fault], *, min_size: int = 2, timeout: float = 90, **spec_kw: Any,
         ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    with _coordinator(n, min_size) as coord, FTJob() as job:
        for m in range(n):
            job.launch(_spec(coord, m, steps, faults, **spec_kw))
        reports = job.wait(list(range(n)), timeout=timeout)
        return reports, coord.history()


def test_kill_idle_then_inside_allreduce() -> None:
    """Kill one while idle (step 4), then a second one inside all_reduce (step 9): two failures in sequence."""
    faults = [Fault(kind=KILL, member=2, step=4, where=IDLE), Fault(kind=KILL, member=3, step=9, where=COLL)]
    reports, history = _run(4, 16, faults, split=True)
    assert sorted(reports) == [0, 1]
    check_survivors(reports, history, [0, 1])
    gens = [h for h in history if h["event"] == "generation"]
    assert [g["members"] for g in gens[:3]] == [[0, 1, 2, 3], [0, 1, 3], [0, 1]]
    # split children were invalidated with a clear error at each reconfiguration
    assert reports[0]["split_invalidated"] and "aborted" in reports[0]["split_invalidated"][0]


def test_kill_inside_reconfiguration() -> None:
    """Member 1 crashes at step 4; member 3 crashes while the survivors build generation 2."""
    faults = [Fault(kind=KILL, member=1, step=4, where=IDLE), Fault(kind=KILL, member=3, step=4, where=RECONF)]
    reports, history = _run(4, 12, faults)
    check_survivors(reports, history, [0, 2])
    # member 3 died after generation 2 ([0, 2, 3]) was announced, i.e. while the survivors were building it
    gen2 = next(h for h in history if h["event"] == "generation" and h["gen"] == 2)
    died = next(h for h in history if h["event"] == "failure" and h["member"] == 3)
    assert 3 in gen2["members"] and died["at"] >= gen2["at"]


def test_injected_collective_exception_regenerates_same_members() -> None:
    faults = [Fault(kind=RAISE, member=1, step=3, where=COLL)]
    reports, history = _run(3, 8, faults)
    check_survivors(reports, history, [0, 1, 2])
    assert any(h["event"] == "report" and "injected" in h["reason"] for h in history)
    assert max(h["gen"] for h in history if h["event"] == "generation") >= 2


def test_sigstop_member_is_removed_and_told_so_after_sigcont() -> None:
    """A member hangs inside all_reduce; it is declared failed within the heartbeat timeout, the others continue;
    when it resumes it gets "you were removed" and the survivors' state is untouched (no zombie write)."""
    faults = [Fault(kind=STOP, member=3, step=4, where=COLL, seconds=1.5)]
    with _coordinator(4) as coord, FTJob() as job:
        for m in range(4):
            job.launch(_spec(coord, m, 30, faults, step_sleep_s=0.05))
        reports = job.wait([0, 1, 2, 3], timeout=90)
        history = coord.history()
    assert "you were removed" in (reports[3]["error"] or ""), reports[3]["error"]
    check_survivors({m: r for m, r in reports.items() if m != 3}, history, [0, 1, 2])
    hung = [h for h in history if h["event"] == "failure" and h["member"] == 3]
    assert hung and hung[0]["hung"]


def test_replacement_joins_and_heals_while_donor_dies() -> None:
    """Member 3 crashes; a replacement (id 100) joins at the next commit; the donor (member 0) crashes while
    healing it; member 1 heals it instead. The replacement started from garbage and must end bitwise-equal."""
    faults = [Fault(kind=KILL, member=3, step=3, where=IDLE), Fault(kind=KILL, member=0, step=3, where=HEAL)]
    with _coordinator(4) as coord, FTJob() as job:
        for m in range(4):
            job.launch(_spec(coord, m, 10, faults, step_sleep_s=0.01, run_until_member=100, state_mib=4))
        assert coord.wait_until(lambda c: 3 not in c.members and c.generation >= 2, 60)
        job.launch(_spec(coord, 100, 10, faults, step_sleep_s=0.01, run_until_size=3, state_mib=4))
        reports = job.wait([0, 1, 2, 3, 100], timeout=90)
        history = coord.history()
    assert sorted(reports) == [1, 2, 100], [(h["event"], h.get("member"), h.get("members"), h.get("reason", "")[:60])
                                            for h in history if h["event"] != "first_commit"]
    check_survivors(reports, history, [1, 2, 100])
    healed = [r for r in reports[100]["reconfigurations"] if r["healed"]]
    assert healed and healed[0]["healed"][0] > 4 << 20


def test_quorum_lost_below_min_size() -> None:
    faults = [Fault(kind=KILL, member=1, step=3, where=IDLE), Fault(kind=KILL, member=2, step=3, where=IDLE)]
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=3,
                                                                   quorum_timeout_s=1.0))) as coord, FTJob() as job:
        for m in range(3):
            job.launch(_spec(coord, m, 50, faults, step_sleep_s=0.01))
        reports = job.wait([0, 1, 2], timeout=60)
    assert "QuorumLost" in (reports[0]["error"] or ""), reports[0]
    assert reports[0]["step"] < 50


def test_chaos_20_random_failures_fixed_seed(tmp_path: Any) -> None:
    """20 random failure schedules (seeded): after a random delay, a random current member is SIGKILLed, SIGSTOPped
    (and SIGCONTed after its removal) or made to raise inside a collective (SIGUSR1); a removed member is replaced
    at once; the next schedule starts when the group is back to 4 members. One long job: processes are reused."""
    rng = random.Random(1234)
    stop_file = tmp_path / "stop"
    kw: dict[str, Any] = {"step_sleep_s": 0.002, "stop_file": str(stop_file), "sigusr1_raises": True}
    next_id = 100
    kinds: list[str] = []
    with _coordinator(4, min_size=2) as coord, FTJob() as job:
        for m in range(4):
            job.launch(_spec(coord, m, 0, [], **kw))
        assert coord.wait_until(lambda c: c.generation >= 1 and c.step >= 2, 60)
        for _ in range(20):
            members = list(coord.members)
            victim = rng.choice(members)
            kind = rng.choice(["kill", "kill", "raise", "stop"])
            kinds.append(kind)
            time.sleep(rng.uniform(0.02, 0.2))
            gen = coord.generation
            pid = job.pid(victim)
            if kind == "raise":
                os.kill(pid, signal.SIGUSR1)
                assert coord.wait_until(lambda c, g=gen: c.generation > g, 30), "injected raise never regenerated"
            else:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                assert coord.wait_until(lambda c, v=victim: v not in c.members, 30)
                if kind == "stop":
                    os.kill(pid, signal.SIGCONT)
                job.launch(_spec(coord, next_id, 0, [], **kw))
                next_id += 1
            assert coord.wait_until(lambda c: len(c.members) == 4 and c.step > 0, 60), coord.members
        stop_file.write_text(str(coord.step + 20))
        everyone = sorted(job.procs)
        reports = job.wait(everyone, timeout=120)
        history = coord.history()
    survivors = check_survivors(reports, history)
    assert len(survivors) == 4
    removed = [m for m, r in reports.items() if r["error"]]
    assert all("you were removed" in reports[m]["error"] for m in removed), {m: reports[m]["error"] for m in removed}
    assert len(removed) == kinds.count("stop")
