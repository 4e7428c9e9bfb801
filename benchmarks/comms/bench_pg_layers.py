"""Where the process-group path's per-op time goes: one rank, 4-byte all_reduce, each layer alone, same run.

    python benchmarks/comms/bench_pg_layers.py [--rounds 3] [--ops 2000]

Prints the median microseconds per op of: ``dist.all_reduce`` on a Gloo group; Gloo's
``ProcessGroup.allreduce([t]).wait()`` alone; ``dist.all_reduce`` on a torchnext group; our group's
``allreduce([t]).wait()``; the torchnext ``Communicator.all_reduce`` underneath it. One rank (no network), so the
differences are the layers' own costs; rounds interleave the cases. Issue #14's goal: <= 10 us added per op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import torchnext  # noqa: F401  (registers the "torchnext" backend)


def _median_us(fn: Callable[[], object], ops: int, batches: int = 10) -> float:
    for _ in range(200):
        fn()
    per: list[float] = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(ops // batches):
            fn()
        per.append((time.perf_counter() - t0) / (ops // batches))
    return statistics.median(per) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    dist.init_process_group("torchnext", store=dist.HashStore(), rank=0, world_size=1)
    ours = dist.group.WORLD
    gloo = dist.new_group([0], backend="gloo")
    comm = ours.communicator()  # type: ignore[union-attr]
    t = torch.ones(1)
    cases: dict[str, Callable[[], object]] = {
        "dist.all_reduce, gloo group": lambda: dist.all_reduce(t, group=gloo),
        "gloo allreduce().wait()": lambda: gloo.allreduce([t]).wait(),
        "dist.all_reduce, torchnext group": lambda: dist.all_reduce(t, group=ours),
        "torchnext allreduce().wait()": lambda: ours.allreduce([t]).wait(),  # type: ignore[union-attr]
        "Communicator.all_reduce": lambda: comm.all_reduce(t),
    }
    print(f"torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
    rows: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            rows[name].append(_median_us(fn, args.ops))
    for name, xs in rows.items():
        print(f"{name:34s} {statistics.median(xs):8.1f} us   (rounds: {', '.join(f'{x:.1f}' for x in xs)})")
    added = statistics.median(rows["dist.all_reduce, torchnext group"]) - statistics.median(
        rows["dist.all_reduce, gloo group"])
    print(f"added by torchnext per dist.all_reduce: {added:.1f} us (goal <= 10 us); load {os.getloadavg()[0]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
