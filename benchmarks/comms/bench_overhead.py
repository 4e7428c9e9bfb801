"""Communicator overhead vs raw ``torch.distributed.ProcessGroupGloo`` (same store, same processes, same run).

For 2 and 4 ranks (real processes, parent-hosted TCPStore on 127.0.0.1), message sizes 4 B ... 16 MiB (float32,
size = bytes per rank), all_reduce and all_gather (list form): median latency of each, throughput and the ratio
raw latency / ours latency (= ours throughput / raw throughput; 1.0 = no overhead). The Communicator has a pre and
a post hook registered (the Flight Recorder's situation) and runs on the same ProcessGroupGloo object as the raw
baseline (handed over through ``register_backend``), created on the same store. Ops are interleaved one by one (ABBA: raw, ours, ours, raw,
...) so machine noise hits both sides alike; medians over all samples.

    python benchmarks/comms/bench_overhead.py [--world-sizes 2 4] [--quick] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchnext.comms import BackendHandle, Communicator, register_backend
from torchnext.testing import RankContext, run_ranks

SIZES = [4, 64, 1024, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024]
OPS = ("all_reduce", "all_gather")


def _fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def _callables(
    op: str, comm: Communicator, raw: Any, x: torch.Tensor, outs: list[torch.Tensor]
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(ours, raw) running ``op`` once, synchronously, on the same tensors."""
    if op == "all_reduce":
        return (lambda: comm.all_reduce(x)), (lambda: raw.allreduce([x]).wait())
    return (lambda: comm.all_gather(outs, x)), (lambda: raw.allgather([outs], [x]).wait())


def _rank_main(ctx: RankContext, sizes: list[int], budget_s: float, min_pairs: int, max_pairs: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    raw = dist.ProcessGroupGloo(dist.PrefixStore("bench_raw", ctx.store), ctx.rank, ctx.world_size, timedelta(seconds=120))
    # The Communicator runs on that very ProcessGroupGloo (a registered backend factory hands it over), so the
    # comparison isolates torchnext's layer: two separately created Gloo groups differ by up to 5x at 4 B here.
    register_backend("bench-gloo", lambda cfg: BackendHandle(pg=raw, device=torch.device("cpu"), interruptible_wait=True),
                     replace=True)
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, backend="bench-gloo", timeout=timedelta(seconds=120),
                        name="bench")
    counter = [0, 0]
    comm.register_pre_hook(lambda info: counter.__setitem__(0, counter[0] + 1))
    comm.register_post_hook(lambda args: counter.__setitem__(1, counter[1] + 1))
    ws = ctx.world_size
    rows = []
    for op in OPS:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = torch.ones(n)
            outs = [torch.empty(n) for _ in range(ws)]
            ours, base = _callables(op, comm, raw, x, outs)
            # warm up; pick the sample count from rank 0's estimate (broadcast so every rank runs the same sequence)
            for _ in range(3):
                base()
                ours()
            t0 = time.perf_counter()
            for _ in range(3):
                base()
            est = torch.tensor([(time.perf_counter() - t0) / 3], dtype=torch.float64)
            raw.broadcast([est]).wait()
            pairs = int(max(min_pairs, min(max_pairs, budget_s / 2 / max(est.item(), 1e-7))))
            times: dict[str, list[float]] = {"ours": [], "raw": []}
            cpu = {"ours": 0.0, "raw": 0.0}
            raw.barrier().wait()
            for i in range(pairs):  # ABBA at single-op granularity: noise hits both sides alike
                order = (("raw", base), ("ours", ours)) if i % 2 == 0 else (("ours", ours), ("raw", base))
                for name, fn in order:
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name] += time.thread_time() - c0
            ours_s = statistics.median(times["ours"])
            raw_s = statistics.median(times["raw"])
            moved = nbytes if op == "all_reduce" else nbytes * ws
            rows.append(dict(op=op, world_size=ws, bytes=nbytes, ours_us=ours_s * 1e6, raw_us=raw_s * 1e6,
                             ours_gbps=moved / ours_s / 1e9, raw_gbps=moved / raw_s / 1e9, ratio=raw_s / ours_s,
                             added_cpu_us=(cpu["ours"] - cpu["raw"]) / pairs * 1e6,
                             samples=pairs))
    if counter[0] != counter[1]:
        raise RuntimeError(f"hooks unpaired: {counter}")
    comm.shutdown()
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| op | ranks | size | raw latency (µs) | Communicator latency (µs) | added latency | raw GB/s | "
           "Communicator GB/s | throughput ratio | added CPU/op (µs) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['op']} | {r['world_size']} | {_fmt_size(r['bytes'])} | {r['raw_us']:.1f} | {r['ours_us']:.1f} | "
            f"{(r['ours_us'] / r['raw_us'] - 1) * 100:+.1f} % | {r['raw_gbps']:.3f} | {r['ours_gbps']:.3f} | "
            f"{r['ratio']:.3f} | {r['added_cpu_us']:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (smoke run)")
    p.add_argument("--budget-s", type=float, default=3.0, help="seconds of measurement per (op, size, world size)")
    p.add_argument("--max-pairs", type=int, default=3000, help="most ABBA pairs per point")
    p.add_argument("--min-pairs", type=int, default=16, help="fewest ABBA pairs per point (large messages)")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)
    sizes = [4, 1024 * 1024] if args.quick else SIZES
    budget = 0.5 if args.quick else args.budget_s
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; command: python {' '.join(sys.argv)}")
    rows: list[dict[str, Any]] = []
    for ws in args.world_sizes:
        t0 = time.time()
        results = run_ranks(_rank_main, ws, args=(sizes, budget, args.min_pairs, args.max_pairs), timeout=1800)
        rows.extend(results[0])
        print(f"world size {ws}: {time.time() - t0:.1f} s", flush=True)
    rows.sort(key=lambda r: (r["op"], r["world_size"], r["bytes"]))
    table = _table(rows)
    print(table)
    big = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    small = [r["ours_us"] / r["raw_us"] - 1 for r in rows if r["bytes"] == 4]
    summary = (f"throughput ratio at >= 1 MiB: min {min(big):.3f}, median {statistics.median(big):.3f} (goal >= 0.97); "
               f"added latency at 4 B: max {max(small) * 100:+.1f} %, median {statistics.median(small) * 100:+.1f} % "
               "(goal <= 5 %)") if big and small else ""
    print(summary)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
