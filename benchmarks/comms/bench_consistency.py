"""Cost of the consistency mode: the same all_reduce on a Communicator with and without ``check_collectives``.

    python benchmarks/comms/bench_consistency.py [--worlds 2 4] [--rounds 8] [--json out.json]

Each rank holds two Communicators over one store, ``plain`` and ``checked`` (``check_collectives=True``), and
times every op of batches of sync all_reduce (4 B and 1 MiB) on them in ABBA order (plain, checked, checked, plain
per round), so load drifts hit both alike. An op's time is the slowest rank's. Reported per configuration: the
median and the 90th percentile over all ops, the ratio of medians and their difference (what the mode adds per op:
one 16-byte all_reduce on the side group, plus the fingerprint). On a loaded machine the means are dominated by
scheduling stalls of a few milliseconds, which the checked op (two round trips) meets twice as often.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from torchnext.comms import Communicator
from torchnext.testing import RankContext, run_ranks

SIZES = {"4 B": 1, "1 MiB": 262_144}
BATCH = {"4 B": 50, "1 MiB": 10}


def _batch(comm: Communicator, t: torch.Tensor, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        comm.all_reduce(t)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def body(ctx: RankContext, rounds: int) -> dict[str, dict[str, list[float]]]:
    kw: dict[str, Any] = {"timeout": timedelta(seconds=120)}
    comms = {"plain": Communicator(ctx.store, ctx.rank, ctx.world_size, name="plain", check_collectives=False, **kw),
             "checked": Communicator(ctx.store, ctx.rank, ctx.world_size, name="checked", check_collectives=True,
                                     **kw)}
    out: dict[str, dict[str, list[float]]] = {s: {k: [] for k in comms} for s in SIZES}
    for size, numel in SIZES.items():
        t = torch.ones(numel)
        for comm in comms.values():  # warm up
            _batch(comm, t, BATCH[size])
        for _ in range(rounds):
            for name in ("plain", "checked", "checked", "plain"):
                out[size][name].extend(_batch(comms[name], t, BATCH[size]))
    for comm in comms.values():
        comm.shutdown()
    return out


def _p90(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(0.9 * len(ys)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for world in args.worlds:
        results = run_ranks(body, world, args=(args.rounds,), timeout=1800)
        for size in SIZES:
            # ops are aligned across ranks (collectives): an op's time is the slowest rank's
            plain = [max(r[size]["plain"][i] for r in results) for i in range(len(results[0][size]["plain"]))]
            checked = [max(r[size]["checked"][i] for r in results) for i in range(len(results[0][size]["checked"]))]
            mp, mc = statistics.median(plain), statistics.median(checked)
            rows.append({"world": world, "size": size, "plain_us": round(mp, 1), "checked_us": round(mc, 1),
                         "added_us": round(mc - mp, 1), "ratio": round(mc / mp, 2),
                         "plain_p90_us": round(_p90(plain), 1), "checked_p90_us": round(_p90(checked), 1),
                         "ops": len(plain)})
    print(f"{'ranks':>5} {'size':>6} {'plain us':>9} {'checked us':>11} {'added us':>9} {'ratio':>6} "
          f"{'plain p90':>10} {'checked p90':>12} {'ops':>5}   (medians per op)")
    for r in rows:
        print(f"{r['world']:>5} {r['size']:>6} {r['plain_us']:>9} {r['checked_us']:>11} {r['added_us']:>9} "
              f"{r['ratio']:>6} {r['plain_p90_us']:>10} {r['checked_p90_us']:>12} {r['ops']:>5}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
