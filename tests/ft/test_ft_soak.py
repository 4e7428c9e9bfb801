"""The soak at CI size (issue 24): 100 seeded faults -- kill, hang, raise, partition (root + network namespaces only),
coordinator kill -- across one FT-HSDP and one FT-DDP job in about three minutes on two cores, with every check of
``benchmarks/ft/bench_soak.py`` (:mod:`torchnext.testing.soak`) -- the commit-gap bound loosened to the stalls that
are bugs (a timing goal is the benchmark's: see the test). At this size the survivor's resource counts are
compared from after the first 20 faults (not 100: the warm-up point the benchmark uses), to the end.

Every wait inside is bounded (``wait_s``; a stalled job stops the soak and fails it with what it waited for), and
every process -- members, spares, coordinators, network namespaces -- is reaped before ``run_soak`` returns, also
when it fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from torchnext.testing.ft_parallel import ddp_expected_weights
from torchnext.testing.procfs import is_stopped as _stopped
from torchnext.testing.soak import Injected, SoakConfig, SoakFault, SoakResult, gap_phases, plan, run_soak
from torchnext.testing.soak_checks import check_job, resources_flat


def test_plan_is_seeded_and_spread() -> None:
    cfg = SoakConfig(faults=50, minutes=1.0, seed=7)
    a, b = plan(cfg), plan(cfg)
    assert a == b and len(a) == 50
    assert all(0 <= p.at < 60 for p in a) and [p.at for p in a] == sorted(p.at for p in a)
    assert {p.job for p in a} == {"hsdp", "ddp"} and len({p.kind for p in a}) == len(SoakFault)
    assert plan(SoakConfig(faults=50, minutes=1.0, seed=8)) != a
    assert all(p.kind is not SoakFault.PARTITION for p in plan(cfg, [SoakFault.KILL, SoakFault.HANG]))


def test_checks_fail_when_nothing_is_compared() -> None:
    """Fewer than two finishing groups, or a missing resource sample: the check is not made, and it is a failure."""
    one = {0: {"member": 0, "group": 0, "group_rank": 0, "error": None, "commits": [[1, 1, 0.0]], "generations": {},
               "history": [[0, [[0]]]], "step": 1, "generation": 1,
               "params": [w.tolist() for w in ddp_expected_weights([[0]])], "digest": "x", "optim_steps": [],
               "max_commit_gap": [0.0, -1, 0.0]}}
    rep = check_job("ddp", one, [{"member": 0, "gen": 1, "members": [0], "step": 0, "commit": 0.0}], survivor=0,
                    expected_kill=(), group_size=1)
    assert rep["oracle"]["ok"] is True and rep["oracle"]["replayed_steps"] == 1, rep["oracle"]
    assert rep["counterparts"]["ok"] is False and "not made" in rep["counterparts"]["why"]
    assert resources_flat(None, {"threads": 1}, 0.05)["ok"] is False
    base = {"threads": 10, "fds": 20, "rss_kib": 1000, "faults": 20}
    assert resources_flat(base, dict(base, faults=100, rss_kib=1049), 0.05)["ok"] is True
    assert resources_flat(base, dict(base, faults=100, fds=21), 0.05)["ok"] is False
    assert resources_flat(base, dict(base, faults=100, fds=19, threads=9), 0.05)["ok"] is True  # fewer is fine
    assert resources_flat(base, dict(base, faults=100, fds=60), 0.05, 0.75)["ok"] is True
    assert resources_flat(base, dict(base, faults=100, fds=20 + 8 * 80), 0.05, 0.75)["ok"] is False  # the old leak


def test_resource_check_counts_no_waiter_but_bounds_them_and_compares_at_full_membership() -> None:
    """A communicator's lazily started completion waiter is not growth, more waiters than live communicators is;
    the warm-up sample is one taken with every replica group in (a victim not yet back has fewer pair sockets)."""
    from types import SimpleNamespace

    from torchnext.testing.soak import _Job, _warm_sample

    base = {"threads": 10, "fds": 20, "rss_kib": 1000, "faults": 20, "live_comms": 2, "py_threads": {"MainThread": 1}}
    waited = dict(base, faults=100, threads=11, py_threads={"MainThread": 1, "torchnext-comms-waiter": 1})
    assert resources_flat(base, waited, 0.05)["ok"] is True
    assert resources_flat(base, dict(waited, py_threads={"MainThread": 1}), 0.05)["ok"] is False  # another thread
    assert resources_flat(base, dict(base, faults=100, live_comms=4), 0.05)["ok"] is True  # mid-replacement: 2 more
    kept = resources_flat(base, dict(base, faults=100, live_comms=5), 0.05)  # superseded generations kept alive
    assert kept["ok"] is False and kept["live_comms"] == {"base": 2, "end": 5, "ok": False}
    pool = dict(base, faults=100, threads=12, thread_names={"tn-waiter": 2})  # a native pool grew by 2: not growth
    assert resources_flat(base, pool, 0.05)["ok"] is True
    assert resources_flat(base, dict(pool, threads=13), 0.05)["ok"] is False  # and one thread more besides
    assert resources_flat(base, dict(pool, threads=19, thread_names={"tn-waiter": 9}), 0.05)["ok"] is False  # > 4/comm
    three = dict(waited, threads=13, py_threads={"torchnext-comms-waiter": 3})
    assert resources_flat(base, three, 0.05)["ok"] is False  # 3 waiters for 2 communicators
    faults = [Injected(index=i, job="ddp", kind=SoakFault.KILL, victim="m", at=float(i)) for i in range(4)]
    job = SimpleNamespace(kind="ddp", n_groups=3, gsize=1, samples={
        "before 1": {"members": 2}, "before 2": {"members": 3}, "before 3": {"members": 3}})
    job.size = _Job.size.fget(job)  # type: ignore[attr-defined]  # the job's own rule: 3 groups x 1
    assert _warm_sample(job, faults, 1) == "before 2"  # type: ignore[arg-type]
    job.samples["before 2"]["members"] = 2
    assert _warm_sample(job, faults, 1) == "before 3"  # type: ignore[arg-type]
    job.samples["before 3"]["members"] = 2
    assert _warm_sample(job, faults, 1) == "before 1"  # type: ignore[arg-type]  # none full: the first
    hsdp = SimpleNamespace(kind="ddp", n_groups=2, gsize=2, samples={"before 1": {"members": 2}, "before 2": {"members": 4}})
    hsdp.size = _Job.size.fget(hsdp)  # type: ignore[attr-defined]  # ranks: 2 groups x 2
    assert _warm_sample(hsdp, faults, 1) == "before 2"  # type: ignore[arg-type]  # ranks: 2 groups x 2


def _gapped_job(heal_step: int | None, hist1: list[int]) -> dict[str, object]:
    """Member 0 commits steps 0..4; member 1 is left out of generation 2 (step 2) and rejoins in generation 3 at
    step 3, healed there when ``heal_step`` is 3."""
    members = {1: [0, 1], 2: [0], 3: [0, 1]}
    first = {1: 0, 2: 2, 3: 3}
    step_members = [members[1], members[1], members[2], members[3], members[3]]
    params = [w.tolist() for w in ddp_expected_weights(step_members)]

    def rep(m: int, hist: list[int]) -> dict[str, object]:
        gen_of = {s: (1 if s < 2 else 2 if s < 3 else 3) for s in range(5)}
        return {"member": m, "group": m, "group_rank": 0, "error": None, "step": 5, "generation": 3,
                "commits": [[gen_of[s], s + 1, 0.0] for s in hist], "history": [[s, [[0]]] for s in hist],
                "generations": {g: [[x] for x in members[g]] for g in members if g != 2 or m == 0},
                "reconfigurations": [] if m == 0 or heal_step is None else
                [{"gen": 3, "step": heal_step, "joiners": [1], "healed": [8, 0.0], "groups": [[0], [1]]}],
                "params": params, "digest": "x", "optim_steps": [], "max_commit_gap": [0.0, -1, 0.0]}

    events = [{"member": 0, "gen": g, "members": members[g], "step": first[g], "commit": 0.0} for g in members]
    return check_job("ddp", {0: rep(0, [0, 1, 2, 3, 4]), 1: rep(1, hist1)}, events, survivor=0, expected_kill=(),
                     group_size=1)["oracle"]


def test_oracle_accepts_a_gap_only_where_the_member_was_healed() -> None:
    ok = _gapped_job(3, [0, 1, 3, 4])
    assert ok["ok"] is True and ok["healed_gaps"] == 1, ok
    unhealed = _gapped_job(None, [0, 1, 3, 4])
    assert unhealed["ok"] is False and "gap (not healed to that step)" in unhealed["problems"][0], unhealed
    elsewhere = _gapped_job(4, [0, 1, 3, 4])  # healed, but to another step than the one after the gap
    assert elsewhere["ok"] is False, elsewhere
    dup = _gapped_job(3, [0, 1, 1, 3, 4])
    assert dup["ok"] is False and "duplicate" in dup["problems"][0], dup


def test_a_hang_victim_is_seen_stopped_or_running() -> None:
    """What the harness checks while it waits for a hang victim's removal (``_keep_stopped``)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def state_is(stopped: bool) -> bool:
            deadline = time.monotonic() + 10
            while _stopped(proc.pid) != stopped and time.monotonic() < deadline:
                time.sleep(0.01)
            return _stopped(proc.pid) == stopped

        assert state_is(False)
        proc.send_signal(signal.SIGSTOP)
        assert state_is(True)
        proc.send_signal(signal.SIGCONT)
        assert state_is(False)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not _stopped(proc.pid)  # gone


