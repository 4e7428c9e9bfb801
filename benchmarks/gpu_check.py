"""The one prepared GPU check: correctness first, then timings of every GPU path, against peers in the same run.

Run on a lent GPU (budget: a few minutes of device time; every section is bounded and independent)::

    python benchmarks/gpu_check.py --json "$OUT/gpu_check.json" | tee "$OUT/gpu_check.txt"

Sections (a failing section is reported and the next one runs; exit status 1 if any correctness check failed):

1. ``env``       torch / CUDA / device / capability / triton / torchao versions.
2. ``quantize``  the Triton quantize kernel: bytes identical to the CPU reference (NVFP4, MXFP8 E4M3/E5M2, MXFP4 on
                 fp32 and bf16 inputs), then timed against torchao's GPU quantizers (when installed) and our eager
                 path on the GPU, 8192 x 8192.
3. ``scaled_mm`` the fused Triton kernel (bias + gelu + amax in the kernel) vs ``reference`` (SQNR), then timed
                 against (a) ``torch._scaled_mm`` + the same epilogue as separate ops — block-scaled operands on
                 sm_100+, else FP8 row-wise operands (the closest hardware GEMM on sm_90) — and (b) the unfused
                 dequantize -> bf16 ``F.linear`` -> bias -> gelu -> amax; M in {1, 16, 256, 4096}, N = K = 4096.
4. ``grouped``   ``grouped_scaled_mm`` on CUDA (``torch._grouped_mm``, bf16 compute) vs a loop of per-expert
                 ``scaled_mm``: 8 experts, 4096 tokens, N = 2048, K = 1024 (the CPU benchmark's shapes).
5. ``training``  one training step (forward + backward, all three GEMMs quantized) of a converted linear layer per
                 recipe (``Recipe.MXFP8``, ``Recipe.NVFP4``), M = K = N = 4096: the six casts on the GPU (Triton
                 quantizer) bit-identical to the CPU reference quantizer's for the same seed, output / dX / dW SQNR vs
                 the fp32 step, and the step timed against a bf16 ``nn.Linear`` step.
6. ``comms``     a one-rank NCCL ``Communicator`` (one GPU: NCCL cannot put two ranks on one device) — every
                 collective against torch.distributed's result, then all_reduce latency vs the raw NCCL group.
7. ``process_group`` a one-rank ``backend="torchnext"`` group (its CUDA Communicator is NCCL): a DDP step on it
                 vs the same step on a plain NCCL group — gradients equal, step times interleaved; then issue #25's
                 comparison over NCCL: all_reduce of 4 B, 1 MiB and 16 MiB on both groups, interleaved (added µs
                 and ratio; whether the native path carried it -- on CUDA it does not yet: the Python path).

Timing: CUDA events around each call, warm-up first, median of ``--reps``; the peers are timed interleaved.
``--cpu-smoke`` runs every section's plumbing on CPU with tiny shapes and CPU stand-ins (eager backend instead of
Triton, gloo instead of NCCL) so CI keeps this script working without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torchnext.lowp import Epilogue, ScaledMMResult, dequantize, grouped_scaled_mm, quantize, scaled_mm
from torchnext.lowp.mm.grouped import grouped_reference

Result = dict[str, Any]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fns: dict[str, Callable[[], Any]], dev: torch.device, reps: int, warmup: int = 3) -> dict[str, float]:
    """name -> median ms, calls interleaved round by round (CUDA events on a GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(dev)
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                ts[k].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in ts.items()}


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    err = float(((x - ref) ** 2).sum())
    return math.inf if err == 0 else 10 * math.log10(float((ref**2).sum()) / err)


