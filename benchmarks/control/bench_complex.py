"""Complex -> real decomposition benchmark: complex programs, decomposed + Inductor vs eager complex (same run).

Programs: a DFT-as-matmul filter (signal processing) and a small complex MLP. Peers: eager complex, plain
torch.compile (Inductor on complex dtypes), and torch's own ``enable_complex_wrapper`` flag on ``a*b + a``.

Usage: python benchmarks/control/bench_complex.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from _common import parse_args

import torchnext


def timed_us(fns: dict[str, Callable[[], Any]], *, number: int, repeat: int) -> dict[str, float]:
    """Round-robin timing of several callables (cancels load drift); median microseconds per call."""
    for f in fns.values():
        f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                f()
            samples[k].append((time.perf_counter() - t0) / number * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def dft_filter(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    k = torch.arange(n, dtype=torch.float32)
    F = torch.polar(torch.ones(n, n), -2 * math.pi * k[:, None] * k[None, :] / n)
    X = x.to(torch.complex64) @ F.mT
    Y = X * w + X
    y = (Y @ F.conj()) / n
    return y.abs() + y.real


def complex_mlp(z: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = z @ w1
    h = h * torch.sigmoid(h.abs() - 1.0)  # a modReLU-like gate on the magnitude
    return h @ w2 + z * torch.exp(1j * torch.angle(z))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def bench(name: str, fn: Callable[..., torch.Tensor], args: tuple[Any, ...], quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    dec = torchnext.compile(fn, decompose_complex=True, fullgraph=True)
    ref = fn(*args)
    err = rel_err(dec(*args), ref)
    compile_dec = time.perf_counter() - t0
    fns: dict[str, Callable[[], Any]] = {"eager": lambda: fn(*args), "decomposed_inductor": lambda: dec(*args)}
    res: dict[str, Any] = {"rel_err": err, "compile_s_decomposed": compile_dec}
    try:
        t0 = time.perf_counter()
        plain = torch.compile(fn, fullgraph=True)
        res["rel_err_plain"] = rel_err(plain(*args), ref)
        res["compile_s_plain"] = time.perf_counter() - t0
        fns["plain_inductor"] = lambda: plain(*args)
    except Exception as e:  # report, do not hide
        res["plain_inductor_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    n, r = (5, 5) if quick else (20, 11)
    res["us"] = timed_us(fns, number=n, repeat=r)
    res["speedup_vs_eager"] = res["us"]["eager"] / res["us"]["decomposed_inductor"]
    print(f"\n[{name}]  rel err vs eager {err:.2e}   compile {compile_dec:.1f} s")
    for k, v in res["us"].items():
        print(f"  {k:22s} {v:10.1f} us   ({res['us']['eager'] / v:.2f}x eager)")
    if "plain_inductor_error" in res:
        print(f"  plain_inductor         failed: {res['plain_inductor_error']}")
    return res


def complex_wrapper_probe() -> str:
    """What torch's own flag does on a*b + a under Inductor (REFERENCE.md: it fails in 2.14.1)."""
    import torch._functorch.config as fcfg

    if not hasattr(fcfg, "enable_complex_wrapper"):
        return "torch._functorch.config.enable_complex_wrapper: absent"
    torch._dynamo.reset()
    a, b = torch.randn(64, dtype=torch.complex64), torch.randn(64, dtype=torch.complex64)
    try:
        with fcfg.patch(enable_complex_wrapper=True):
            out = torch.compile(lambda a, b: a * b + a, fullgraph=True)(a, b)
        return f"enable_complex_wrapper=True, Inductor, a*b+a: ran, rel err {rel_err(out, a * b + a):.1e}"
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return f"enable_complex_wrapper=True, Inductor, a*b+a: {type(e).__name__}: {' / '.join(lines[:2])[:200]}"


def main() -> None:
    a = parse_args(__doc__.split("\n")[0] if __doc__ else None)
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {}
    x = torch.randn(64, 256, generator=g)
    w = torch.randn(256, dtype=torch.complex64, generator=g)
    results["dft_filter_64x256"] = bench("DFT-as-matmul filter, 64 signals x 256", dft_filter, (x, w), a.quick)
    z = torch.randn(128, 256, dtype=torch.complex64, generator=g)
    w1 = torch.randn(256, 512, dtype=torch.complex64, generator=g) / 16
    w2 = torch.randn(512, 256, dtype=torch.complex64, generator=g) / 22
    results["complex_mlp_128x256x512"] = bench("complex MLP 128x256 -> 512 -> 256", complex_mlp, (z, w1, w2), a.quick)
    probe = results["enable_complex_wrapper"] = complex_wrapper_probe()
    print(f"\n[torch's own flag] {probe}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
