"""Benchmark torchnext.lowp quantize/dequantize against torchao 0.18's reference quantizers (same run).

    python benchmarks/lowp/bench_quantize.py [--size 4096] [--reps 5] [--json out.json] [--only casts]

Prints versions and machine first, then (1) a timing table: median and min ms per call (ours and torchao's calls
interleaved round by round), the speed-up over torchao (median ratio), and effective GB/s (bytes read + written) next to a plain ``copy_`` of the input (the memory-bound
ceiling); (2) the casts against the memory floor: every cast (both dims, stochastic rounding, swizzled scales) and
the two-copy training cast (``quantize_pair``: rowwise + columnwise from one read, optionally RHT + SR), the
compiled ``cpu`` quantizer and the previous ``eager`` one timed interleaved with ``dst.copy_(x)``; GB/s = (bytes of
``x`` + bytes written) / time, "% copy" = that over the GB/s (read + write) of a 128 MiB ``dst.copy_(src)`` timed in
the same rounds (four times the L3 here: a copy of a 32 MiB bf16 input alone would run from cache);
(3) a quantization-error table (SQNR dB) per format x distribution.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import torchnext
from torchnext.lowp import QuantOptions, quantization_error, quantize, quantize_pair
from torchnext.lowp.cpu import status as kernel_status
from torchnext.lowp.hadamard import rht_signs

warnings.filterwarnings("ignore")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _time(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def _time_interleaved(fns: list[Callable[[], Any] | None], reps: int) -> list[tuple[float, float]]:
    """(median ms, min ms) per function, the calls interleaved round by round (a load spike from another process
    then hits every function alike, so the ratios stay meaningful on a shared machine). ``None`` → NaN."""
    live = [fn for fn in fns if fn is not None]
    for fn in live:
        fn()  # warm-up
    times: dict[int, list[float]] = {id(fn): [] for fn in live}
    for r in range(reps):
        for fn in live if r % 2 == 0 else live[::-1]:
            t0 = time.perf_counter()
            fn()
            times[id(fn)].append(time.perf_counter() - t0)
    nan = float("nan")
    return [
        (statistics.median(times[id(fn)]) * 1e3, min(times[id(fn)]) * 1e3) if fn is not None else (nan, nan)
        for fn in fns
    ]


def _nbytes(out: Any) -> int:
    if hasattr(out, "nbytes") and not isinstance(out, torch.Tensor):
        return int(out.nbytes)
    if isinstance(out, torch.Tensor):
        return out.nbytes
    return sum(_nbytes(o) for o in out if o is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="square matrix size (default 4096)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per case (default 5)")
    ap.add_argument("--skip-error-table", action="store_true")
    ap.add_argument("--only", choices=("torchao", "casts"), help="run one timing section")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    import torchao
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  torchao {torchao.__version__}  "
          f"torchnext {torchnext.__version__}")
    print(f"cpu: {_cpu_name()}  cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}  "
          f"load avg: {os.getloadavg()[0]:.2f}")
    print(f"torchnext CPU kernels: {kernel_status().reason}")
    print(f"shape: {args.size}x{args.size}, {args.reps} reps (median, min); machine shared: ratios matter more\n")

    torch.manual_seed(0)
    n = args.size
    results: dict[str, Any] = {"timing": [], "error": []}
    rows = []
    if args.only != "casts":
        _torchao_table(n, args, results, rows, NVFP4Tensor, MXTensor, KernelPreference, per_tensor_amax_to_scale, to_mx)
    if args.only != "torchao":
        results["casts"] = _casts_table(n, args.reps)
    print(f"load avg at the end: {os.getloadavg()[0]:.2f}")

    if not args.skip_error_table:
        _error_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)
    return 0


def _casts_table(n: int, reps: int) -> list[dict[str, Any]]:
    """Every cast and the two-copy cast, cpu vs eager, interleaved with a plain copy of the input."""
    out = []
    print(f"## casts vs the copy bandwidth ({n}x{n}; GB/s = (bytes read + written) / time; cpu = compiled kernel, "
          "eager = previous path)")
    print("| input | cast | cpu ms | eager ms | x eager | cpu GB/s | copy GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|")
    te, rc = QuantOptions(recipe="te"), QuantOptions(scale_mode="rceil")
    sr = {"rounding": "stochastic", "seed": 7}
    src = torch.ones(32 << 20)  # 128 MiB: the memory copy bandwidth, not the cache's
    dst = torch.empty_like(src)
    dst.copy_(src)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
        single: list[tuple[str, str, dict[str, Any]]] = [
            ("NVFP4 torchao", "nvfp4", {}),
            ("NVFP4 torchao+gs", "nvfp4", {"global_scale": True}),
            ("NVFP4 te", "nvfp4", {"recipe": "te"}),
            ("NVFP4 te swizzled", "nvfp4", {"recipe": "te", "swizzle": True}),
            ("NVFP4 te dim=0", "nvfp4", {"recipe": "te", "dim": 0}),
            ("NVFP4 te SR", "nvfp4", {"recipe": "te", **sr}),
            ("MXFP8 E4M3", "mxfp8_e4m3", {}),
            ("MXFP8 E4M3 rceil", "mxfp8_e4m3", {"scale_mode": "rceil"}),
            ("MXFP8 E4M3 dim=0", "mxfp8_e4m3", {"dim": 0}),
            ("MXFP8 E4M3 SR", "mxfp8_e4m3", sr),
            ("MXFP8 E5M2", "mxfp8_e5m2", {}),
            ("MXFP4", "mxfp4", {}),
            ("MXFP4 rceil dim=0", "mxfp4", {"scale_mode": "rceil", "dim": 0}),
        ]
        cases: list[tuple[str, Callable[[], Any], Callable[[], Any], int]] = []
        for label, fmt, kw in single:
            q = quantize(x, fmt, **kw)
            cases.append((label, lambda fmt=fmt, kw=kw: quantize(x, fmt, backend="cpu", **kw),  # noqa: B023
                          lambda fmt=fmt, kw=kw: quantize(x, fmt, backend="eager", **kw), x.nbytes + q.nbytes))  # noqa: B023
        signs = rht_signs(3)
        pairs: list[tuple[str, str, QuantOptions, QuantOptions | None, torch.Tensor | None]] = [
            ("pair MXFP8 E4M3 rceil", "mxfp8_e4m3", rc, None, None),
            ("pair NVFP4 te", "nvfp4", te, None, None),
            ("pair NVFP4 te, col RHT+SR", "nvfp4", te, te.with_(rounding="stochastic", seed=9), signs),
        ]
        for label, fmt, o, co, sg in pairs:
            r, c = quantize_pair(x, fmt, options=o, col_options=co, rht_signs=sg)
            def run(backend: str, fmt: str = fmt, o: QuantOptions = o, co: QuantOptions | None = co,
                    sg: torch.Tensor | None = sg) -> Any:
                return quantize_pair(x, fmt, options=o.with_(backend=backend),  # noqa: B023
                                     col_options=None if co is None else co.with_(backend=backend), rht_signs=sg)
            cases.append((label, lambda run=run: run("cpu"), lambda run=run: run("eager"), x.nbytes + r.nbytes + c.nbytes))
        for label, cpu_fn, eager_fn, moved in cases:
            copy_fn = lambda: dst.copy_(src)  # noqa: E731
            (c_ms, _), (e_ms, _), (cp_ms, _) = _time_interleaved([cpu_fn, eager_fn, copy_fn], reps)
            gbs = moved / c_ms / 1e6
            copy_gbs = 2 * src.nbytes / cp_ms / 1e6
            row = {"dtype": str(dtype).removeprefix("torch."), "cast": label, "cpu_ms": c_ms, "eager_ms": e_ms,
                   "speedup": e_ms / c_ms, "cpu_gbs": gbs, "copy_gbs": copy_gbs, "pct_copy": 100 * gbs / copy_gbs,
                   "load": os.getloadavg()[0]}
            out.append(row)
            print(f"| {row['dtype']} | {label} | {c_ms:.2f} | {e_ms:.1f} | {row['speedup']:.1f}x | {gbs:.1f} | "
                  f"{copy_gbs:.1f} | {row['pct_copy']:.0f} % |")
    worst = min(out, key=lambda r: r["pct_copy"])
    print(f"\ngoal (issue #17): every cast >= 50 % of the copy bandwidth, the two-copy cast >= 50 % of one copy; "
          f"lowest: {worst['dtype']} {worst['cast']} {worst['pct_copy']:.0f} %\n")
    return out


def _torchao_table(n: int, args: Any, results: dict[str, Any], rows: list[dict[str, Any]], NVFP4Tensor: Any,
                   MXTensor: Any, KernelPreference: Any, per_tensor_amax_to_scale: Any, to_mx: Any) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
        y = torch.empty_like(x)
        copy_med, _ = _time(lambda: y.copy_(x), args.reps)  # noqa: B023
        copy_gbs = 2 * x.nbytes / copy_med / 1e6
        pts = per_tensor_amax_to_scale(x.float().abs().amax())
        cases: list[tuple[str, Callable[[], Any], Callable[[], Any] | None, str]] = [
            ("NVFP4 torchao", lambda: quantize(x, "nvfp4"), lambda: NVFP4Tensor.to_nvfp4(x), "to_nvfp4"),  # noqa: B023
            (
                "NVFP4 torchao+pts",
                lambda: quantize(x, "nvfp4", global_scale=pts),  # noqa: B023
                lambda: NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts),  # noqa: B023
                "to_nvfp4(pts)",
            ),
            (
                "NVFP4 te",
                lambda: quantize(x, "nvfp4", recipe="te"),  # noqa: B023
                lambda: NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.float().abs().amax())),  # noqa: B023
                "to_nvfp4(pts)*",
            ),
            ("MXFP8 E4M3", lambda: quantize(x, "mxfp8_e4m3"), lambda: to_mx(x, torch.float8_e4m3fn, 32), "to_mx"),  # noqa: B023
            ("MXFP8 E5M2", lambda: quantize(x, "mxfp8_e5m2"), lambda: to_mx(x, torch.float8_e5m2, 32), "to_mx"),  # noqa: B023
            ("MXFP4", lambda: quantize(x, "mxfp4"), lambda: to_mx(x, torch.float4_e2m1fn_x2, 32), "to_mx"),  # noqa: B023
        ]
        for name, ours, peer, peer_name in cases:
            q = ours()
            (ours_med, ours_min), (peer_med, _) = _time_interleaved([ours, peer], args.reps)
            moved = x.nbytes + q.nbytes
            gbs = moved / ours_med / 1e6
            # dequantize: ours vs torchao's
            if name.startswith("NVFP4"):
                ref = peer() if peer else None
                peer_deq = (lambda: ref.dequantize(torch.float32)) if ref is not None else None  # noqa: B023
            else:
                elem = {"MXFP8 E4M3": torch.float8_e4m3fn, "MXFP8 E5M2": torch.float8_e5m2}.get(
                    name, torch.float4_e2m1fn_x2
                )
                s, d = to_mx(x, elem, 32)
                mx = MXTensor(d, s, elem, 32, x.dtype, KernelPreference.EMULATED, None, False)
                peer_deq = lambda: mx.dequantize(torch.float32)  # noqa: B023, E731
            (deq_med, _), (pdeq_med, _) = _time_interleaved(
                [lambda: q.dequantize(torch.float32), peer_deq], args.reps  # noqa: B023
            )
            deq_gbs = (q.nbytes + x.numel() * 4) / deq_med / 1e6
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "format": name,
                "ours_ms": ours_med,
                "ours_min_ms": ours_min,
                "torchao_ms": peer_med,
                "torchao_fn": peer_name,
                "speedup": peer_med / ours_med,
                "quant_gbs": gbs,
                "copy_gbs": copy_gbs,
                "deq_ms": deq_med,
                "torchao_deq_ms": pdeq_med,
                "deq_speedup": pdeq_med / deq_med,
                "deq_gbs": deq_gbs,
            }
            rows.append(row)
            results["timing"].append(row)
            print(
                f"{row['dtype']:8s} {name:18s} quantize {ours_med:7.1f} ms (min {ours_min:6.1f})  torchao "
                f"{peer_med:7.1f} ms  x{row['speedup']:5.1f}  {gbs:5.1f} GB/s (copy {copy_gbs:4.1f})  | dequantize "
                f"{deq_med:6.1f} ms  torchao {pdeq_med:7.1f} ms  x{row['deq_speedup']:5.1f}"
            )
    print("\n| input | format | quantize ms (median / min) | torchao ms | speed-up | GB/s (copy_ GB/s) | dequantize ms | "
          "torchao dequantize ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['format']} | {r['ours_ms']:.1f} / {r['ours_min_ms']:.1f} | {r['torchao_ms']:.1f} "
            f"| {r['speedup']:.1f}x | {r['quant_gbs']:.1f} ({r['copy_gbs']:.1f}) | {r['deq_ms']:.1f} | "
            f"{r['torchao_deq_ms']:.1f} | {r['deq_speedup']:.1f}x |"
        )
    print("\n(*) torchao has no TE recipe on CPU: the peer is its two-level to_nvfp4, the same amount of work.\n")


def _error_table(results: dict[str, Any]) -> None:
    """SQNR of every format on named distributions (1024x1024 fp32)."""
    m = 1024
    g = torch.Generator().manual_seed(1)
    base = torch.randn(m, m, generator=g)
    dists = {
        "gaussian": base,
        "student-t(3)": torch.distributions.StudentT(3.0).sample((m, m)),
        "outliers (0.1% x100)": torch.where(torch.rand(m, m, generator=g) < 1e-3, base * 100, base),
        "uniform": torch.rand(m, m, generator=g) * 2 - 1,
        "log-uniform (2^±20)": base.sign() * torch.exp2(torch.rand(m, m, generator=g) * 40 - 20),
    }
    fmts = [
        ("NVFP4 torchao", "nvfp4", {}),
        ("NVFP4 torchao+pts", "nvfp4", {"global_scale": True}),
        ("NVFP4 te", "nvfp4", {"recipe": "te"}),
        ("MXFP8 E4M3", "mxfp8_e4m3", {}),
        ("MXFP8 E4M3 rceil", "mxfp8_e4m3", {"scale_mode": "rceil"}),
        ("MXFP8 E5M2", "mxfp8_e5m2", {}),
        ("MXFP4", "mxfp4", {}),
        ("MXFP4 rceil", "mxfp4", {"scale_mode": "rceil"}),
    ]
    print(f"\nSQNR dB ({m}x{m} fp32, higher is better)\n")
    print("| format | bits/elem | " + " | ".join(dists) + " |")
    print("|---|---|" + "---|" * len(dists))
    for label, fmt, opts in fmts:
        cells = []
        bits = 0.0
        for dname, d in dists.items():
            r = quantization_error(d, fmt, **opts)
            bits = r["bits_per_element"]
            cells.append(f"{r['sqnr_db']:.2f}")
            results["error"].append({"format": label, "distribution": dname, **r})
        print(f"| {label} | {bits:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
