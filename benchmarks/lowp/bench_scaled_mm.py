"""Benchmark torchnext.lowp.mm.scaled_mm on CPU: fused vs unfused, decode GEMV, grouped GEMM, autotuner choices.

Run: ``python benchmarks/lowp/bench_scaled_mm.py [--reps 15] [--quick] [--only fused|decode|grouped] [--json out.json]``

Every comparison times both sides in the same run, interleaved round by round (so background load hits both),
and prints medians, minimums and ratios. The autotuner uses a fresh cache in a temporary directory (tuning time,
including Inductor compiles, is reported separately and excluded from the timings).
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
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from torchnext.lowp import Epilogue, dequantize, grouped_scaled_mm, quantize, scaled_mm
from torchnext.lowp.mm import autotune as at
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.grouped import grouped_reference
from torchnext.lowp.mm.scaled_mm import make_problem, run_problem


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """name → (median ms, min ms), timing each function once per round."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def header() -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    try:
        load = os.getloadavg()
        print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (shared machine: expect noise)")
    except OSError:
        pass


def tune(a: Any, w: Any, ep: Epilogue | None) -> tuple[str, float]:
    t0 = time.perf_counter()
    name = at.select(make_problem(a, w, ep))
    return name, time.perf_counter() - t0


def bench_fused(n: int, k: int, ms: list[int], reps: int, out: dict[str, Any]) -> None:
    print(f"\n## Fused vs unfused: epilogue bias+gelu+output_amax, N={n}, K={k}")
    print("unfused     = lowp.dequantize -> F.linear -> +bias -> gelu -> amax (separate eager ops)")
    print("unfused_lut = same with torchnext's fast eager LUT dequantizer (a stronger baseline)")
    print(f"{'format':<11}{'M':>5}{'auto backend':>14}{'fused ms':>10}{'unfused ms':>12}{'unf_lut ms':>12}{'x unfused':>11}{'x unf_lut':>11}")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    ratios, ratios_lut = [], []
    rows = []
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        wq = quantize(w, fmt)
        for m in ms:
            a = torch.randn(m, k, generator=g)
            ep = Epilogue(bias=bias, activation="gelu", output_amax=True)
            name, tune_s = tune(a, wq, ep)

            def fused(a: torch.Tensor = a, ep: Epilogue = ep, wq: Any = wq) -> Any:
                return scaled_mm(a, wq, epilogue=ep)

            def unfused(a: torch.Tensor = a, wq: Any = wq) -> Any:
                y = F.linear(a, dequantize(wq, torch.float32))
                y = y + bias
                y = F.gelu(y)
                return y, y.abs().max()

            def unfused_lut(a: torch.Tensor = a, wq: Any = wq) -> Any:
                y = F.linear(a, dequantize_operand(wq))
                y = y + bias
                y = F.gelu(y)
                return y, y.abs().max()

            r = fused(), unfused()
            torch.testing.assert_close(r[0].output, r[1][0], rtol=1e-4, atol=1e-3)
            t = interleaved({"fused": fused, "unfused": unfused, "unfused_lut": unfused_lut}, reps)
            x, xl = t["unfused"][0] / t["fused"][0], t["unfused_lut"][0] / t["fused"][0]
            ratios.append(x)
            ratios_lut.append(xl)
            print(f"{fmt:<11}{m:>5}{name:>14}{t['fused'][0]:>10.2f}{t['unfused'][0]:>12.2f}{t['unfused_lut'][0]:>12.2f}"
                  f"{x:>10.2f}x{xl:>10.2f}x   (min {t['fused'][1]:.2f} / {t['unfused'][1]:.2f} / {t['unfused_lut'][1]:.2f}; tune {tune_s:.1f}s)")
            rows.append({"format": fmt, "m": m, "backend": name, "median_ms": {k2: v[0] for k2, v in t.items()},
                         "min_ms": {k2: v[1] for k2, v in t.items()}, "tune_s": tune_s})
    print(f"geomean speedup vs unfused: {geomean(ratios):.2f}x; vs unfused_lut: {geomean(ratios_lut):.2f}x (goal >= 1.5x)")
    out["fused"] = {"rows": rows, "geomean_vs_unfused": geomean(ratios), "geomean_vs_unfused_lut": geomean(ratios_lut)}


