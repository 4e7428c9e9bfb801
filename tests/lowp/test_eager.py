"""The eager backend's chunking and worker threads: many chunks give the reference's bytes; torch's thread
settings are left as they were."""

from __future__ import annotations

import threading

import pytest
import torch

from torchnext.lowp import Format, quantize
from torchnext.lowp.quantizers import eager as eager_mod
from torchnext.testing.procfs import fork_without_garbage

OPTS = {"nvfp4": [{}, {"global_scale": True}, {"recipe": "te"}], "mxfp8_e4m3": [{}, {"scale_mode": "rceil"}],
        "mxfp8_e5m2": [{}], "mxfp4": [{}, {"scale_mode": "rceil"}]}


@pytest.mark.parametrize("fmt", [f.value for f in Format])
def test_many_chunks_match_reference(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eager_mod, "CHUNK_ELEMENTS", 512)  # ~200 chunks over the worker threads
    x = torch.randn(301, 320) * torch.exp2(torch.randint(-8, 8, (301, 1)).float())
    x[7, 9] = float("nan")
    for opts in OPTS[fmt]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # bf16/fp16 chunks are widened to fp32
            a = quantize(x.to(dtype), fmt, backend="reference", **opts)
            b = quantize(x.to(dtype), fmt, backend="eager", **opts)
            assert torch.equal(a.scale_bytes, b.scale_bytes)
            nan_rows = torch.isnan(x).any(dim=1)  # NaN element codes are unspecified in sign
            assert torch.equal(a.qdata.view(torch.uint8)[~nan_rows], b.qdata.view(torch.uint8)[~nan_rows])
            da, db = a.dequantize(backend="reference"), b.dequantize(backend="eager")
            assert torch.equal(da.nan_to_num(7.0), db.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_half_inputs_match_reference_on_edges(dtype: torch.dtype) -> None:
    """The eager path widens bf16/fp16 chunks to fp32 before the amax and the scale multiply: same bytes as the
    reference (which multiplies the half-precision input by fp32 multipliers) on subnormals, ±Inf, ±0 and ties."""
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g).to(dtype)
    x[0] = fi.smallest_normal * torch.rand(64, generator=g).to(dtype)  # subnormal block
    x[1, :32] = 0.0
    x[1, 32:] = -0.0
    x[2, 5] = float("inf")
    x[3, 7] = -float("inf")
    x[4] = fi.max * torch.rand(64, generator=g).to(dtype)
    x[5] = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 6.0, -0.25, -5.0] * 8, dtype=dtype)  # FP4 ties
    for fmt, opts_list in OPTS.items():
        for opts in opts_list:
            a = quantize(x, fmt, backend="reference", **opts)
            b = quantize(x, fmt, backend="eager", **opts)
            assert torch.equal(a.scale_bytes, b.scale_bytes), (fmt, opts)
            assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)), (fmt, opts)


def test_thread_settings_are_restored() -> None:
    before = torch.get_num_threads()
    quantize(torch.randn(1024, 1024), "nvfp4").dequantize()
    assert torch.get_num_threads() == before
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join(timeout=30)
    assert seen == [before]  # a thread started afterwards gets the process default again


def test_quantize_in_a_forked_child() -> None:
    """The worker pool is per process: a child forked after the parent used it must not hang."""
    import multiprocessing as mp

    x = torch.randn(1024, 1024)
    want = quantize(x, "nvfp4").qdata  # the parent's pool now exists
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(x, q))
    with fork_without_garbage():  # the child must not collect this process's garbage (finalizers that join threads)
        proc.start()
    try:
        got = q.get(timeout=120)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert got == want.numpy().tobytes()


def _child(x: torch.Tensor, q: object) -> None:
    q.put(quantize(x, "nvfp4").qdata.numpy().tobytes())  # plain bytes: no tensor sharing between processes  # type: ignore[attr-defined]