def section_env(dev: torch.device) -> Result:
    out: Result = {"torch": torch.__version__, "device": str(dev), "cuda": torch.version.cuda}
    if dev.type == "cuda":
        out["name"] = torch.cuda.get_device_name(dev)
        out["capability"] = list(torch.cuda.get_device_capability(dev))
    for mod in ("triton", "torchao"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # report whatever stops the import
            out[mod] = f"unavailable: {type(exc).__name__}: {exc}"
    print(json.dumps(out))
    return out


def section_quantize(dev: torch.device, smoke: bool, reps: int) -> Result:
    backend = "eager" if smoke else "triton"
    cases = [("nvfp4", {}), ("nvfp4", {"global_scale": True}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {}), ("mxfp4", {})]
    g = torch.Generator().manual_seed(0)
    mismatches = []
    x_small = torch.randn(96, 256, generator=g) * 3
    for dtype in (torch.float32, torch.bfloat16):
        for fmt, opts in cases:
            ref = quantize(x_small.to(dtype), fmt, backend="reference", **opts)
            got = quantize(x_small.to(dtype).to(dev), fmt, backend=backend, **opts).to("cpu")
            same = torch.equal(ref.qdata.view(torch.uint8), got.qdata.view(torch.uint8)) and torch.equal(
                ref.scale_bytes, got.scale_bytes
            )
            if not same:
                mismatches.append(f"{fmt} {opts} {dtype}")
    print(f"quantize ({backend}) vs CPU reference bytes: {'identical' if not mismatches else mismatches}")
    n = 256 if smoke else 8192
    timings = []
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except Exception:  # torchao is an optional peer here
        to_mx = NVFP4Tensor = None  # type: ignore[assignment,misc]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n, device=dev).to(dtype)
        for fmt, peer in (
            ("nvfp4", (lambda x=x: NVFP4Tensor.to_nvfp4(x)) if NVFP4Tensor else None),
            ("mxfp8_e4m3", (lambda x=x: to_mx(x, torch.float8_e4m3fn, 32)) if to_mx else None),
            ("mxfp4", (lambda x=x: to_mx(x, torch.float4_e2m1fn_x2, 32)) if to_mx else None),
        ):
            fns: dict[str, Callable[[], Any]] = {
                "torchnext": lambda x=x, fmt=fmt: quantize(x, fmt, backend=backend),
                "torchnext_eager": lambda x=x, fmt=fmt: quantize(x, fmt, backend="eager"),
            }
            if peer is not None:
                fns["torchao"] = peer
            try:
                t = timed(fns, dev, reps)
            except Exception as exc:  # a peer that cannot run on this device is reported, not fatal
                print(f"  {fmt} {dtype}: timing failed: {type(exc).__name__}: {exc}")
                continue
            row = {"format": fmt, "dtype": str(dtype), **{f"{k}_ms": v for k, v in t.items()}}
            if "torchao" in t:
                row["speedup_vs_torchao"] = t["torchao"] / t["torchnext"]
            timings.append(row)
            print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return {"ok": not mismatches, "mismatches": mismatches, "timings": timings}


def _fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.float()


def section_scaled_mm(dev: torch.device, smoke: bool, reps: int) -> Result:
    backend = "eager" if smoke else "triton"
    nk = 256 if smoke else 4096
    ms = [1, 16] if smoke else [1, 16, 256, 4096]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(nk, nk, generator=g).to(dev)
    bias = torch.randn(nk, generator=g).to(dev)
    sm100 = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 10
    rows: list[Result] = []
    ok = True
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        wq = quantize(w, fmt)
        for m in ms:
            a = torch.randn(m, nk, generator=g).to(dev)
            ep = Epilogue(bias=bias, activation="gelu", output_amax=True)
            res = scaled_mm(a, wq, epilogue=ep, backend=backend)
            ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
            assert isinstance(res, ScaledMMResult) and isinstance(ref, ScaledMMResult)
            q = sqnr_db(res.output, ref.output)
            amax_ok = res.amax is not None and float(res.amax) == float(res.output.abs().max())
            ok &= q >= 60 and amax_ok
            wd16 = dequantize(wq, torch.bfloat16)
            a16 = a.bfloat16()

            def fused(a: torch.Tensor = a, ep: Epilogue = ep, wq: Any = wq) -> Any:
                return scaled_mm(a, wq, epilogue=ep, backend=backend)

            def unfused(a: torch.Tensor = a, wq: Any = wq) -> Any:
                y = F.linear(a.bfloat16(), dequantize(wq, torch.bfloat16)).float() + bias
                y = F.gelu(y)
                return y, y.abs().max()

            def gemm_then_epilogue_bf16(a16: torch.Tensor = a16, wd16: torch.Tensor = wd16) -> Any:
                y = F.gelu(F.linear(a16, wd16).float() + bias)  # weights decoded once, outside the timing
                return y, y.abs().max()

            fns: dict[str, Callable[[], Any]] = {"fused": fused, "unfused": unfused, "bf16_gemm+epilogue": gemm_then_epilogue_bf16}
            peer_name = None
            if sm100 and not smoke:
                aq = quantize(a, fmt)

                def aten_blockscaled(aq: Any = aq, wq: Any = wq, ep: Epilogue = ep) -> Any:
                    return scaled_mm(aq, wq, epilogue=ep, backend="aten")  # torch._scaled_mm, epilogue as eager ops

                fns["scaled_mm+epilogue"] = aten_blockscaled
                peer_name = "torch._scaled_mm block-scaled (both operands quantized) + eager epilogue"
            elif dev.type == "cuda" and m % 16 == 0:
                a8, sa = _fp8_rowwise(a)
                w8, sw = _fp8_rowwise(w)

                def fp8_rowwise(a8: torch.Tensor = a8, sa: torch.Tensor = sa, w8: torch.Tensor = w8, sw: torch.Tensor = sw) -> Any:
                    y = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw.t().contiguous(), out_dtype=torch.bfloat16)
                    y = F.gelu(y.float() + bias)
                    return y, y.abs().max()

                fns["scaled_mm+epilogue"] = fp8_rowwise
                peer_name = "torch._scaled_mm FP8 E4M3 row-wise (sm_90 has no block-scaled GEMM) + eager epilogue"
            try:
                t = timed(fns, dev, reps)
            except Exception as exc:
                print(f"  {fmt} M={m}: timing failed: {type(exc).__name__}: {exc}")
                t = timed({"fused": fused, "unfused": unfused}, dev, reps)
            row = {"format": fmt, "m": m, "sqnr_db": q, "amax_ok": amax_ok, "peer": peer_name, **{f"{k}_ms": v for k, v in t.items()}}
            for k in t:
                if k != "fused":
                    row[f"x_vs_{k}"] = t[k] / t["fused"]
            rows.append(row)
            print(f"  {fmt:<11} M={m:<5} SQNR {q:6.1f} dB amax {'ok' if amax_ok else 'WRONG'}  "
                  + "  ".join(f"{k} {v:.3f} ms" for k, v in t.items()))
    return {"ok": ok, "rows": rows}


