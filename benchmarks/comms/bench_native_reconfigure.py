"""Peer for the fault-tolerance figures: torch 2.14.1's own ``dist._reconfigure`` on Gloo, same machine, same kind
of failure as ``bench_recovery.py`` (a member killed inside an all_reduce), 4 ranks as processes.

torch gives the rebuild (``_reconfigure(uuid, handles)``) but no failure detection and no agreement: the survivors
learn of the death only through the failed collective, then must agree out of band on who is left. This script gives
native torch its best case: the survivors know that exactly one rank failed (they wait for ``world - 1`` survivor
marks in the store, so agreement costs one store round trip), and reconfigure with the survivors' handles in rank
order. Per repetition (one job per repetition, the victim is rank ``world - 1``)::

    failure  = the victim's mark just before os._exit inside all_reduce (the others are in the same all_reduce)
    detect   = the survivor's all_reduce raised               (first / last survivor)
    rebuild  = _reconfigure(...).wait() returned              (last survivor)
    total    = last survivor finished an all_reduce in the new group - failure

    python benchmarks/comms/bench_native_reconfigure.py [--reps 10] [--timeout 10]

On torch without ``dist._reconfigure`` (2.13) it prints that the peer is unavailable and exits 0. Run it in a
venv with torch 2.14.1 (a CUDA build that runs on the CPU): see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from torchnext.testing import RankContext, run_ranks


def _rank(ctx: RankContext, timeout_s: float, rep: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    store = dist.PrefixStore(f"native{rep}", ctx.store)
    world, rank = ctx.world_size, ctx.rank
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                            enable_reconfigure=True)
    store.set(f"handle/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"handle/{r}").decode() for r in range(world)]
    dist._reconfigure(uuid=rep * 10, handles=handles).wait()  # with enable_reconfigure, the first group is built so
    t = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(t)
    store.set(f"handle1/{rank}", dist._get_reconfigure_handle())  # a handle names one instance: publish the current
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world)])
    handles = [store.get(f"handle1/{r}").decode() for r in range(world)]
    victim = world - 1
    if rank == victim:
        time.sleep(0.05)  # let the survivors enter the all_reduce first
        store.set("failure", repr(time.monotonic()))
        os._exit(0)
    out: dict[str, Any] = {"rank": rank}
    try:
        dist.all_reduce(t)  # the victim never joins: raises (connection closed) or times out
        out["error"] = None
    except Exception as exc:  # whatever Gloo raises is the detection
        out["error"] = type(exc).__name__
    out["detect"] = time.monotonic()
    store.set(f"alive/{rank}", "1")
    survivors = [r for r in range(world) if r != victim]
    store.wait([f"alive/{r}" for r in survivors], timedelta(seconds=timeout_s + 30))  # best case: the count is known
    out["agree"] = time.monotonic()
    dist._reconfigure(uuid=rep * 10 + 1, handles=[handles[r] for r in survivors]).wait()
    out["rebuild"] = time.monotonic()
    x = torch.ones(1024)
    dist.all_reduce(x)
    out["first_op"] = time.monotonic()
    out["value_ok"] = bool(torch.all(x == len(survivors)))
    out["new_size"] = dist.get_world_size()
    out["failure"] = float(store.get("failure").decode())
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=10.0, help="collective timeout of the process group (s)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if not hasattr(dist, "_reconfigure"):
        print(f"peer unavailable: torch {torch.__version__} has no torch.distributed._reconfigure (added in 2.14.1)")
        return
    totals, detect_first, detect_last, rebuild, errors = [], [], [], [], []
    for rep in range(args.reps):
        res = run_ranks(_rank, args.ranks, args=(args.timeout, rep), timeout=args.timeout * 3 + 120,
                        allow_exit={args.ranks - 1})
        ok = [r for r in res if isinstance(r, dict)]
        fail = ok[0]["failure"]
        assert all(r["value_ok"] and r["new_size"] == args.ranks - 1 for r in ok), ok
        detect_first.append((min(r["detect"] for r in ok) - fail) * 1e3)
        detect_last.append((max(r["detect"] for r in ok) - fail) * 1e3)
        rebuild.append((max(r["rebuild"] for r in ok) - max(r["agree"] for r in ok)) * 1e3)
        totals.append((max(r["first_op"] for r in ok) - fail) * 1e3)
        errors.append(sorted({r["error"] for r in ok}, key=str))
        print(f"rep {rep}: detect first {detect_first[-1]:8.1f} ms, last {detect_last[-1]:8.1f} ms; rebuild "
              f"{rebuild[-1]:6.1f} ms; total {totals[-1]:8.1f} ms; survivors saw {errors[-1]}")
    q = statistics.quantiles(totals, n=100) if len(totals) > 1 else totals * 99
    print(f"\nnative dist._reconfigure, Gloo, {args.ranks} ranks, kill inside all_reduce, timeout {args.timeout} s: "
          f"total p50 {statistics.median(totals):.1f} ms, p99 {q[98]:.1f} ms, max {max(totals):.1f} ms; "
          f"detect (last survivor) p50 {statistics.median(detect_last):.1f} ms; rebuild p50 "
          f"{statistics.median(rebuild):.1f} ms")


if __name__ == "__main__":
    main()