def test_long_gaps_name_what_happened_in_them() -> None:
    """A survivor's long gap lists the faults and harness launches of both jobs that began in it (or just before)."""
    faults = [Injected(index=0, job="ddp", kind=SoakFault.HANG, victim="member 1", at=9.0),
              Injected(index=1, job="hsdp", kind=SoakFault.KILL, victim="member 3 (group 1)", at=20.0)]
    res = SoakResult(config={}, faults=faults, jobs={
        "hsdp": {"long_gaps": [[1.5, 7, 10.0]], "launches": [[9.5, "spare group 4"], [3.0, "group 0"]]},
        "ddp": {"long_gaps": [[1.2, 30, 21.0]], "launches": [[10.5, "standby coordinator A"]]}})
    gaps = res.long_gaps()
    assert [(g["job"], g["step"]) for g in gaps] == [("hsdp", 7), ("ddp", 30)]  # longest first
    assert gaps[0]["faults"] == ["1.00s ddp hang member 1"]  # the other job's fault counts: one machine
    assert gaps[0]["launches"] == ["0.50s hsdp spare group 4"]  # 10.5 is after the gap ended; 3.0 long before
    assert gaps[1]["faults"] == ["1.00s hsdp kill member 3 (group 1)"] and gaps[1]["launches"] == []
    assert res.to_json()["long_gaps"] == gaps


