"""torchtitan's llama3 debug model, fault tolerant on torchnext.ft (``FaultTolerantTrainer``, FT-HSDP over
``ft.device_mesh``): 2 replica groups x 2 CPU ranks, each group one ``torchnext run`` launch, one coordinator, 20
steps. Fault-free, and with a rank of group 1 SIGKILLed once it committed step 5: group 0 trains on without
restarting, committing every step exactly once; torchrun restarts group 1 (``--max-restarts 1``), which joins again,
is healed from group 0 and trains to the end -- its own checkpoint of step 3 loaded before the heal, never after it;
at the end both groups' parameters and optimizer states (torchtitan's own DCP checkpoints of step 20) are bitwise
equal; the steps committed before the kill have bitwise the losses of
the fault-free run."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.titan, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchnext[titan])")

from torchnext.testing import CoordinatorProcess  # noqa: E402
from torchnext.testing.torchtitan_cpu import CPU_FLAGS, LOSS_TAG, read_scalars, write_tiny_assets  # noqa: E402
from torchnext.testing.torchtitan_jobs import TitanJob, TitanResult, replica_group_env, run_jobs, worker_pids  # noqa: E402

STEPS, KILL_AFTER = 20, 5
TOKEN = "titan-ft-test-token"


def _committed(log: str, group: int) -> list[int]:
    """The steps ``group`` logged as committed, in log order (both ranks log each commit)."""
    return [int(m[1]) for m in re.finditer(rf"replica group {group} committed step (\d+) ", log)]


def _run(root: Path, name: str, tok: str, data: str, *, kill: bool) -> dict[str, Any]:
    killed: dict[str, Any] = {}
    # heartbeats as the demo's (0.25 s / 2 s): a survivor's heartbeat thread starved 0.62 s under the suite's load
    # beside two burners, and the default 0.6 s timeout removed the group that was to train on
    with CoordinatorProcess(TOKEN, initial_size=2, min_size=1, heartbeat_interval_s=0.25,
                            heartbeat_timeout_s=2.0) as coord:
        common = ["--module", "torchnext.integrations.torchtitan", "--config", "llama3_debugmodel_torchnext_ft",
                  "--hf_assets_path", tok, "--dataloader.dataset_path", data, "--training.steps", str(STEPS),
                  # 4 sequences a rank: steps long enough that torchrun's restart of group 1 (new processes,
                  # imports, build) ends well before group 0 reaches step 20 alone
                  "--training.seq_len", "128", "--training.local_batch_size", "4", *CPU_FLAGS, "--debug.seed", "0",
                  "--metrics.enable_tensorboard", "--metrics.save_for_all_ranks", "--fault_tolerance.replica_groups",
                  # a checkpoint every 3 steps: the killed group restarts with an older one of its own (step 3),
                  # which must not overwrite the state it is healed to (it did: loaded by train() after the heal)
                  "2", "--checkpoint.enable", "--checkpoint.interval", "3", "--comm.init_timeout_seconds", "120",
                  "--comm.train_timeout_seconds", "120"]
        jobs = [TitanJob(name=f"{name}-g{g}", launcher="torchnext", common=common,
                         runs=[["--dump_folder", str(root / name / f"g{g}")]],
                         launcher_args=["--max-restarts", "1"] if g == 1 else [],
                         env=replica_group_env(coord.address, TOKEN, g, root / "autotune.json"))
                for g in (0, 1)]

        def watch(launchers: dict[str, int]) -> None:
            g1 = f"{name}-g1"
            if not kill or killed or g1 not in launchers:
                return
            log = (root / f"{g1}.log").read_text(errors="replace")
            if f"replica group 1 committed step {KILL_AFTER} " in log:
                pids = worker_pids(launchers[g1])
                if len(pids) == 2:
                    os.kill(pids[1], signal.SIGKILL)
                    killed.update(pid=pids[1], at=time.monotonic())

        t0 = time.monotonic()
        results = {r.job.name: r for r in run_jobs(jobs, root, timeout_s=420, watch=watch)}
        wall = time.monotonic() - t0
    return {"results": results, "killed": killed, "wall_s": wall, "root": root / name}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("titan_ft")
    tok, data = write_tiny_assets(root / "assets")
    return {"clean": _run(root, "clean", tok, data, kill=False), "kill": _run(root, "kill", tok, data, kill=True)}


def _final_state(folder: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.parent.name}-final.pt"
    dcp_to_torch_save(str(folder / "checkpoint" / f"step-{STEPS}"), str(out))
    return torch.load(out, weights_only=False)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Every tensor (parameters, optimizer moments and steps) bitwise equal, and the step. (torchtitan's
    ``ntokens_seen`` and the dataloader's position count what this group's processes read: they differ by design.)"""
    fa, fb = _flat(a), _flat(b)
    assert set(fa) == set(fb)
    tensors = sorted(k for k, v in fa.items() if isinstance(v, torch.Tensor))
    assert len(tensors) > 50 and any(k.startswith("optimizer.") for k in tensors), tensors[:5]
    for k in tensors:
        assert torch.equal(fa[k], fb[k]), k
    assert fa["train_state.step"] == fb["train_state.step"] == STEPS


