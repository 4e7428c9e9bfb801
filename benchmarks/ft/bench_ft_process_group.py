"""``ft.process_group`` all_reduce per op: the native data path against the Python path, same processes, same run.

Every rank (a process) is a member of two fault-tolerant jobs at once -- two coordinators, one replica group per
rank -- the first joined with ``TORCHNEXT_NATIVE_PG=1`` (its ``ft.process_group`` on the native path: staging
buffers and never-raise in C++), the second with ``TORCHNEXT_NATIVE_PG=0`` (the Python path). Two references over
the same ranks: ``plain``, a torchnext process group on the native path without fault tolerance (torch's
dispatcher and the native backend, no staging: what staging and the switch add is ``native - plain``), and
``gloo``, a bare ``ProcessGroupGloo`` (its methods called directly: no dispatcher). Each sample times ``--ops`` back-to-back
``pg.allreduce([t]).wait()`` (SUM) of one group; the four groups alternate A B C D D C B A sample by sample with a
barrier before each sample, and the figure is the median per op::

    per_op[group][size] = median over samples of (time of `ops` all_reduces) / ops
    saved = python - native        ratio = python / native

    python benchmarks/ft/bench_ft_process_group.py [--ranks 2] [--samples 60] [--ops 50 5]
        [--sizes 4 1048576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

GROUPS = ("native", "python", "plain", "gloo")


def _rank(ctx: Any, jobs: list[tuple[str, str]], p: dict[str, Any]) -> dict[str, Any]:
    from torchnext.ft import FaultTolerant, FaultTolerantConfig

    torch.set_num_threads(1)
    store = ctx.store
    raw = dist.ProcessGroupGloo(dist.PrefixStore("bench-raw", store), ctx.rank, ctx.world_size)
    os.environ["TORCHNEXT_NATIVE_PG"] = "1"
    dist.init_process_group("torchnext", store=dist.PrefixStore("bench-plain", store), rank=ctx.rank,
                            world_size=ctx.world_size)
    fts = []
    pgs: dict[str, Any] = {"gloo": raw, "plain": dist.group.WORLD}
    for name, (addr, token) in zip(("native", "python"), jobs, strict=True):
        os.environ["TORCHNEXT_NATIVE_PG"] = "1" if name == "native" else "0"
        ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, member_id=ctx.rank,
                                               min_size=ctx.world_size, name=f"bench-{name}"))
        ft.join()
        fts.append(ft)
        pgs[name] = ft.process_group
    paths = {name: bool(getattr(pgs[name], "native", False)) for name in ("native", "python", "plain")}
    if not paths["native"] or paths["python"] or not paths["plain"]:
        raise RuntimeError(f"rank {ctx.rank}: the groups are not on the paths asked for: {paths}")

    def barrier() -> None:
        raw.barrier().wait()

    out: dict[str, Any] = {"paths": paths, "per_op": {}}
    for size, ops in zip(p["sizes"], p["ops"], strict=True):
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        times: dict[str, list[float]] = {g: [] for g in GROUPS}
        for i in range(p["samples"] + 2):  # two rounds of warm-up
            order = GROUPS if i % 2 == 0 else GROUPS[::-1]
            for g in order:
                pg = pgs[g]
                barrier()
                t0 = time.perf_counter()
                for _ in range(ops):
                    pg.allreduce([t]).wait()
                dt = (time.perf_counter() - t0) / ops
                if i >= 2:
                    times[g].append(dt)
        out["per_op"][size] = {g: statistics.median(v) for g, v in times.items()}
    for ft in fts:
        ft.finish()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--samples", type=int, default=60, help="timed samples per group and size")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 1 << 20], help="bytes per all_reduce (fp32)")
    ap.add_argument("--ops", type=int, nargs="+", default=[50, 5], help="ops per sample, one per size")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if len(args.ops) != len(args.sizes):
        ap.error("--ops needs one count per --sizes entry")
    import torchnext
    from torchnext.comms import native as native_ext
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
    from torchnext.testing import run_ranks

    st = native_ext.status()  # built here once, so the ranks load it from the cache
    print(f"torch {torch.__version__}, torchnext ({os.path.dirname(torchnext.__file__)}), python "
          f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; native extension: {st.reason}", flush=True)
    if not st.available:
        return 1
    p = {"sizes": args.sizes, "ops": args.ops, "samples": args.samples}
    cfg = CoordinatorConfig(membership=MembershipConfig(initial_size=args.ranks, min_size=args.ranks))
    with Coordinator(cfg) as a, Coordinator(cfg) as b:
        reports = run_ranks(_rank, args.ranks, args=([(a.address, a.token), (b.address, b.token)], p),
                            timeout=args.timeout)
    load = os.getloadavg()
    print(f"{args.ranks} ranks, {args.samples} samples per group and size, groups interleaved A B C D D C B A; "
          f"load average after: {' '.join(f'{x:.2f}' for x in load)}")
    print(f"{'size':>10} {'native us':>10} {'python us':>10} {'plain us':>10} {'gloo us':>10} {'saved us':>9} "
          f"{'py/native':>9}")
    rows = []
    for size in args.sizes:
        # the slowest rank's median (an all_reduce ends on every rank at about the same time)
        med = {g: max(r["per_op"][size][g] for r in reports) * 1e6 for g in GROUPS}
        row = {"bytes": size, **{f"{g}_us": med[g] for g in GROUPS}, "saved_us": med["python"] - med["native"],
               "ratio": med["python"] / med["native"]}
        rows.append(row)
        print(f"{size:>10} {med['native']:>10.1f} {med['python']:>10.1f} {med['plain']:>10.1f} {med['gloo']:>10.1f} "
              f"{row['saved_us']:>9.1f} {row['ratio']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "rows": rows, "load_after": load, "reports": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