def test_a_long_gap_splits_the_survivors_reconfigurations_into_phases() -> None:
    """The reconfigurations that began in a gap, each as wait / build / heal / to_commit; those outside are left."""
    reconfs = [{"gen": 4, "reason": "grow: joined [7]", "joiners": [7],
                "timings": {"start": 10.3, "built": 10.9, "healed": 11.0}},
               {"gen": 3, "reason": "removed", "joiners": [], "timings": {"start": 9.0, "interrupt": 8.9, "built": 9.2,
                                                                          "healed": 9.2}}]
    res = SoakResult(config={}, jobs={"hsdp": {"long_gaps": [[1.5, 7, 11.5]], "survivor_reconfigurations": reconfs}})
    (gap,) = res.long_gaps()
    (ph,) = gap["reconfigurations"]  # generation 3 began before the gap (at 9.0 < 10.0)
    assert ph == {"gen": 4, "reason": "grow: joined [7]", "joiners": [7], "wait": 0.3, "interrupted": None,
                  "build": 0.6, "heal": 0.1, "to_commit": 0.5}
    assert gap_phases(reconfs, 8.0, 9.5)[0]["interrupted"] == 0.1


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_soak_100_faults() -> None:
    # growth_per_fault 0.05 (4 fds over the 80 faults compared; the benchmark's bound is 0): one of three runs under
    # load 11-14 failed an exact bound. The leak fixed in issue 24 (4.9 threads, 8 fds per fault) and the traceback
    # cycles found after it (a whole Gloo device, ~5 fds, per failed op until a full collection) fail this.
    # max_gap_s 5 (the benchmark's bound is heartbeat timeout + 1 s = 1.6 s): a timing goal is the benchmark's to
    # judge. Here two jobs' nine training processes keep both cores busy, and the harness's own launches -- a
    # standby coordinator imports torch (2.6 s of CPU), a spare group builds FSDP -- starved the HSDP survivor for
    # 1.6-1.8 s in most runs (2026-12-03, two runs analysed: each longest gap was a slow step beside a recovery --
    # 0.85 s and 1.73 s with no fault in them -- not a slow recovery). 5 s still fails the stalls that are bugs: a
    # lost abort waits out the op timeout (30 s), a generation built only after some timeout ran out.
    cfg = SoakConfig(faults=100, minutes=2.0, seed=2424, warmup_faults=20, wait_s=20.0, growth_per_fault=0.05,
                     max_gap_s=5.0)
    result = run_soak(cfg)
    summary = {"errors": result.errors, "skipped": result.skipped, "recovery": result.recovery(),
               "failed": {k: c for k, c in result.checks.items() if not c["ok"]}, "seconds": round(result.seconds)}
    assert result.checks, summary
    assert result.ok, json.dumps(summary, indent=1, default=str)[:8000]
    # the HSDP job ran on group sessions (the default: its survivor, whose resources were checked flat, is group 0's
    # leader); every DDP member is a replica group of one rank
    hsdp, ddp = result.jobs["hsdp"]["sessions"], result.jobs["ddp"]["sessions"]
    assert set(hsdp) == {"leader", "follower"}, hsdp  # (counts differ: a SIGKILLed rank leaves no report)
    assert set(ddp) == {"flat"}, ddp


