"""torchnext.switch benchmarks (peers measured in the same run).

1. eager, tensor index: switch(...) vs calling the taken branch directly (goal: <= 50 us overhead); peers: eager
   torch.cond (2 branches) and, when torch >= 2.14 is installed, torch._higher_order_ops.switch.
2. compiled (Inductor, fullgraph) 8-branch switch vs the taken branch compiled alone (goal: <= 1.2x).
3. cold compile time (Inductor, caches off): switch over 8 branches vs a hand-written chain of nested torch.cond.

Usage: python benchmarks/control/bench_switch.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from _common import parse_args

from torchnext.control import switch


def median_us(fn: Callable[[], Any], *, number: int, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(samples)


def paired_us(fa: Callable[[], Any], fb: Callable[[], Any], *, number: int, repeat: int) -> tuple[float, float, float]:
    """Interleaved A/B timing (cancels load drift on a shared machine): medians of A, B and of the B/A ratios."""
    fa(), fb()
    ta, tb, ratio = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fa()
        a = (time.perf_counter() - t0) / number * 1e6
        t0 = time.perf_counter()
        for _ in range(number):
            fb()
        b = (time.perf_counter() - t0) / number * 1e6
        ta.append(a)
        tb.append(b)
        ratio.append(b / a)
    return statistics.median(ta), statistics.median(tb), statistics.median(ratio)


def experts(n: int, d: int, h: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(d, h, generator=g) / d**0.5, torch.randn(h, d, generator=g) / h**0.5) for _ in range(n)]
    return [lambda x, w1=w1, w2=w2: torch.relu(x @ w1) @ w2 for w1, w2 in ws]


def bench_eager(quick: bool) -> dict[str, float]:
    """Dispatch overhead is measured with cheap branches (elementwise ops on 4 elements), where the branch cost
    does not drown it in the noise of a shared machine."""
    n, r = (500, 7) if quick else (2000, 21)
    cheap = [torch.neg, torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.relu]
    v = torch.randn(4)
    idx = torch.tensor(5)
    direct, sw_t, _ = paired_us(lambda: cheap[5](v), lambda: switch(idx, cheap, (v,)), number=n, repeat=r)
    direct2, sw_i, _ = paired_us(lambda: cheap[5](v), lambda: switch(5, cheap, (v,)), number=n, repeat=r)
    res = {"direct_us": direct, "switch_tensor_us": sw_t, "switch_int_us": sw_i}
    res["overhead_us"] = sw_t - direct
    res["overhead_int_us"] = sw_i - direct2
    pred = torch.tensor(True)
    res["torch_cond_eager_us"] = median_us(lambda: torch.cond(pred, cheap[0], cheap[1], (v,)), number=20, repeat=5)
    native = getattr(torch._higher_order_ops, "switch", None)
    if native is not None:  # torch >= 2.14
        res["native_switch_us"] = median_us(lambda: native(idx, cheap, (v,)), number=20, repeat=5)
    return res


def bench_compiled(quick: bool) -> dict[str, float]:
    br = experts(8, 256, 1024)
    x = torch.randn(64, 256)
    sw = torch.compile(lambda i, x: switch(i, br, (x,)), fullgraph=True)
    alone = torch.compile(lambda x: br[5](x), fullgraph=True)
    idx = torch.tensor(5)
    for i in range(8):  # warm (compile once; every index runs the same graph)
        sw(torch.tensor(i), x)
    torch.testing.assert_close(sw(idx, x), br[5](x))
    n, r = (10, 7) if quick else (30, 21)
    alone_us, switch_us, ratio = paired_us(lambda: alone(x), lambda: sw(idx, x), number=n, repeat=r)
    res = {
        "alone_us": alone_us,
        "switch8_us": switch_us,
        "eager_branch_us": median_us(lambda: br[5](x), number=n, repeat=5),
    }
    res["ratio"] = ratio  # median of interleaved per-round ratios
    return res


def nested_cond(i: torch.Tensor, x: torch.Tensor, br: list[Any], k: int = 0) -> torch.Tensor:
    if k == len(br) - 1:
        return br[k](x)
    return torch.cond(i == k, br[k], lambda x: nested_cond(i, x, br, k + 1), (x,))


def bench_compile_time() -> dict[str, float]:
    import torch._inductor.config as icfg

    br = experts(8, 64, 128)
    x = torch.randn(4, 64)
    out: dict[str, float] = {}
    with icfg.patch(fx_graph_cache=False, autotune_local_cache=False):
        for name, fn in (
            ("switch8_compile_s", lambda i, x: switch(i, br, (x,))),
            ("nested_cond8_compile_s", lambda i, x: nested_cond(i, x, br)),
        ):
            torch._dynamo.reset()
            c = torch.compile(fn, fullgraph=True)
            t0 = time.perf_counter()
            y = c(torch.tensor(3), x)
            out[name] = time.perf_counter() - t0
            torch.testing.assert_close(y, br[3](x))
    out["ratio"] = out["switch8_compile_s"] / out["nested_cond8_compile_s"]
    return out


def main() -> None:
    a = parse_args(__doc__.split("\n")[0] if __doc__ else None)
    results: dict[str, Any] = {}
    e = results["eager"] = bench_eager(a.quick)
    print("\n[eager: dispatch overhead with cheap branches (elementwise op on 4 elements), 8 branches]")
    print(f"  direct branch call        {e['direct_us']:9.1f} us")
    print(
        f"  torchnext.switch (tensor) {e['switch_tensor_us']:9.1f} us   overhead {e['overhead_us']:.1f} us (goal <= 50)"
    )
    print(f"  torchnext.switch (int)    {e['switch_int_us']:9.1f} us   overhead {e['overhead_int_us']:.1f} us")
    print(f"  torch.cond eager (2 br.)  {e['torch_cond_eager_us']:9.1f} us   (torch 2.13 compiles inside eager cond)")
    if "native_switch_us" in e:
        print(f"  torch 2.14 native switch  {e['native_switch_us']:9.1f} us")
    else:
        print("  torch 2.14 native switch  (not installed; REFERENCE.md measured ~860 us)")
    c = results["compiled"] = bench_compiled(a.quick)
    print("\n[compiled, Inductor fullgraph, 8 experts 64x256 -> 1024 -> 256]")
    print(f"  taken branch compiled alone {c['alone_us']:9.1f} us")
    print(f"  switch over 8 branches      {c['switch8_us']:9.1f} us   ratio {c['ratio']:.2f}x (goal <= 1.2)")
    print(f"  (eager branch, for scale)   {c['eager_branch_us']:9.1f} us")
    t = results["compile_time"] = bench_compile_time()
    print("\n[cold compile time, Inductor, caches off, 8 branches]")
    print(f"  torchnext.switch (balanced cond tree) {t['switch8_compile_s']:6.2f} s")
    print(f"  nested torch.cond chain               {t['nested_cond8_compile_s']:6.2f} s   ratio {t['ratio']:.2f}x")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