def bench_decode(n: int, k: int, reps: int, out: dict[str, Any]) -> None:
    print(f"\n## Decode: M=1, N={n}, K={k}, NVFP4 weights (no epilogue)")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g)
    a = torch.randn(1, k, generator=g)
    wq = quantize(w, "nvfp4")
    wb, ab = w.bfloat16(), a.bfloat16()
    name, tune_s = tune(a, wq, None)
    fns = {
        "torchnext_nvfp4": lambda: scaled_mm(a, wq),
        "fp32_linear": lambda: F.linear(a, w),
        "bf16_linear": lambda: F.linear(ab, wb),
    }
    print(f"auto backend: {name} (tune {tune_s:.1f}s); weight bytes read: nvfp4 {wq.nbytes / 2**20:.1f} MiB, "
          f"fp32 {w.numel() * 4 / 2**20:.0f} MiB, bf16 {w.numel() * 2 / 2**20:.0f} MiB")
    threads = torch.get_num_threads()
    out["decode"] = {"backend": name}
    for nt in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(nt)
        t = interleaved(fns, reps * 4)
        base = t["torchnext_nvfp4"]
        print(f"-- {nt} thread(s), calls interleaved")
        for key, (med, mn) in t.items():
            print(f"{key:<18} median {med:7.3f} ms  min {mn:7.3f} ms   speedup of nvfp4: median {med / base[0]:5.2f}x  min {mn / base[1]:5.2f}x")
        out["decode"][f"threads{nt}"] = {"median_ms": {k2: v[0] for k2, v in t.items()}, "min_ms": {k2: v[1] for k2, v in t.items()},
                                         "speedup_vs_fp32_median": t["fp32_linear"][0] / base[0],
                                         "speedup_vs_fp32_min": t["fp32_linear"][1] / base[1]}
    torch.set_num_threads(threads)
    print("goal: >= 2.5x vs fp32")


