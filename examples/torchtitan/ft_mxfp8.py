"""torchtitan's llama3 debug model trained with FT-HSDP and MXFP8 on local CPU ranks, one replica group killed
mid-run: torchnext.ft in place of torchft, torchnext's low precision in place of torchao's.

    python examples/torchtitan/ft_mxfp8.py [--groups 2] [--ranks 2] [--steps 20] [--kill-after 8] [--out DIR]

What it does: starts a coordinator (``torchnext coordinator``), then one ``torchnext run`` per replica group, each
running torchtitan's own ``torchtitan.train`` with ``--config llama3_debugmodel_torchnext_ft_mxfp8`` (FSDP2 inside
the group, all-reduce across the live groups, every Linear in MXFP8) under the CPU shims of
``torchnext.testing.torchtitan_cpu``; a tokenizer and a small text set are made locally. Once the last group has
committed ``--kill-after`` steps, one of its ranks is SIGKILLed: the other groups train on, torchrun restarts the
killed group (``--max-restarts 1``), which rejoins, is healed from a live group and trains to the end. Logs and
torchtitan's outputs go to ``--out``; the script prints each group's committed steps and the rejoin.
Needs the ``[titan]`` extra (torchtitan 0.3.0).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import sys
import tempfile
from pathlib import Path

from torchnext.testing import CoordinatorProcess
from torchnext.testing.torchtitan_cpu import CPU_FLAGS, write_tiny_assets
from torchnext.testing.torchtitan_jobs import TitanJob, replica_group_env, run_jobs, worker_pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups (one torchnext run each)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica group (FSDP inside it)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=8, help="kill a rank of the last group after this step")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary one)")
    args = parser.parse_args()
    if args.groups < 2 or args.ranks < 2 or not 0 < args.kill_after < args.steps:
        parser.error("needs --groups >= 2, --ranks >= 2 and 0 < --kill-after < --steps")
    out = args.out or Path(tempfile.mkdtemp(prefix="torchnext-titan-ft-"))
    out.mkdir(parents=True, exist_ok=True)
    tok, data = write_tiny_assets(out / "assets")
    token = secrets.token_hex(16)
    last = args.groups - 1
    killed: list[int] = []
    # heartbeats as the demo's (0.25 s / 2 s): CPU training on shared cores starves a heartbeat thread for longer
    # than the default 0.6 s timeout now and then
    with CoordinatorProcess(token, initial_size=args.groups, min_size=1, heartbeat_interval_s=0.25,
                            heartbeat_timeout_s=2.0) as coordinator:
        common = ["--module", "torchnext.integrations.torchtitan", "--config", "llama3_debugmodel_torchnext_ft_mxfp8",
                  "--hf_assets_path", tok, "--dataloader.dataset_path", data, "--training.steps", str(args.steps),
                  "--training.seq_len", "128", "--training.local_batch_size", "4", *CPU_FLAGS, "--debug.seed", "0",
                  "--fault_tolerance.replica_groups", str(args.groups), "--metrics.enable_tensorboard"]
        jobs = [TitanJob(name=f"group{g}", launcher="torchnext", nproc=args.ranks, common=common,
                         runs=[["--dump_folder", str(out / f"group{g}")]], launcher_args=["--max-restarts", "1"],
                         env=replica_group_env(coordinator.address, token, g))
                for g in range(args.groups)]

        def watch(launchers: dict[str, int]) -> None:
            name = f"group{last}"
            if killed or name not in launchers:
                return
            if f"replica group {last} committed step {args.kill_after} " in (out / f"{name}.log").read_text(
                    errors="replace"):
                pids = worker_pids(launchers[name])
                if len(pids) == args.ranks:
                    os.kill(pids[-1], signal.SIGKILL)
                    killed.append(pids[-1])
                    print(f"killed pid {pids[-1]} (a rank of replica group {last}) after step {args.kill_after}",
                          flush=True)

        print(f"coordinator {coordinator.address}; {args.groups} replica groups x {args.ranks} ranks; logs in {out}",
              flush=True)
        results = run_jobs(jobs, out, timeout_s=900, watch=watch)
    ok = True
    for g, res in enumerate(results):
        steps = sorted({int(m[1]) for m in re.finditer(rf"replica group {g} committed step (\d+) ", res.log)})
        rejoin = re.search(r"committed step (\d+), reason grow[^,]*: joined", res.log)
        print(f"replica group {g}: exit {res.returncode}, {res.wall_s:.0f} s, committed steps {steps[0]}..{steps[-1]}"
              f" ({len(steps)} distinct)" + (f"; a group rejoined and was healed at step {rejoin[1]}" if rejoin else ""))
        ok = ok and res.returncode == 0 and not res.leftover
    return 0 if ok and killed else 1


if __name__ == "__main__":
    sys.exit(main())
