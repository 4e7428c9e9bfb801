"""Flight Recorder cost: Communicator all_reduce with the recorder off vs on, and dump time for 2,000 entries.

    python benchmarks/comms/bench_flight_recorder.py [--rounds 7] [--json out.json]

Measured in one run (medians over interleaved rounds, so load drifts hit every configuration alike):

1. 2-rank Gloo all_reduce of 4 B and 1 MiB: recorder off / on (capacity 2000, frames off) / on (frames on).
2. 1-rank Gloo all_reduce of 4 B (a cheap op, so the per-op difference is resolvable): the same three configurations.
3. The recorder's own hook work per op (pre + post hook bodies called directly, no communication).
4. Dump of 2,000 entries: JSON and pickle, with and without frames.

Goals: <= 2 us/op recording cost without frames; <= 50 ms per dump of 2,000 entries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from torchnext.comms import Communicator, FlightRecorder
from torchnext.testing import RankContext, run_ranks

CONFIGS = ("off", "on", "on+frames")
SIZES = {"4 B": 1, "1 MiB": 262_144}


def _attach(comm: Communicator, config: str) -> FlightRecorder | None:
    if config == "off":
        return None
    return FlightRecorder.attach(comm, capacity=2000, record_frames=config == "on+frames")


def _time_ops(comm: Communicator, t: torch.Tensor, n: int) -> float:
    for _ in range(max(5, n // 10)):
        comm.all_reduce(t)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        comm.all_reduce(t)
    return (time.perf_counter_ns() - t0) / n / 1e3  # us per op


def two_rank_body(ctx: RankContext, rounds: int) -> dict[str, dict[str, list[float]]]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=60))
    out: dict[str, dict[str, list[float]]] = {s: {c: [] for c in CONFIGS} for s in SIZES}
    for _ in range(rounds):
        for size, numel in SIZES.items():
            t = torch.ones(numel)
            n = 400 if numel == 1 else 40
            for config in CONFIGS:
                fr = _attach(comm, config)
                out[size][config].append(_time_ops(comm, t, n))
                if fr is not None:
                    fr.detach()
    comm.shutdown()
    return out


def one_rank(rounds: int) -> tuple[dict[str, list[float]], FlightRecorder, FlightRecorder]:
    import torch.distributed as dist

    store = dist.HashStore()
    comm = Communicator(store, 0, 1, name="solo")
    t = torch.ones(1)
    res: dict[str, list[float]] = {c: [] for c in CONFIGS}
    keep: dict[str, FlightRecorder] = {}
    for _ in range(rounds):
        for config in CONFIGS:
            fr = _attach(comm, config)
            res[config].append(_time_ops(comm, t, 3000))
            if fr is not None:
                fr.detach()
                keep[config] = fr
    comm.shutdown()
    return res, keep["on"], keep["on+frames"]


def direct_hook_cost(frames: bool, n: int = 50_000) -> float:
    """ns per op of the recorder's pre + post hook bodies, fed a real OpInfo / PostHookArgs."""
    import torch.distributed as dist

    from torchnext.comms import OpInfo, PostHookArgs, WorkStatus

    comm = Communicator(dist.HashStore(), 0, 1, name="direct")
    fr = FlightRecorder.attach(comm, capacity=2000, record_frames=frames)
    att = fr._attachments[0]
    t = torch.ones(1)
    work = comm.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    infos = [
        OpInfo(op="all_reduce", op_id=i, comm_name="direct", ranks=(0,), rank=0, size=1, async_op=False, root=None,
               peer=None, reduce_op="sum", inputs=(t,), outputs=(t,), timeout=comm.timeout)
        for i in range(1000)
    ]
    posts = [PostHookArgs(info=i, work=work, status=WorkStatus.COMPLETED, duration_s=1e-5, exception=None)
             for i in infos]
    pre, post = att.pre, att.post
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n // 1000):
            for info, args in zip(infos, posts, strict=True):
                pre(info)
                post(args)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    fr.detach()
    comm.shutdown()
    return best


def dump_times(fr: FlightRecorder, fmt: str, reps: int = 7) -> float:
    with tempfile.TemporaryDirectory() as d:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fr.dump(d + os.sep, format=fmt)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    print(f"rounds={args.rounds} (medians of per-round means; configurations interleaved in each round)\n")
    figures: dict[str, Any] = {}

    two = run_ranks(two_rank_body, 2, args=(args.rounds,), timeout=900)[0]
    print("1. 2-rank Gloo all_reduce, us/op (median)      off        on   on+frames   on-off  frames-off  ratio on/off")
    for size in SIZES:
        med = {c: statistics.median(two[size][c]) for c in CONFIGS}
        figures[f"2rank {size}"] = med
        print(f"   {size:>6}                                {med['off']:9.1f} {med['on']:9.1f} {med['on+frames']:9.1f}"
              f" {med['on'] - med['off']:+8.2f} {med['on+frames'] - med['off']:+10.2f}   {med['on'] / med['off']:.4f}")

    solo, fr_on, fr_frames = one_rank(args.rounds)
    med = {c: statistics.median(solo[c]) for c in CONFIGS}
    figures["1rank 4 B"] = med
    print(f"\n2. 1-rank Gloo all_reduce 4 B, us/op:  off {med['off']:.2f}  on {med['on']:.2f} ({med['on'] - med['off']:+.2f})"
          f"  on+frames {med['on+frames']:.2f} ({med['on+frames'] - med['off']:+.2f})")

    direct = {"frames off": direct_hook_cost(False) / 1e3, "frames on": direct_hook_cost(True) / 1e3}
    figures["recorder hook cost us/op"] = direct
    print(f"\n3. recorder pre+post hook cost per op: frames off {direct['frames off']:.2f} us, "
          f"frames on {direct['frames on']:.2f} us   (goal <= 2 us without frames: "
          f"{'met' if direct['frames off'] <= 2 else 'NOT met'})")

    print("\n4. dump of 2,000 entries (median of 7), ms:")
    for name, fr in (("frames off", fr_on), ("frames on", fr_frames)):
        assert len(fr.entries()) == 2000
        j, p = dump_times(fr, "json"), dump_times(fr, "pickle")
        figures[f"dump {name}"] = {"json_ms": j, "pickle_ms": p}
        print(f"   {name:10}  json {j:6.1f}   pickle {p:6.1f}   (goal <= 50 ms: {'met' if max(j, p) <= 50 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