def bench_grouped(tokens: int, experts: int, n: int, k: int, reps: int, out: dict[str, Any]) -> None:
    print(f"\n## Grouped: {experts} experts, {tokens} tokens unevenly routed, N={n}, K={k}, NVFP4, epilogue bias+silu")
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)  # Dirichlet.sample takes no generator: seed the global RNG so the routing is reproducible
    probs = torch.distributions.Dirichlet(torch.full((experts,), 0.7)).sample()
    ids = torch.multinomial(probs, tokens, replacement=True, generator=g).sort().values
    counts = torch.bincount(ids, minlength=experts)
    offs = counts.cumsum(0)
    a = torch.randn(tokens, k, generator=g)
    wq = quantize(torch.randn(experts, n, k, generator=g), "nvfp4")
    bias = torch.randn(n, generator=g)
    ep = Epilogue(bias=bias, activation="silu")
    print(f"group sizes: {counts.tolist()}")
    print("loop_scaled_mm = Python loop of per-expert scaled_mm(backend='eager'), fp32 (the issue's peer);")
    print("grouped_bf16   = grouped_scaled_mm(compute_dtype=torch.bfloat16): bf16-exact weights, bf16 activations/GEMM")
    starts = [0, *offs.tolist()]
    one = torch.tensor([0])

    def loop_bf16() -> torch.Tensor:
        """The same-precision peer of grouped_bf16: a Python loop of one-expert bf16 grouped calls."""
        out = torch.empty(tokens, n)
        for e in range(experts):
            s0, s1 = starts[e], starts[e + 1]
            if s1 > s0:
                one[0] = s1 - s0
                y = grouped_scaled_mm(a[s0:s1], expert_stack[e], one, epilogue=ep, compute_dtype=torch.bfloat16)
                out[s0:s1] = y  # type: ignore[assignment]
        return out

    expert_stack = [_one_expert(wq, e) for e in range(experts)]
    fns = {
        "grouped_scaled_mm": lambda: grouped_scaled_mm(a, wq, offs, epilogue=ep),
        "grouped_bf16": lambda: grouped_scaled_mm(a, wq, offs, epilogue=ep, compute_dtype=torch.bfloat16),
        "loop_scaled_mm": lambda: grouped_reference(a, wq, offs, epilogue=ep, backend="eager"),
        "loop_bf16": loop_bf16,
    }
    y0, yb, y1 = fns["grouped_scaled_mm"](), fns["grouped_bf16"](), fns["loop_scaled_mm"]()
    torch.testing.assert_close(y0, y1, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(loop_bf16(), yb, rtol=1e-2, atol=1e-2)
    assert isinstance(yb, torch.Tensor)
    sq = 10 * math.log10(float((y1.double() ** 2).sum()) / float(((yb.double() - y1.double()) ** 2).sum()))
    print(f"grouped_bf16 SQNR vs the fp32 loop: {sq:.1f} dB")
    # floors: the GEMMs alone on weights decoded beforehand (no decode, no epilogue, no Python around them)
    wd32 = dequantize_operand(wq)
    wd16 = dequantize_operand(wq, torch.bfloat16, with_global_scale=False)
    a16 = a.bfloat16()
    o32 = offs.to(torch.int32)
    fns["floor_gemm_fp32"] = lambda: torch._grouped_mm(a, wd32.transpose(1, 2), offs=o32)
    fns["floor_gemm_bf16"] = lambda: torch._grouped_mm(a16, wd16.transpose(1, 2), offs=o32)
    print("floor_gemm_*   = torch._grouped_mm alone on pre-decoded weights (what no decode/epilogue work can beat)")
    t = interleaved(fns, reps)
    x = t["loop_scaled_mm"][0] / t["grouped_scaled_mm"][0]
    xb = t["loop_scaled_mm"][0] / t["grouped_bf16"][0]
    for key, (med, mn) in t.items():
        print(f"{key:<18} median {med:8.2f} ms  min {mn:8.2f} ms")
    print(f"speedup vs loop (median): grouped fp32 {x:.2f}x, grouped bf16 {xb:.2f}x (goal >= 1.5x)")
    xbb = t["loop_bf16"][0] / t["grouped_bf16"][0]
    print(f"same precision, bf16: grouped_bf16 vs loop_bf16 (one-expert bf16 calls) {xbb:.2f}x")
    print(f"fp32 ceiling (loop / fp32 GEMM floor): {t['loop_scaled_mm'][0] / t['floor_gemm_fp32'][0]:.2f}x; "
          f"grouped fp32 is {t['grouped_scaled_mm'][0] / t['floor_gemm_fp32'][0]:.2f}x its floor, "
          f"grouped bf16 {t['grouped_bf16'][0] / t['floor_gemm_bf16'][0]:.2f}x its floor")
    out["grouped"] = {"counts": counts.tolist(), "median_ms": {k2: v[0] for k2, v in t.items()}, "speedup": x,
                      "speedup_bf16": xb, "speedup_bf16_vs_bf16_loop": xbb, "sqnr_bf16_db": sq}


def _one_expert(w_stack: Any, e: int) -> Any:
    """Expert ``e`` as a (1, N, K) stack (a view of its codes and scales)."""
    from dataclasses import replace

    from torchnext.lowp.mm.grouped import expert_weight

    w = expert_weight(w_stack, e)
    return replace(w, qdata=w.qdata.unsqueeze(0), scales=w.scales.unsqueeze(0), shape=torch.Size([1, *w.shape]),
                   block_dim=2)


def bench_autotune(reps: int, out: dict[str, Any]) -> None:
    print("\n## Autotuner: chosen backend vs every candidate, re-timed per key")
    rows = []
    for key, rec in sorted(at._MEMORY.items()):
        prob = rec_problem.get(key)
        if prob is None or len(rec.times_ms) < 1:
            continue
        cands = sorted(rec.times_ms)
        t = interleaved({c: (lambda c=c, prob=prob: run_problem(prob, c)) for c in cands}, reps)
        best = min(v[0] for v in t.values())
        ratio = t[rec.backend][0] / best
        times = ", ".join(f"{c} {t[c][0]:.2f}" for c in cands)
        print(f"{key}\n    chose {rec.backend}: {ratio:.3f}x of best  ({times} ms)")
        rows.append({"key": key, "chosen": rec.backend, "ratio_to_best": ratio, "median_ms": {c: v[0] for c, v in t.items()}})
    out["autotune"] = rows


rec_problem: dict[str, Any] = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--only", choices=("fused", "decode", "grouped"), default=None, help="run one section")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tn-autotune-")
    os.environ["TORCHNEXT_AUTOTUNE_CACHE"] = os.path.join(tmp, "autotune.json")
    os.environ["TORCHNEXT_AUTOTUNE"] = "1"
    header()
    nk = 1024 if args.quick else 4096
    out: dict[str, Any] = {"torch": torch.__version__}
    orig_select = at.select

    def remember(problem: Any) -> str:
        rec_problem[at.problem_key(problem)] = problem
        return orig_select(problem)

    at.select = remember  # type: ignore[assignment]
    if args.only in (None, "fused"):
        bench_fused(nk, nk, [1, 16, 256] if not args.quick else [1, 16], args.reps, out)
    if args.only in (None, "decode"):
        bench_decode(nk, nk, args.reps, out)
    if args.only in (None, "grouped"):
        bench_grouped(4096 if not args.quick else 512, 8, 2048 if not args.quick else 256, 1024 if not args.quick else 256,
                      max(3, args.reps // 2), out)
    if args.only is None:
        bench_autotune(args.reps, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