def section_grouped(dev: torch.device, smoke: bool, reps: int) -> Result:
    tokens, experts, n, k = (256, 4, 64, 128) if smoke else (4096, 8, 2048, 1024)
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)  # Dirichlet.sample takes no generator
    sizes = torch.distributions.Dirichlet(torch.full((experts,), 0.7)).sample((1,))[0]
    ids = torch.multinomial(sizes, tokens, replacement=True, generator=g).sort().values
    offs = torch.bincount(ids, minlength=experts).cumsum(0).to(dev)
    a = torch.randn(tokens, k, generator=g).to(dev)
    wq = quantize(torch.randn(experts, n, k, generator=g).to(dev), "nvfp4")
    ep = Epilogue(bias=torch.randn(n, generator=g).to(dev), activation="silu")
    ref = grouped_reference(a, wq, offs, epilogue=ep)
    out32 = grouped_scaled_mm(a, wq, offs, epilogue=ep)
    out16 = grouped_scaled_mm(a, wq, offs, epilogue=ep, compute_dtype=torch.bfloat16)
    assert isinstance(out32, torch.Tensor) and isinstance(out16, torch.Tensor)
    q32, q16 = sqnr_db(out32, ref), sqnr_db(out16, ref)
    loop_backend = "eager" if smoke else "triton"  # no autotuning inside the timed loop (one key per group size)
    t = timed(
        {
            "grouped_fp32": lambda: grouped_scaled_mm(a, wq, offs, epilogue=ep),
            "grouped_bf16": lambda: grouped_scaled_mm(a, wq, offs, epilogue=ep, compute_dtype=torch.bfloat16),
            "loop_scaled_mm": lambda: grouped_reference(a, wq, offs, epilogue=ep, backend=loop_backend),
        },
        dev,
        reps,
    )
    print(f"  SQNR vs loop: fp32 {q32:.1f} dB, bf16 {q16:.1f} dB; " + "  ".join(f"{kk} {v:.3f} ms" for kk, v in t.items()))
    return {"ok": q32 >= 60 and q16 >= 40, "sqnr_fp32": q32, "sqnr_bf16": q16, **{f"{kk}_ms": v for kk, v in t.items()},
            "x_fp32": t["loop_scaled_mm"] / t["grouped_fp32"], "x_bf16": t["loop_scaled_mm"] / t["grouped_bf16"]}


