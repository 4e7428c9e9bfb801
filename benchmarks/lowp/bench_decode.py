"""Benchmark the small-M weight-only decode matmul on CPU: torchnext's compiled block-scaled kernel against torch's own
weight-only kernels and dense ``F.linear``, with the memory floor measured in the same run.

    python benchmarks/lowp/bench_decode.py [--reps 21] [--m 1,4,16] [--shapes 4096x4096,4096x14336] [--threads 2]
                                           [--json out.json]

Prints versions and the machine first. For each weight shape (N, K) and M, every peer runs in the same process,
interleaved round by round (a load spike from another process hits all of them alike), on its own rotating set of
weight copies whose total size is at least twice the L3 cache, so every call streams its weight from memory (as a
decode step over many layers does). Peers:

* ``fp32 linear`` / ``bf16 linear``: ``F.linear`` on dense weights (fp32 / bf16 activations);
* ``int4pack``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32, bf16 activations; weights from
  ``_convert_weight_to_int4pack_for_cpu(w_int32, 1)``, scales-and-zeros (K/32, N, 2) bf16): torchao's CPU int4 path;
* ``int8pack``: ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, bf16 activations, per-channel bf16 scales);
* ``<format>``: ``scaled_mm(x_bf16, quantize(w, format), backend="cpu")`` — torchnext's compiled kernel, bf16 in and
  out like the two torch kernels; ``nvfp4`` is the TE recipe (two-level, global scale);
* ``nvfp4 inductor``: the previous pure-torch path (``backend="inductor"``: Inductor's generated GEMV, fp32
  activations, compile time excluded).

``floor`` = bytes of the weight (codes + scales) / the copy bandwidth (bytes read + written by ``dst.copy_(src)`` of
256 MiB, median of the same run): the time a kernel that only streams its weight once would take. ``% floor`` =
floor / time. ``--threads 1,2`` repeats every table per torch thread count (on a loaded machine the 1-thread figures
show per-core efficiency without the stalls of a parallel region waiting for a descheduled thread).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torchnext
from torchnext.lowp import quantize, scaled_mm
from torchnext.lowp.cpu import status

FORMATS = (("nvfp4", {"recipe": "te"}), ("mxfp4", {}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {}))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    """The last-level cache size (sysfs), 32 MiB if unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            with open(os.path.join(base, idx, "size")) as f:
                raw = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(raw[-1], 1)
            best = max(best, int(raw.rstrip("KM")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


@dataclass
class Peer:
    name: str
    make: Callable[[], Callable[[], Any]]
    """Builds one weight copy and returns the call on it."""
    nbytes: int
    """Bytes of one weight copy (what a call streams)."""
    calls: list[Callable[[], Any]] = field(default_factory=list)
    i: int = 0

    def __call__(self) -> Any:
        self.i = (self.i + 1) % len(self.calls)
        return self.calls[self.i]()


def interleaved(peers: list[Peer], reps: int) -> dict[str, tuple[float, float]]:
    for p in peers:
        for _ in range(2 * len(p.calls)):
            p()
    ts: dict[str, list[float]] = {p.name: [] for p in peers}
    for r in range(reps):
        for p in peers if r % 2 == 0 else peers[::-1]:
            t0 = time.perf_counter()
            p()
            ts[p.name].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}


def copy_bandwidth(reps: int) -> float:
    """GB/s of bytes read + written by a 256 MiB ``copy_`` (median)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(ts) / 1e9


def build_peers(n: int, k: int, m: int, budget: int, inductor: bool) -> list[Peer]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    xb = x.bfloat16()
    peers: list[Peer] = []

    def fp32() -> Callable[[], Any]:
        w = torch.randn(n, k, generator=g)
        return lambda: F.linear(x, w)

    def bf16() -> Callable[[], Any]:
        w = torch.randn(n, k, generator=g).bfloat16()
        return lambda: F.linear(xb, w)

    sz = (torch.rand(k // 32, n, 2, generator=g) * 0.01).bfloat16()

    def int4() -> Callable[[], Any]:
        wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
        return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, wp, 32, sz)

    s8 = (torch.rand(n, generator=g) * 0.01).bfloat16()

    def int8() -> Callable[[], Any]:
        w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        return lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, s8)

    peers += [
        Peer("fp32 linear", fp32, n * k * 4),
        Peer("bf16 linear", bf16, n * k * 2),
        Peer("int4pack", int4, n * k // 2 + sz.nbytes),
        Peer("int8pack", int8, n * k + s8.nbytes),
    ]
    for fmt, opts in FORMATS:
        def tnx(fmt: str = fmt, opts: dict[str, Any] = opts) -> Callable[[], Any]:
            wq = quantize(torch.randn(n, k, generator=g), fmt, **opts)
            scaled_mm(xb, wq, backend="cpu")  # builds the packed layout once (cached on the weight)
            return lambda: scaled_mm(xb, wq, backend="cpu")

        probe = quantize(torch.zeros(16, k), fmt, **opts)
        peers.append(Peer(fmt, tnx, n * (probe.qdata.nbytes + probe.scales.nbytes) // 16))
    if inductor:
        def ind() -> Callable[[], Any]:
            wq = quantize(torch.randn(n, k, generator=g), "nvfp4", recipe="te")
            scaled_mm(x, wq, backend="inductor")  # compile + prepared layout (excluded)
            return lambda: scaled_mm(x, wq, backend="inductor")

        peers.append(Peer("nvfp4 inductor", ind, peers[4].nbytes))
    for p in peers:
        copies = max(1, math.ceil(budget / p.nbytes))
        p.calls = [p.make() for _ in range(copies)]
    return peers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--m", default="1,4,16")
    ap.add_argument("--shapes", default="4096x4096,4096x14336", help="N x K weight shapes (F.linear convention)")
    ap.add_argument("--no-inductor", action="store_true", help="skip the previous (Inductor) path")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="torch thread counts, e.g. 1,2")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHNEXT_AUTOTUNE_CACHE", os.path.join(tempfile.mkdtemp(), "autotune.json"))

    st = status()
    l3 = l3_bytes()
    print(f"python {platform.python_version()}  torch {torch.__version__}  torchnext {torchnext.__version__}  "
          f"{platform.machine()}")
    print(f"cpu: {cpu_name()}  cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}  L3: {l3 >> 20} MiB  "
          f"load avg: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"torchnext CPU kernels: {'available' if st.available else 'UNAVAILABLE'} ({st.reason})")
    if not st.available:
        return 1
    bw = copy_bandwidth(max(5, args.reps // 2))
    print(f"copy bandwidth (256 MiB, read + write): {bw:.1f} GB/s; each peer rotates weight copies of >= {2 * l3 >> 20} "
          f"MiB in total; {args.reps} interleaved rounds (median / min ms)\n")
    results: list[dict[str, Any]] = []
    for threads in (int(v) for v in args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            for m in (int(v) for v in args.m.split(",")):
                peers = build_peers(n, k, m, 2 * l3, not args.no_inductor)
                t = interleaved(peers, args.reps)
                ref = {name: t[name][0] for name in ("fp32 linear", "int4pack", "int8pack")}
                print(f"## N={n} K={k} M={m}, {threads} thread(s)  (load {os.getloadavg()[0]:.2f})")
                print(f"{'peer':<16}{'MiB':>8}{'median ms':>11}{'min ms':>9}{'floor ms':>10}{'% floor':>9}"
                      f"{'x fp32':>8}{'x int4':>8}{'x int8':>8}")
                for p in peers:
                    med, mn = t[p.name]
                    floor = p.nbytes / bw / 1e6
                    row = {"threads": threads, "n": n, "k": k, "m": m, "peer": p.name, "mib": p.nbytes / 2**20, "median_ms": med, "min_ms": mn,
                           "floor_ms": floor, "pct_floor": 100 * floor / med, "copy_gbs": bw,
                           **{f"x_{r.split()[0]}": ref[r] / med for r in ref}, "load": os.getloadavg()[0]}
                    results.append(row)
                    print(f"{p.name:<16}{row['mib']:>8.2f}{med:>11.3f}{mn:>9.3f}{floor:>10.3f}{row['pct_floor']:>8.0f}%"
                          f"{row['x_fp32']:>8.2f}{row['x_int4pack']:>8.2f}{row['x_int8pack']:>8.2f}")
                print()
    print("goals (issue #17): NVFP4/MXFP4 at M=1 >= 1.0x int4pack and >= 70% of the floor; MXFP8 >= 1.0x int8pack; "
          "M=16 >= 2x fp32 linear")
    for r in results:
        if r["peer"] in ("nvfp4", "mxfp4") and r["m"] == 1:
            ok = r["x_int4pack"] >= 1.0 and r["pct_floor"] >= 70
            print(f"  T{r['threads']} {r['peer']:<11} {r['n']}x{r['k']} M=1: {r['x_int4pack']:.2f}x int4pack, {r['pct_floor']:.0f}% floor "
                  f"-> {'met' if ok else 'MISSED'}")
        if r["peer"].startswith("mxfp8"):
            print(f"  T{r['threads']} {r['peer']:<11} {r['n']}x{r['k']} M={r['m']}: {r['x_int8pack']:.2f}x int8pack -> "
                  f"{'met' if r['x_int8pack'] >= 1.0 else 'MISSED'}")
        if r["m"] == 16 and r["peer"] in ("nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
            print(f"  T{r['threads']} {r['peer']:<11} {r['n']}x{r['k']} M=16: {r['x_fp32']:.2f}x fp32 linear -> "
                  f"{'met' if r['x_fp32'] >= 2.0 else 'MISSED'}")
    print(f"load avg at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": bw, "l3_bytes": l3, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
