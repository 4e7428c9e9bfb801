"""`torchnext demo` end to end: FSDP2 HSDP (2 replica groups x 2 shards) on the torchnext process group, a rank
SIGKILLed mid-training (--no-rejoin: its group leaves, the other trains on, nothing to compare), the group restarted
from warm spares (the default: healed shard by shard), FT-DDP with two faults in sequence (a kill, then a hang),
DiLoCo with a kill and a rejoin, and a --chaos run of three random faults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _run(args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "torchnext", "demo", "--quiet", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    for key in ("steps_completed", "initial_loss", "final_loss", "world_size_history", "failures",
                "params_equal_across_ranks", "final_members", "precision", "wall_s", "error"):
        assert key in summary, key
    assert summary["error"] is None
    summary["_stdout"] = " ".join(proc.stdout.split())  # rich wraps long lines
    return summary


def _check_failure(f: dict[str, Any], kind: str, rank: int, group: int, step: int) -> None:
    assert (f["kind"], f["rank"], f["group"], f["step"]) == (kind, rank, group, step), f
    for k in ("detect_s", "agree_s", "rebuild_s"):
        assert isinstance(f[k], float) and 0 <= f[k] < 30, f


@pytest.mark.timeout(200)
def test_hsdp_kill_one_rank_its_group_leaves_the_other_trains_on(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = _run(["--steps", "30", "--fault", "kill:2@10", "--no-rejoin"], out, timeout=180)
    assert summary["parallel"] == "hsdp" and summary["steps_completed"] == 30
    # rank 2 = rank 0 of replica group 1: killed; its sibling (member 3) was removed with it; group 0 finished
    assert summary["final_members"] == [0, 1] and summary["final_groups"] == [0]
    assert summary["removed_members"] == [3]
    # by default each replica group held one group session: its rank 0 spoke to the coordinator for rank 1
    assert summary["sessions"] == {"0": "leader", "1": "follower", "2": "leader", "3": "follower"}, summary["sessions"]
    (failure,) = summary["failures"]
    _check_failure(failure, "kill", 2, 1, 10)
    sizes = [(h["size"], h["ranks"]) for h in summary["world_size_history"]]
    assert sizes[0] == (2, 4) and sizes[-1] == (1, 2), sizes
    # one replica group finished: nothing to compare -- null with the reason, said on the console, exit 0
    assert summary["replica_groups_compared"] == 1
    assert summary["params_equal_across_ranks"] is None
    assert summary["params_equal_reason"] == "only 1 replica group finished: nothing to compare"
    assert "not compared: only 1 replica group finished: nothing to compare" in summary["_stdout"]
    assert summary["faults_survived"] == {"kill": 1}  # survived: the other group trained on
    assert summary["digests"]["0"] != summary["digests"]["1"]
    assert summary["final_loss"] < summary["initial_loss"] - 0.8
    assert (out / "loss.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "fr_shard" / "g0.i0").glob("*.json")) == [
        "torchnext_fr_rank_0.json", "torchnext_fr_rank_1.json"]  # group 0's own (shard) process group
    report = (out / "fr_report.txt").read_text()
    # one replicate communicator per group rank: ft.g1.r0 (members 0, 2) and ft.g1.r1 (members 1, 3); each
    # generation continues in its own lineage
    assert re.search(r"generation 1 \('ft\.g1\.r0@g1', members \[0, 2\]\) ended in a failure", report), report
    assert re.search(r"generation 1 \('ft\.g1\.r1@g1', members \[1, 3\]\) ended in a failure", report), report
    assert "rank 2 vanished (rank 2 left no dump)" in report, report
    assert "rank 3 dumped on abort" in report, report  # the sibling, removed with its group
    assert re.search(r"generation 2 \('ft\.g2\.r0@g2', members \[0\]\) formed [\d.]+ s later", report), report
    assert re.search(r"generation 2 \('ft\.g2\.r1@g2', members \[1\]\) formed [\d.]+ s later", report), report
    assert re.search(r"how: .*(connection closed|connection broke|reported a failed collective|missed heartbeats)", report), report


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hsdp_rejoin_the_restarted_group_heals_shard_by_shard(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = _run(["--steps", "30", "--fault", "kill:2@8"], out, timeout=220)  # rejoin: the default
    assert summary["steps_completed"] == 30
    # group 1 came back as members 6, 7 (slot + 4 * incarnation 1) and finished with group 0
    assert summary["final_members"] == [0, 1, 6, 7] and summary["final_groups"] == [0, 1]
    assert {m: summary["sessions"].get(m) for m in ("0", "1", "6", "7")} == {
        "0": "leader", "1": "follower", "6": "leader", "7": "follower"}, summary["sessions"]  # the restarted group too
    d = summary["digests"]
    assert d["6"] == d["0"] and d["7"] == d["1"], d  # parameters + AdamW state, bitwise, shard by shard
    assert d["0"] != d["1"]
    assert summary["params_equal_across_ranks"] is True and summary["params_equal_reason"] is None
    assert summary["replica_groups_compared"] == 2
    assert "True (2 replica groups compared)" in summary["_stdout"]
    sizes = [h["size"] for h in summary["world_size_history"]]
    assert sizes[0] == 2 and sizes[-1] == 2, sizes  # (a step alone in between: likely, not certain -- fast spares)
    (failure,) = summary["failures"]
    _check_failure(failure, "kill", 2, 1, 8)
    assert isinstance(failure["rejoined_s"], float) and failure["rejoined_s"] >= failure["recovery_s"] > 0, failure
    assert summary["faults_survived"] == {"kill": 1}
    assert summary["final_loss"] < summary["initial_loss"] - 0.8
    report = (out / "fr_report.txt").read_text()
    assert "rank 6 joined" in report and "rank 7 joined" in report, report


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_two_faults_a_kill_then_a_hang(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = _run(["--parallel", "ddp", "--steps", "16", "--fault", "kill:1@4", "--fault", "hang:3@8",
                    "--no-rejoin"], out, timeout=220)
    assert summary["parallel"] == "ddp" and summary["steps_completed"] == 16
    assert summary["final_members"] == [0, 2]
    assert set(summary["sessions"].values()) == {"flat"}, summary["sessions"]  # every DDP rank its own group
    assert summary["removed_members"] == [3]  # resumed after its removal, it was told so and left
    kill, hang = summary["failures"]
    _check_failure(kill, "kill", 1, 1, 4)
    _check_failure(hang, "hang", 3, 3, 8)
    assert [h["size"] for h in summary["world_size_history"]] == [4, 3, 2]
    assert summary["params_equal_across_ranks"] is True and len(set(summary["digests"].values())) == 1
    assert summary["final_loss"] < summary["initial_loss"] - 0.5


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diloco_kill_and_rejoin_groups_end_on_the_same_global_copy(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = _run(["--parallel", "diloco", "--steps", "30", "--sync-every", "5", "--fault", "kill:3@8", "--rejoin"],
                   out, timeout=220)
    assert summary["parallel"] == "diloco" and summary["steps_completed"] == 30
    assert summary["removed_members"] == [2]  # rank 3's sibling: its inner FSDP2 collective failed
    assert summary["final_members"] == [0, 1, 6, 7]
    assert {m: summary["sessions"].get(m) for m in ("0", "1", "6", "7")} == {
        "0": "leader", "1": "follower", "6": "leader", "7": "follower"}, summary["sessions"]
    d = summary["digests"]  # parameters, global copy, outer optimizer: shard by shard after the last sync
    assert d["6"] == d["0"] and d["7"] == d["1"] and d["0"] != d["1"], d
    assert summary["params_equal_across_ranks"] is True
    (failure,) = summary["failures"]
    _check_failure(failure, "kill", 3, 1, 8)
    assert summary["final_loss"] < summary["initial_loss"] - 0.8


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                pids.append(int(d.name))
    return pids


@pytest.mark.timeout(120)
def test_a_timeout_is_a_clear_error_and_leaves_no_process_behind(tmp_path: Path) -> None:
    out = tmp_path / "demo-timeout"
    proc = subprocess.run([sys.executable, "-m", "torchnext", "demo", "--quiet", "--no-fault", "--rejoin", "--steps",
                           "500", "--timeout", "6", "--out", str(out)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not finish within 6 s" in " ".join(proc.stdout.split()), proc.stdout
    assert _processes_mentioning(str(out)) == []  # every rank (and spare) killed and reaped
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] is not None and "did not finish" in summary["error"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_coordinator_killed_the_standby_takes_over_and_training_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = _run(["--steps", "24", "--fault", "coordinator@8"], out, timeout=180)
    assert summary["steps_completed"] == 24
    (failure,) = summary["failures"]
    assert (failure["kind"], failure["step"]) == ("coordinator", 8), failure
    assert isinstance(failure["takeover_s"], float) and 0 <= failure["takeover_s"] < 5, failure
    assert isinstance(failure["next_commit_s"], float) and 0 <= failure["next_commit_s"] < 30, failure
    # nobody was lost: both replica groups finished, counterparts equal
    assert summary["final_members"] == [0, 1, 2, 3] and summary["removed_members"] == []
    assert summary["replica_groups_compared"] == 2 and summary["params_equal_across_ranks"] is True
    history = json.loads((out / "coordinator_history.json").read_text())
    assert any(h["event"] == "takeover" for h in history)


def _netns() -> tuple[bool, str]:
    from torchnext.testing.netns import available

    return available()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.skipif(not _netns()[0], reason=f"network namespaces unavailable: {_netns()[1]}")
def test_partition_cuts_a_ranks_host_off_its_group_leaves_and_a_restarted_group_heals(tmp_path: Path) -> None:
    from torchnext.testing.netns import PREFIX

    def labs() -> set[str]:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        return {line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)}

    before = labs()
    out = tmp_path / "demo"
    summary = _run(["--steps", "36", "--fault", "partition:2@10", "--rejoin"], out, timeout=180)
    assert summary["steps_completed"] == 36
    (failure,) = summary["failures"]
    assert (failure["kind"], failure["rank"], failure["group"], failure["step"]) == ("partition", 2, 1, 10), failure
    # the cut-off rank and its sibling left with their group (the demo's heartbeat timeout is 2 s), and the group
    # restarted from spares on their own hosts healed and trained on
    assert isinstance(failure["removed_s"], float) and 1.5 <= failure["removed_s"] < 20, failure
    assert 3 in summary["removed_members"]  # the sibling; the cut-off rank says so once reconnected (may be after the end)
    assert summary["final_members"] == [0, 1, 6, 7] and summary["replica_groups_compared"] == 2
    assert summary["params_equal_across_ranks"] is True
    assert labs() <= before, "the demo left network namespaces behind"


@pytest.mark.timeout(300)
def test_chaos_three_random_faults_are_survived_and_the_groups_end_equal(tmp_path: Path) -> None:
    from torchnext.demo.launcher import DemoConfig

    out = tmp_path / "demo"
    # the first seed whose schedule here (the pool depends on root + network namespaces) mixes kills and hangs:
    # no network lab (slow to set up) and no coordinator fault (its failover has a known flake: members waiting
    # 60 s for a generation after the standby took office -- tests/demo/..._the_standby_takes_over covers it)
    seed = next(s for s in range(1000)
                if {f.kind for f in DemoConfig(chaos=3, seed=s, steps=44).schedule()} == {"kill", "hang"})
    args = ["--chaos", "3", "--seed", str(seed), "--steps", "44", "--precision", "bf16", "--batch-size", "4",
            "--seq-len", "32", "--timeout", "200"]  # a stall: the demo's own error and log tail, not a bare timeout
    scheduled = [str(f) for f in DemoConfig(chaos=3, seed=seed, steps=44).schedule()]
    summary = _run(args, out, timeout=280)
    assert summary["steps_completed"] == 44 and summary["chaos"] == 3
    assert summary["faults_scheduled"] == scheduled and summary["faults_injected"] == 3
    assert sum(summary["faults_survived"].values()) == 3, summary["failures"]
    kinds = [f["kind"] for f in summary["failures"]]
    assert summary["faults_survived"] == {k: kinds.count(k) for k in set(kinds)}
    at = [int(f.split("@")[1]) for f in scheduled]
    assert [f["step"] for f in summary["failures"]] == at
    fired = [f["fired_step"] for f in summary["failures"]]
    assert all(a <= b for a, b in zip(at, fired, strict=True)) and fired == sorted(set(fired)), fired
    for f in summary["failures"]:
        assert isinstance(f["recovery_s"], float) and 0 < f["recovery_s"] < 30, f
    # every killed or hung group came back: both replica groups finished, shard by shard equal
    assert summary["replica_groups_compared"] == 2 and summary["params_equal_across_ranks"] is True
    assert len(summary["final_members"]) == 4
    rec = summary["recovery_s"]
    assert rec["n"] == 3 and 0 < rec["p50"] <= rec["p99"] < 30, rec
    res = summary["resources"]
    assert res is not None and res["member"] in summary["final_members"] and res["to_step"] == 44, res
    assert all(isinstance(v, int) and v > 0 for v in (*res["threads"], *res["fds"])), res
    assert "faults survived 3 of 3" in summary["_stdout"], summary["_stdout"]
    assert "p50" in summary["_stdout"] and "threads" in summary["_stdout"]