def _check_exit(result: TitanResult) -> None:
    result.check()


def test_fault_free_groups_commit_every_step_and_end_equal(runs: dict[str, dict[str, Any]]) -> None:
    clean = runs["clean"]
    for g in (0, 1):
        res = clean["results"][f"clean-g{g}"]
        _check_exit(res)
        assert _committed(res.log, g) == [s for s in range(1, STEPS + 1) for _ in (0, 1)]  # both ranks log each
        # by default the group holds one group session (torchrun's process group is the replica group)
        for rank, role in ((0, "leader"), (1, "follower")):
            assert f"replica group {g} rank {rank} membership session: {role} " in res.log, (g, rank, role)
    _assert_same_state(_final_state(clean["root"] / "g0"), _final_state(clean["root"] / "g1"))
    print(f"fault-free: {clean['wall_s']:.0f} s")


def test_killed_group_rejoins_heals_and_ends_equal_while_the_other_trains_on(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["kill"]
    g0, g1 = run["results"]["kill-g0"], run["results"]["kill-g1"]
    _check_exit(g0)
    _check_exit(g1)
    assert run["killed"], "the watcher never saw group 1 commit step 5"
    # group 0: one start per rank (never restarted), every step committed exactly once
    assert sorted(g0.backends) == [(0, 0), (0, 1)] and g0.log.count("backend torchnext") == 2
    assert _committed(g0.log, 0) == [s for s in range(1, STEPS + 1) for _ in (0, 1)]
    # group 1: started twice (torchrun's restart), rejoined, healed, caught up, finished
    assert g1.log.count("backend torchnext") == 4, "group 1 was not restarted"
    rejoin = re.search(r"generation \d+, replica groups \[\[\d+, \d+\], \[\d+, \d+\]\], committed step (\d+), "
                       r"reason grow[^,]*: joined \[\d+, \d+\], healed HealStats", g1.log)
    assert rejoin, g1.log[-3000:]
    healed_at = int(rejoin[1])
    assert KILL_AFTER <= healed_at < STEPS
    _assert_same_state(_final_state(run["root"] / "g0"), _final_state(run["root"] / "g1"))
    # the restarted group loaded its own older checkpoint *before* it was healed (never after: that overwrote the
    # healed state), then caught up from the checkpoint's step to the job's
    loaded = re.search(r"Loading the checkpoint from \S*step-(\d+)\.", g1.log)
    assert loaded and loaded.start() < rejoin.start(), "no checkpoint loaded before the heal"
    assert int(loaded[1]) % 3 == 0 and int(loaded[1]) <= healed_at
    assert f"catches up from step {int(loaded[1]) + 1} to {healed_at + 1}" in g1.log
    assert g1.log.count("Loading the checkpoint") == 2  # once per rank of the restarted launch, not again in train()
    after = _committed(g1.log, 1)
    assert after[-2:] == [STEPS, STEPS] and after[: 2 * KILL_AFTER] == [s for s in range(1, KILL_AFTER + 1)
                                                                         for _ in (0, 1)]
    # before the kill the job is the fault-free job: bitwise the same losses (group 0, both ranks)
    clean = read_scalars(runs["clean"]["root"] / "g0" / "tb")
    faulty = read_scalars(run["root"] / "g0" / "tb")
    for rank in (0, 1):
        for step in range(1, KILL_AFTER + 1):
            assert faulty[rank][LOSS_TAG][step] == clean[rank][LOSS_TAG][step], (rank, step)
    print(f"with a kill: {run['wall_s']:.0f} s; group 1 healed at committed step {healed_at}")


def test_the_replica_group_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchnext.integrations.torchtitan import FaultTolerance, FaultTolerantTrainer, TorchnextLowpLinear
    from torchnext.integrations.torchtitan.config_registry import (
        llama3_debugmodel_torchnext_ft,
        llama3_debugmodel_torchnext_ft_mxfp8,
    )

    lowp = llama3_debugmodel_torchnext_ft_mxfp8()  # the example's config: FT-HSDP + MXFP8
    assert isinstance(lowp, FaultTolerantTrainer.Config)
    assert len(list(lowp.model_spec.model.traverse(TorchnextLowpLinear.Config))) == 31
    config = llama3_debugmodel_torchnext_ft()
    assert isinstance(config, FaultTolerantTrainer.Config)
    monkeypatch.setenv("TORCHNEXT_FT_REPLICA_GROUP", "one")
    with pytest.raises(ValueError, match="TORCHNEXT_FT_REPLICA_GROUP must be"):
        FaultTolerantTrainer(config)
    monkeypatch.setenv("TORCHNEXT_FT_REPLICA_GROUP", "2")
    config.fault_tolerance = FaultTolerance(replica_groups=2)
    with pytest.raises(ValueError, match=r"replica group 2 outside --fault_tolerance\.replica_groups 2"):
        FaultTolerantTrainer(config)
    monkeypatch.setenv("TORCHNEXT_FT_REPLICA_GROUP", "1")
    config.fault_tolerance = FaultTolerance(replica_groups=2, min_replica_groups=3)
    with pytest.raises(ValueError, match="min_replica_groups 3"):
        FaultTolerantTrainer(config)
