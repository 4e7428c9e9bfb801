"""Step time of torchtitan's llama3 debug model on torchnext process groups vs Gloo, with and without fault tolerance.

    python benchmarks/integrations/bench_torchtitan.py [--steps 30] [--rounds 1] [--ft] [--json out.json]

torchtitan 0.3.0 runs unedited (its ``torchtitan.train``, under the CPU shims of ``torchnext.testing.torchtitan_cpu``)
on local CPU ranks, seq_len 128, 4 sequences a rank. Each configuration is one launch per round, the pair run one
after the other (never at once) in the order A B | B A | A B ... so load drifts hit both alike:

* ``fsdp``: 2 ranks, FSDP2 -- ``torchrun`` (Gloo) vs ``torchnext run``;
* ``hsdp`` (``--ft``): 2 x 2 ranks -- ``torchrun`` with ``data_parallel_replicate_degree 2`` (Gloo HSDP) vs
  ``FaultTolerantTrainer``: 2 replica groups, one ``torchnext run`` each, one coordinator (FT-HSDP).

A step's time is torchtitan's own ``time_metrics/end_to_end(s)`` of rank 0 (TensorBoard); the first 5 steps are
warm-up. Reported: the median step time per configuration and backend, and the speed ratio gloo / torchnext (the
goal of issue 27: >= 0.97). On a shared 2-core machine the 4-rank configuration is oversubscribed (4 processes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchnext.testing import CoordinatorProcess
from torchnext.testing.torchtitan_cpu import CPU_FLAGS, read_scalars, write_tiny_assets
from torchnext.testing.torchtitan_jobs import TitanJob, replica_group_env, run_jobs

TIME_TAG = "time_metrics/end_to_end(s)"
WARMUP = 5


def _common(tok: str, data: str, steps: int, module: str = "llama3", config: str = "llama3_debugmodel") -> list[str]:
    return ["--module", module, "--config", config, "--hf_assets_path", tok, "--dataloader.dataset_path", data,
            "--training.steps", str(steps), "--training.seq_len", "128", "--training.local_batch_size", "4",
            *CPU_FLAGS, "--debug.seed", "0", "--metrics.enable_tensorboard", "--metrics.save_for_all_ranks",
            "--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "120"]


def _env(root: Path) -> dict[str, str]:
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TORCHNEXT_AUTOTUNE_CACHE": str(root / "autotune.json")}


def _step_times(dump: Path) -> list[float]:
    times = read_scalars(dump / "tb", tags=(TIME_TAG,))[0][TIME_TAG]
    return [t for step, t in sorted(times.items()) if step > WARMUP]


def _launch(jobs: list[TitanJob], root: Path) -> None:
    for res in run_jobs(jobs, root, timeout_s=900):
        res.check()


def run_fsdp(root: Path, backend: str, tag: str, tok: str, data: str, steps: int) -> list[float]:
    dump = root / tag
    launcher = "torchrun" if backend == "gloo" else "torchnext"
    _launch([TitanJob(name=tag, launcher=launcher, runs=[["--dump_folder", str(dump)]],
                      common=_common(tok, data, steps), env=_env(root))], root)
    return _step_times(dump)


def run_hsdp(root: Path, backend: str, tag: str, tok: str, data: str, steps: int) -> list[float]:
    if backend == "gloo":
        dump = root / tag
        _launch([TitanJob(name=tag, launcher="torchrun", nproc=4, runs=[["--dump_folder", str(dump)]],
                          common=[*_common(tok, data, steps), "--parallelism.data_parallel_replicate_degree", "2",
                                  "--parallelism.data_parallel_shard_degree", "2"], env=_env(root))], root)
        return _step_times(dump)
    token = secrets.token_hex(8)
    common = [*_common(tok, data, steps, "torchnext.integrations.torchtitan", "llama3_debugmodel_torchnext_ft"),
              "--fault_tolerance.replica_groups", "2"]
    with CoordinatorProcess(token, initial_size=2, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0) as coord:
        _launch([TitanJob(name=f"{tag}-g{g}", launcher="torchnext", runs=[["--dump_folder", str(root / tag / f"g{g}")]],
                          common=common,
                          env=replica_group_env(coord.address, token, g, root / "autotune.json"))
                 for g in (0, 1)], root)
    return _step_times(root / tag / "g0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1, help="launch pairs per configuration (ABBA order)")
    parser.add_argument("--ft", action="store_true", help="also the 2 x 2 HSDP / FT-HSDP configuration")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps <= WARMUP + 2 or args.rounds < 1:
        parser.error(f"--steps must exceed {WARMUP + 2} and --rounds be >= 1")
    import torchtitan

    print(f"torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}, python "
          f"{platform.python_version()}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"{len(os.sched_getaffinity(0))} cores", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-torchtitan-"))
    tok, data = write_tiny_assets(root / "assets")
    configs: dict[str, Any] = {"fsdp": run_fsdp, **({"hsdp": run_hsdp} if args.ft else {})}
    results: dict[str, dict[str, list[float]]] = {}
    for name, fn in configs.items():
        times: dict[str, list[float]] = {"gloo": [], "torchnext": []}
        for r in range(args.rounds):
            order = ("gloo", "torchnext") if r % 2 == 0 else ("torchnext", "gloo")
            for backend in order:
                times[backend] += fn(root, backend, f"{name}-{backend}-{r}", tok, data, args.steps)
        results[name] = times
    print(f"{'config':8} {'gloo ms':>9} {'torchnext ms':>13} {'speed ratio':>12}")
    summary = {}
    for name, times in results.items():
        g, t = statistics.median(times["gloo"]) * 1e3, statistics.median(times["torchnext"]) * 1e3
        summary[name] = {"gloo_ms": g, "torchnext_ms": t, "ratio": g / t, "steps": len(times["gloo"])}
        label = "FT-HSDP" if name == "hsdp" else name
        print(f"{label:8} {g:9.1f} {t:13.1f} {g / t:12.3f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
