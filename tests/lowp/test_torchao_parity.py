"""Bit-exact parity with torchao 0.18's reference quantizers (qdata bytes and scale bytes)."""

from __future__ import annotations

import warnings

import pytest
import torch
from lowp_data import distributions

from torchnext.lowp import quantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    ao_nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    ao_cfg = pytest.importorskip("torchao.prototype.mx_formats.config")

SHAPES = [(128, 64), (130, 96), (4, 256, 32)]
BACKENDS = ["reference", "eager"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    a, b = _bytes(ours), _bytes(theirs)
    assert a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} bytes differ, first at {diff[:5].flatten().tolist()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_level", [False, True])
def test_nvfp4_matches_torchao(backend: str, dtype: torch.dtype, two_level: bool) -> None:
    for shape in SHAPES:
        for name, x in distributions(shape):
            x = x.to(dtype)
            pts = None
            if two_level:
                pts = ao_nv.per_tensor_amax_to_scale(x.float().abs().amax())
                if not 2.0**-126 <= float(pts) < float("inf"):
                    continue  # torchao turns zeros into NaN (0 * inf) here; we refuse such a scale (tested below)
            for swizzle in (False, True):
                if swizzle and len(shape) == 3 and shape[1] % 128:
                    continue  # torchao's 3-D swizzle needs M % 128 == 0
                ref = ao_nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts, is_swizzled_scales=swizzle)
                q = quantize(x, "nvfp4", global_scale=pts if two_level else False, swizzle=swizzle, backend=backend)
                _assert_same(q.qdata, ref.qdata, f"nvfp4 qdata {name} {shape} {dtype} sw={swizzle}")
                _assert_same(q.scales, ref.scale, f"nvfp4 scales {name} {shape} {dtype} sw={swizzle}")
                if two_level:
                    assert torch.equal(q.global_scale, pts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize(
    ("fmt", "elem"),
    [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2), ("mxfp4", torch.float4_e2m1fn_x2)],
)
def test_mx_matches_torchao(backend: str, mode: str, fmt: str, elem: torch.dtype) -> None:
    scm = ao_cfg.ScaleCalculationMode.FLOOR if mode == "floor" else ao_cfg.ScaleCalculationMode.RCEIL
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            for name, x in distributions(shape, seed=1):
                x = x.to(dtype)
                for swizzle in (False, True):
                    if swizzle and (len(shape) == 3 and shape[1] % 128):
                        continue
                    scale, data = ao_mx.to_mx(x, elem, 32, scaling_mode=scm, is_swizzled_scales=swizzle)
                    q = quantize(x, fmt, scale_mode=mode, swizzle=swizzle, backend=backend)
                    _assert_same(q.qdata, data, f"{fmt} {mode} qdata {name} {shape} {dtype}")
                    _assert_same(q.scales, scale, f"{fmt} {mode} scales {name} {shape} {dtype}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3", "mxfp4"])
def test_nan_blocks_match_torchao_scales(fmt: str) -> None:
    """NaN blocks: the scale byte is NaN (E4M3 0x7F / E8M0 0xFF) like torchao; non-NaN blocks stay bit-exact.
    (torchao's FP4 codes inside a NaN block depend on the NaN payload; ours are ±6 there, documented.)"""
    x = torch.randn(64, 128)
    x[3, 5] = float("nan")
    x[10, 100] = -float("nan")
    q = quantize(x, fmt)
    if fmt == "nvfp4":
        ref = ao_nv.NVFP4Tensor.to_nvfp4(x)
        ref_q, ref_s, nan_byte = ref.qdata, ref.scale, 0x7F
    else:
        elem = torch.float8_e4m3fn if fmt == "mxfp8_e4m3" else torch.float4_e2m1fn_x2
        ref_s, ref_q = ao_mx.to_mx(x, elem, 32)
        nan_byte = 0xFF
    _assert_same(q.scales, ref_s, "scales")
    bs = q.block_size
    nan_block = torch.isnan(x).reshape(-1, bs).any(dim=1)
    assert (q.scale_bytes.flatten()[nan_block] & 0x7F == nan_byte & 0x7F).all()
    per_block = bs // q.spec.element.per_byte
    ours = _bytes(q.qdata).reshape(-1, per_block)[~nan_block]
    theirs = _bytes(ref_q).reshape(-1, per_block)[~nan_block]
    assert torch.equal(ours, theirs)
    assert torch.isnan(q.dequantize().reshape(-1, bs)[nan_block]).all()


def test_rceil_is_exact_where_torchao_log2_rounds() -> None:
    """Descale just above a power of two: exact ceil → next exponent (as cvt.rp.satfinite.ue8m0 does); torchao's
    eager ceil(log2(.)) rounds log2 to the integer and keeps the lower one (documented difference)."""
    amax = 448.0 * 2.0**10 * (1 + 2.0**-23)
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    q = quantize(x, "mxfp8_e4m3", scale_mode="rceil")
    assert int(q.scale_bytes[0, 0]) == 127 + 11
    ref_scale, _ = ao_mx.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ao_cfg.ScaleCalculationMode.RCEIL)
    assert int(ref_scale.view(torch.uint8)[0, 0]) == 127 + 10
    # with the lower scale the element would have to saturate: ours stays in range and is exact to RNE
    assert float(q.dequantize()[0, 0]) == pytest.approx(amax, rel=2**-3)


def test_dequantize_matches_torchao() -> None:
    x = torch.randn(256, 128)
    ref = ao_nv.NVFP4Tensor.to_nvfp4(x)
    q = quantize(x, "nvfp4")
    torch.testing.assert_close(q.dequantize(), ref.dequantize(torch.float32), rtol=0, atol=0)
    pts = ao_nv.per_tensor_amax_to_scale(x.abs().amax())
    ref = ao_nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
    q = quantize(x, "nvfp4", global_scale=True)
    torch.testing.assert_close(q.dequantize(), ref.dequantize(torch.float32), rtol=1e-6, atol=0)
    scale, data = ao_mx.to_mx(x, torch.float8_e4m3fn, 32)
    mx = ao_mx.MXTensor(data, scale, torch.float8_e4m3fn, 32, torch.float32, ao_mx.KernelPreference.EMULATED, None, False)
    torch.testing.assert_close(quantize(x, "mxfp8_e4m3").dequantize(), mx.dequantize(torch.float32), rtol=0, atol=0)