def test_a_spare_builds_at_sched_idle_and_every_thread_returns_when_its_go_file_appears(tmp_path) -> None:
    """A warm spare started beside the running job waits at SCHED_IDLE (its start took ~1 s of CPU from the members
    of a 2-core machine, their commit gaps grew past the bound), with the threads it started meanwhile; the moment
    its go-file appears every one of them is back at SCHED_OTHER -- also while it is still building. Where the way
    back is refused it changes nothing."""
    import os

    from torchnext.testing import ft_parallel

    go = tmp_path / "go"
    seen: dict[str, object] = {}

    def spare() -> None:
        idle = ft_parallel._IdleUntil.start(str(go))
        seen["idle_until"] = idle
        if idle is None:
            return
        seen["main"] = os.sched_getscheduler(0)
        building = threading.Event()
        policies: list[int] = []

        def backend_thread() -> None:  # started while idle: inherits it (like a backend's threads)
            policies.append(os.sched_getscheduler(0))
            building.wait(10)
            policies.append(os.sched_getscheduler(0))

        worker = threading.Thread(target=backend_thread)
        worker.start()
        deadline = time.monotonic() + 10
        while len(policies) < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        go.touch()  # the harness starts this spare while it is still "building"
        while os.sched_getscheduler(0) == os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.001)  # no finish() yet: the watcher alone brought us back
        seen["main_after"] = os.sched_getscheduler(0)
        building.set()
        worker.join(10)
        seen["worker"] = policies
        seen["moved"] = idle.finish()

    t = threading.Thread(target=spare)
    t.start()
    t.join(20)
    if seen["idle_until"] is None:  # unprivileged with RLIMIT_NICE < 20: the probe said no, nothing was changed
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        return
    assert seen["main"] == os.SCHED_IDLE and seen["main_after"] == os.SCHED_OTHER
    assert seen["worker"] == [os.SCHED_IDLE, os.SCHED_OTHER]
    assert seen["moved"] == 2  # the spare's thread and its backend thread


def test_a_spare_whose_go_file_is_there_before_it_starts_does_not_stay_idle(tmp_path) -> None:
    """A spare group launched and used at once finds its go-file already there: the watcher must not return the
    threads before the caller went idle (it found none, ended, and the caller went idle after it -- starved on a
    busy machine it never joined: "no spare group to commit within 20 s")."""
    import os

    from torchnext.testing import ft_parallel

    go = tmp_path / "go"
    go.touch()
    seen: dict[str, object] = {}

    def spare() -> None:
        for _ in range(20):  # the race is a matter of thread timing: try it often
            idle = ft_parallel._IdleUntil.start(str(go))
            if idle is None:
                seen["refused"] = True
                return
            deadline = time.monotonic() + 5
            while os.sched_getscheduler(0) == os.SCHED_IDLE and time.monotonic() < deadline:
                time.sleep(0.001)  # no finish(): the watcher alone must bring this thread back
            seen.setdefault("policies", []).append(os.sched_getscheduler(0))  # type: ignore[union-attr]
            idle.finish()
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

    t = threading.Thread(target=spare)
    t.start()
    t.join(120)
    if seen.get("refused"):  # unprivileged with RLIMIT_NICE < 20: nothing was changed
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        return
    assert seen["policies"] == [os.SCHED_OTHER] * 20


def test_a_spare_that_could_not_come_back_is_not_made_idle(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import os

    from torchnext.testing import ft_parallel

    real = os.sched_setscheduler

    def refuse_the_way_back(pid: int, policy: int, param: object) -> None:
        if policy == os.SCHED_OTHER:
            raise PermissionError(1, "Operation not permitted")
        real(pid, policy, param)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "sched_setscheduler", refuse_the_way_back)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append((ft_parallel._IdleUntil.start(str(tmp_path / "go")),
                                                    os.sched_getscheduler(0))))
    t.start()
    t.join(10)
    assert out == [(None, os.SCHED_OTHER)]
