"""Benchmark low-precision training on CPU: step time of converted models vs the fp32 step and torchao's emulated
MXFP8 training, and the throughput of the training casts.

Run: ``python benchmarks/lowp/bench_training.py [--reps 7] [--quick] [--only step|casts] [--json out.json]``

* ``step``: one forward + backward (+ no optimizer) of (a) an MLP (Linear d -> 4d -> d, GELU) and (b) a transformer
  block (LayerNorm, qkv, SDPA, proj, MLP), M = batch x seq tokens: fp32 ``nn`` modules; torchao 0.18's
  ``MXFP8TrainingOpConfig`` EMULATED RCEIL (``quantize_``); ours converted with ``Recipe.MXFP8`` and
  ``Recipe.NVFP4``, each with the scaled_mm backends ``eager`` (fp32 GEMMs on the decoded operands) and
  ``eager_bf16`` (the operands decoded exactly to bf16, bf16 GEMMs). Same weights and inputs, timed interleaved
  round by round (so background load hits all alike): medians and ratios.
* ``casts``: ``quantize_pair`` (both copies of one (M, K) activation, the wgrad copy with RHT under NVFP4) vs
  torchao's two MXFP8 casts (``to_mx`` of X and of X.T), in ms and input GB/s (bytes of X read per call).

Versions, machine and load average are printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from torchnext.lowp import QuantOptions, Recipe, convert_to_lowp_training, quantize_pair, rht_signs


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """name -> (median ms, min ms), each function once per round."""
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


def header() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads()}
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except Exception as exc:  # the peer is optional
        info["torchao"] = f"unavailable: {exc}"
    info["load_start"] = os.getloadavg()[0]
    print(", ".join(f"{k} {v}" for k, v in info.items()))
    return info


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


def _variants(make: Callable[[], nn.Module]) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = make()
    out: dict[str, nn.Module] = {"fp32": base}
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        ao = make()
        ao.load_state_dict(base.state_dict())
        quantize_(ao, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL))
        out["torchao_mxfp8_emulated"] = ao
    except Exception as exc:  # the peer is optional
        print(f"  torchao peer unavailable: {type(exc).__name__}: {exc}")
    for name, recipe in (("ours_mxfp8", Recipe.MXFP8), ("ours_nvfp4", Recipe.NVFP4)):
        for backend in ("eager", "eager_bf16"):
            m = make()
            m.load_state_dict(base.state_dict())
            out[f"{name} ({backend})"] = convert_to_lowp_training(m, recipe, seed=1, backend=backend)
    return out


def section_step(reps: int, quick: bool) -> dict[str, Any]:
    d, batch, seq = (256, 2, 128) if quick else (512, 4, 256)
    rows = []
    cases: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
        ("mlp", lambda: MLP(d), (batch * seq, d)),
        ("transformer_block", lambda: Block(d), (batch, seq, d)),
    ]
    for case, make, shape in cases:
        mods = _variants(make)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g)
        dy = torch.randn(*shape, generator=g)

        def step(m: nn.Module, x: torch.Tensor = x, dy: torch.Tensor = dy) -> Callable[[], None]:
            def run() -> None:
                xx = x.detach().requires_grad_()
                m(xx).backward(dy)
                for p in m.parameters():
                    p.grad = None
            return run

        t = interleaved({k: step(m) for k, m in mods.items()}, reps)
        fp32 = t["fp32"][0]
        ao = t.get("torchao_mxfp8_emulated", (float("nan"),))[0]
        print(f"\n{case}: d={d}, tokens={batch * seq} (load {os.getloadavg()[0]:.2f})")
        print("| configuration | median ms | min ms | x fp32 step | x torchao emulated MXFP8 |")
        print("|---|---|---|---|---|")
        for k, (med, mn) in t.items():
            print(f"| {k} | {med:.1f} | {mn:.1f} | {med / fp32:.2f} | {med / ao:.2f} |")
            rows.append({"case": case, "config": k, "median_ms": med, "min_ms": mn, "x_fp32": med / fp32,
                         "x_torchao": med / ao})
    return {"d": d, "tokens": batch * seq, "rows": rows}


def section_casts(reps: int, quick: bool) -> dict[str, Any]:
    n = 1024 if quick else 4096
    rows = []
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # the peer is optional
        to_mx = None  # type: ignore[assignment]
    signs = rht_signs(0)
    print(f"\ncasts: both copies of an ({n}, {n}) activation (load {os.getloadavg()[0]:.2f})")
    print("| input | cast | median ms | input GB/s |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n).to(dtype)
        fns: dict[str, Callable[[], Any]] = {
            "mxfp8 quantize_pair": lambda x=x: quantize_pair(x, "mxfp8_e4m3", options=QuantOptions(scale_mode="rceil")),
            "nvfp4 quantize_pair": lambda x=x: quantize_pair(x, "nvfp4", options=QuantOptions(recipe="te")),
            "nvfp4 quantize_pair + RHT (wgrad copy)": lambda x=x: quantize_pair(
                x, "nvfp4", options=QuantOptions(recipe="te"), rht_signs=signs),
            "nvfp4 quantize_pair + RHT + SR": lambda x=x: quantize_pair(
                x, "nvfp4", options=QuantOptions(recipe="te", rounding="stochastic", seed=1),
                col_options=QuantOptions(recipe="te", rounding="stochastic", seed=2), rht_signs=signs),
        }
        if to_mx is not None:
            def ao_pair(x: torch.Tensor = x) -> Any:
                to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
                return to_mx(x.t().contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)

            fns["torchao mxfp8 to_mx(X) + to_mx(X.T)"] = ao_pair
        t = interleaved(fns, reps, warmup=1)
        for k, (med, _) in t.items():
            gbs = x.numel() * x.element_size() / (med * 1e-3) / 1e9
            print(f"| {str(dtype).removeprefix('torch.')} | {k} | {med:.1f} | {gbs:.2f} |")
            rows.append({"dtype": str(dtype), "cast": k, "median_ms": med, "input_gb_s": gbs})
    return {"n": n, "rows": rows}


SECTIONS = {"step": section_step, "casts": section_casts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--only", choices=sorted(SECTIONS), action="append")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"env": header()}
    for name in args.only or list(SECTIONS):
        report[name] = SECTIONS[name](args.reps, args.quick)
    report["load_end"] = os.getloadavg()[0]
    print(f"\nload average at end: {report['load_end']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