def section_training(dev: torch.device, smoke: bool, reps: int) -> Result:
    from torch import nn

    from torchnext.lowp import Recipe, convert_to_lowp_training
    from torchnext.lowp.training.ops import train_cast

    m, k, n = (64, 128, 96) if smoke else (4096, 4096, 4096)
    quantizer = "eager" if smoke else "triton"
    backend = "eager" if smoke else "auto"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).to(dev)
    dy = torch.randn(m, n, generator=g).to(dev)
    rows: list[Result] = []
    ok = True
    thresholds = {"mxfp8_e4m3": 25.0, "nvfp4": 12.0}
    for recipe in (Recipe.MXFP8, Recipe.NVFP4):
        torch.manual_seed(0)
        ref = nn.Linear(k, n, device=dev)
        layer = nn.Linear(k, n, device=dev)
        layer.load_state_dict(ref.state_dict())
        layer = convert_to_lowp_training(layer, recipe, seed=7, quantizer=quantizer, backend=backend)
        signs = getattr(layer, "rht_signs", None)
        # the six casts: the device's quantizer vs the CPU reference quantizer, same seed and step
        step = torch.tensor(5)
        mismatched = []
        for role, t in (("x", x), ("w", layer.weight.detach()), ("dy", dy)):
            s_dev = signs if role != "w" else None
            got = train_cast(t, s_dev, step.to(dev), recipe.key, role, 7, layer.layer, quantizer, True, True)
            want = train_cast(t.cpu(), s_dev.cpu() if s_dev is not None else None, step, recipe.key, role, 7,
                              layer.layer, "reference", True, True)
            if not all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True)):
                mismatched.append(role)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = layer(xa)
        y.backward(dy)
        y_ref = ref(xb)
        y_ref.backward(dy)
        q = {"y": sqnr_db(y.detach(), y_ref.detach()), "dx": sqnr_db(xa.grad, xb.grad),
             "dw": sqnr_db(layer.weight.grad, ref.weight.grad)}
        ref16 = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
        x16, dy16 = x.bfloat16().requires_grad_(), dy.bfloat16()

        def lowp_step(layer: Any = layer) -> None:
            xx = x.detach().requires_grad_()
            layer(xx).backward(dy)

        def bf16_step(ref16: Any = ref16, x16: torch.Tensor = x16, dy16: torch.Tensor = dy16) -> None:
            xx = x16.detach().requires_grad_()
            ref16(xx).backward(dy16)

        t = timed({"lowp_step": lowp_step, "bf16_step": bf16_step}, dev, max(2, reps // 4), warmup=2)
        good = not mismatched and min(q.values()) >= thresholds[recipe.format.value]
        ok &= good
        row = {"recipe": str(recipe), "casts_bit_identical_to_cpu": not mismatched, "mismatched": mismatched,
               **{f"sqnr_{kk}_db": v for kk, v in q.items()}, **{f"{kk}_ms": v for kk, v in t.items()},
               "x_vs_bf16": t["lowp_step"] / t["bf16_step"]}
        rows.append(row)
        print(f"  {recipe}: casts {'= CPU reference' if not mismatched else 'DIFFER ' + str(mismatched)}; SQNR y "
              f"{q['y']:.1f} dx {q['dx']:.1f} dw {q['dw']:.1f} dB; step {t['lowp_step']:.2f} ms vs bf16 "
              f"{t['bf16_step']:.2f} ms")
    return {"ok": ok, "rows": rows}


def section_comms(dev: torch.device, smoke: bool, reps: int) -> Result:
    import torch.distributed as dist

    from torchnext.comms import Communicator

    backend = "gloo" if smoke else "nccl"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=dt.timedelta(seconds=30))
    comm = Communicator(store, 0, 1, backend=backend, device=dev, timeout=dt.timedelta(seconds=30))
    try:
        x = torch.arange(1024, dtype=torch.float32, device=dev)
        checks = {}
        y = x.clone()
        comm.all_reduce(y)
        checks["all_reduce"] = torch.equal(y, x)
        outs = [torch.empty_like(x)]
        comm.all_gather(outs, x)
        checks["all_gather"] = torch.equal(outs[0], x)
        b = x.clone()
        comm.broadcast(b, 0)
        checks["broadcast"] = torch.equal(b, x)
        comm.barrier()
        work = comm.all_reduce(x.clone(), async_op=True)
        work.wait()
        checks["async"] = True
        small = torch.ones(1, device=dev)
        raw_store = dist.PrefixStore("gpu_check_raw", store)
        td = dt.timedelta(seconds=30)
        raw = dist.ProcessGroupGloo(raw_store, 0, 1, td) if smoke else dist.ProcessGroupNCCL(raw_store, 0, 1)
        t = timed(
            {
                "communicator_all_reduce_4B": lambda: comm.all_reduce(small),
                "raw_pg_all_reduce_4B": lambda: raw.allreduce([small]).wait(),
            },
            dev,
            reps * 10,
        )
        print(f"  checks {checks}; " + "  ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()))
        return {"ok": all(checks.values()), "checks": checks, **{f"{k}_ms": v for k, v in t.items()},
                "added_latency": t["communicator_all_reduce_4B"] / t["raw_pg_all_reduce_4B"] - 1}
    finally:
        comm.shutdown()


def section_process_group(dev: torch.device, smoke: bool, reps: int) -> Result:
    """A one-rank torchnext process group on the GPU (its CUDA Communicator is NCCL): a DDP step on it against the
    same DDP step on a plain NCCL group -- gradients equal, step times interleaved."""
    import torch.distributed as dist
    from torch import nn

    import torchnext

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=dt.timedelta(seconds=30))
    dist.init_process_group("torchnext", store=store, rank=0, world_size=1)
    steps: dict[str, Callable[[], None]] = {}
    try:
        ours = dist.group.WORLD
        assert isinstance(ours, torchnext.comms.TorchnextProcessGroup)
        plain = dist.new_group([0], backend="gloo" if smoke else "nccl")
        checks: dict[str, bool] = {"cuda_communicator": smoke or ours.communicator("cuda").backend == "nccl"}
        width = 64 if smoke else 4096
        x = torch.randn(16, width, device=dev)
        grads = {}
        for name, group in (("torchnext", ours), ("plain", plain)):
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(dev),
                process_group=group, device_ids=None if smoke else [dev.index or 0])
            model(x).square().mean().backward()
            grads[name] = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()

            def step(model: nn.Module = model) -> None:
                model(x).square().mean().backward()
                model.zero_grad()

            steps[name] = step
        del model
        checks["ddp_grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads["torchnext"], grads["plain"], strict=True))
        t = timed({"torchnext_ddp_step": steps["torchnext"], "plain_ddp_step": steps["plain"]}, dev, reps)
        print(f"  checks {checks}; " + "  ".join(f"{k} {v:.3f} ms" for k, v in t.items()))
        # issue #25's comparison over NCCL: all_reduce on the torchnext group vs the plain group, interleaved (a
        # CUDA event pair around each call: the host's work before the kernel is enqueued counts)
        sizes = {"4B": 1, "1MiB": 1 << 18, "16MiB": 1 << 22}
        ar: dict[str, Any] = {"native_path": bool(getattr(ours, "native", False))}
        for label, numel in sizes.items():
            buf = torch.ones(numel, device=dev)
            ta = timed({"torchnext": lambda b=buf: dist.all_reduce(b, group=ours),
                        "plain": lambda b=buf: dist.all_reduce(b, group=plain)}, dev, reps * 4 if numel == 1 else reps)
            ar[label] = {"torchnext_ms": ta["torchnext"], "plain_ms": ta["plain"],
                         "added_us": (ta["torchnext"] - ta["plain"]) * 1e3, "ratio": ta["plain"] / ta["torchnext"]}
        probe = torch.full((4,), 2.0, device=dev)
        dist.all_reduce(probe, group=ours)
        checks["all_reduce_value"] = bool(torch.equal(probe.cpu(), torch.full((4,), 2.0)))  # one rank: unchanged
        print("  all_reduce " + "  ".join(f"{k}: +{v['added_us']:.1f} us ({v['ratio']:.3f})" for k, v in ar.items()
                                          if isinstance(v, dict)) + f"  (native path: {ar['native_path']})")
        return {"ok": all(checks.values()), "checks": checks, **{f"{k}_ms": v for k, v in t.items()},
                "ratio": t["plain_ddp_step"] / t["torchnext_ddp_step"], "all_reduce": ar}
    finally:
        # DDP's reducers before their groups: torch's teardown in the other order aborted the process at exit
        # ("terminate called without an active exception": once in 7 runs)
        steps.clear()
        gc.collect()
        dist.destroy_process_group()


SECTIONS: dict[str, Callable[[torch.device, bool, int], Result]] = {
    "quantize": section_quantize,
    "scaled_mm": section_scaled_mm,
    "grouped": section_grouped,
    "training": section_training,
    "comms": section_comms,
    "process_group": section_process_group,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run these sections (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="exercise the plumbing on CPU (no figures worth keeping)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --cpu-smoke to exercise the script on CPU)")
        return 2
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    report: Result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "env": section_env(dev)}
    failed = []
    for name in args.only or list(SECTIONS):
        print(f"\n## {name}")
        t0 = time.perf_counter()
        try:
            res = SECTIONS[name](dev, args.cpu_smoke, args.reps)
        except Exception as exc:  # one broken section must not hide the others' figures
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report[name] = res
        if not res.get("ok", False):
            failed.append(name)
        print(f"## {name}: {'ok' if res.get('ok') else 'FAILED'} in {res['seconds']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(f"\ngpu_check: {'all sections ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
