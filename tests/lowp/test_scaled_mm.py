"""scaled_mm: every backend x format x epilogue that claims support vs the fp64 reference; errors; GPU skips."""

from __future__ import annotations

import pytest
import torch
from mm_helpers import FORMATS, SQNR_BACKEND_DB, SQNR_VS_DENSE_DB, sqnr_db

from torchnext.lowp import (
    BackendUnavailable,
    Epilogue,
    FormatError,
    ScaledMMResult,
    available_backends,
    quantize,
    scaled_mm,
)
from torchnext.lowp.mm.backends import get_backend
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.scaled_mm import make_problem

N = 48


def _operands(m: int, k: int, fmt: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(N, k, generator=g)


def _full_epilogue(m: int, out_format: str | None = "mxfp8_e4m3") -> Epilogue:
    g = torch.Generator().manual_seed(1)
    return Epilogue(
        scale=torch.rand(N, generator=g) + 0.5,
        bias=torch.randn(N, generator=g),
        activation="gelu_tanh",
        residual=torch.randn(m, N, generator=g),
        output_amax=True,
        out_format=out_format,
    )


def _check_against_reference(res: ScaledMMResult, ref: ScaledMMResult) -> None:
    assert sqnr_db(res.output, ref.output) >= SQNR_BACKEND_DB
    assert res.amax is not None and ref.amax is not None
    torch.testing.assert_close(res.amax, ref.amax, rtol=1e-5, atol=0)
    # amax and quantized output are exactly those of the backend's own fp32 y (output_dtype is fp32 here)
    assert float(res.amax) == float(res.output.abs().max())
    assert res.quantized is not None and ref.quantized is not None
    q_own = quantize(res.output, "mxfp8_e4m3")
    assert torch.equal(res.quantized.qdata.view(torch.uint8), q_own.qdata.view(torch.uint8))
    assert torch.equal(res.quantized.scale_bytes, q_own.scale_bytes)
    # ... and agree with the reference's bytes except where y sits on a rounding boundary
    same = (res.quantized.qdata.view(torch.uint8) == ref.quantized.qdata.view(torch.uint8)).float().mean()
    assert same > 0.97


def test_fast_dequantize_matches_formats_dequantize() -> None:
    for fmt in FORMATS:
        for k in (64, 72, 80):
            w = torch.randn(N, k) * 3
            q = quantize(w, fmt)
            assert torch.equal(dequantize_operand(q), q.dequantize(torch.float32)), (fmt, k)
    q = quantize(torch.randn(3, N, 64), "nvfp4", swizzle=True, global_scale=True)
    assert torch.equal(dequantize_operand(q), q.dequantize(torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_error_vs_dense_per_format(fmt: str) -> None:
    a, w = _operands(16, 256, fmt)
    ref = scaled_mm(a, quantize(w, fmt), backend="reference")
    assert isinstance(ref, torch.Tensor)
    assert sqnr_db(ref, a @ w.T) >= SQNR_VS_DENSE_DB[fmt]


# inductor strategies: M=1 and M=5 (padded to 8) take the decode GEMV, M=20 the fused dequantize + mm path
_CASES = [(1, f) for f in FORMATS] + [(20, f) for f in FORMATS] + [(5, "nvfp4"), (5, "mxfp8_e4m3")]


@pytest.mark.parametrize(("m", "fmt"), _CASES)
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cpu_backends_vs_reference(backend: str, m: int, fmt: str) -> None:
    k = 80  # not a multiple of 32: MX operands are padded
    a, w = _operands(m, k, fmt)
    wq = quantize(w, fmt, **({"global_scale": True} if fmt == "nvfp4" else {}))
    ep = _full_epilogue(m)
    ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
    res = scaled_mm(a, wq, epilogue=ep, backend=backend)
    assert isinstance(res, ScaledMMResult) and isinstance(ref, ScaledMMResult)
    _check_against_reference(res, ref)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_both_operands_block_scaled_and_swizzled(fmt: str) -> None:
    a, w = _operands(20, 64, fmt)
    aq, wq = quantize(a, fmt), quantize(w, fmt, swizzle=True)
    ref = scaled_mm(aq, wq, backend="reference")
    for backend in ("eager", "inductor"):
        res = scaled_mm(aq, wq, backend=backend)
        assert isinstance(res, torch.Tensor) and isinstance(ref, torch.Tensor)
        assert sqnr_db(res, ref) >= SQNR_BACKEND_DB


def test_dense_operands_and_out_dtype() -> None:
    a, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(N, 32, dtype=torch.bfloat16)
    ep = Epilogue(bias=torch.randn(N), activation="relu")
    for backend in ("aten", "eager"):
        y = scaled_mm(a, w, epilogue=ep, backend=backend)
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
        want = torch.relu(a.float() @ w.float().T + ep.bias)
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)


def test_errors() -> None:
    a, w = torch.randn(4, 32), torch.randn(N, 32)
    with pytest.raises(FormatError, match="K differs"):
        scaled_mm(a, torch.randn(N, 16), backend="eager")
    with pytest.raises(FormatError, match="must be 2-D"):
        scaled_mm(a[0], w, backend="eager")
    with pytest.raises(FormatError, match=r"torch\.Tensor or a BlockScaledTensor"):
        scaled_mm([[1.0]], w, backend="eager")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="blocked along K"):
        scaled_mm(a, quantize(torch.randn(32, N), "nvfp4", dim=0), backend="eager")
    with pytest.raises(FormatError, match="unknown scaled_mm backend"):
        scaled_mm(a, w, backend="nope")
    with pytest.raises(FormatError, match="dense a must be"):
        scaled_mm(a.to(torch.int32), w, backend="eager")
    with pytest.raises(BackendUnavailable, match=r"does not support.*(CUDA compute capability|device)"):
        scaled_mm(quantize(a, "nvfp4"), quantize(w, "nvfp4"), backend="aten")
    with pytest.raises(BackendUnavailable, match="cutlass"):
        scaled_mm(a, quantize(w, "nvfp4"), backend="cutlass")


def test_capabilities_are_declared_honestly() -> None:
    avail = available_backends()
    assert avail["reference"][0] and avail["eager"][0]
    if not torch.cuda.is_available():
        assert not avail["triton"][0] and avail["triton"][1]
        assert not avail["cutlass"][0] and "cutlass" in avail["cutlass"][1]
        p = make_problem(torch.randn(2, 32), quantize(torch.randn(N, 32), "nvfp4"), None)
        assert get_backend("aten").supports(p) is not None
    for name in ("reference", "eager", "aten", "cpu", "inductor", "triton", "cutlass"):
        cap = get_backend(name).capability()
        assert cap.devices and isinstance(cap.formats, frozenset)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (triton / aten block-scaled backends)")
@pytest.mark.parametrize("backend", ["triton", "aten"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_gpu_backends_vs_reference(backend: str, fmt: str) -> None:  # pragma: no cover - GPU only
    dev = torch.device("cuda")
    a, w = _operands(64, 256, fmt)
    aq, wq = quantize(a.to(dev), fmt), quantize(w.to(dev), fmt)
    p = make_problem(aq, wq, None)
    why = get_backend(backend).supports(p)
    if why is not None:
        pytest.skip(why)
    ep = _full_epilogue(64)
    ep = Epilogue(scale=ep.scale.to(dev), bias=ep.bias.to(dev), activation="gelu_tanh",  # type: ignore[union-attr]
                  residual=ep.residual.to(dev), output_amax=True, out_format="mxfp8_e4m3")  # type: ignore[union-attr]
    ref = scaled_mm(aq, wq, epilogue=ep, backend="reference")
    res = scaled_mm(aq, wq, epilogue=ep, backend=backend)
    assert isinstance(res, ScaledMMResult) and isinstance(ref, ScaledMMResult)
    assert sqnr_db(res.output.cpu(), ref.output.cpu()) >= 60


def test_gemv_prepared_weight_follows_inplace_changes() -> None:
    a, w = _operands(1, 80, "nvfp4")
    wq = quantize(w, "nvfp4", global_scale=True)
    ep = _full_epilogue(1)
    first = scaled_mm(a, wq, epilogue=ep, backend="inductor")
    wq.qdata[:5].zero_()  # in place: the cached prepared layout must be rebuilt
    res = scaled_mm(a, wq, epilogue=ep, backend="inductor")
    ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
    assert isinstance(res, ScaledMMResult) and isinstance(ref, ScaledMMResult) and isinstance(first, ScaledMMResult)
    assert sqnr_db(res.output, ref.output) >= SQNR_BACKEND_DB
    assert not torch.equal(first.output, res.output)


def test_inductor_strategy_by_m() -> None:
    from torchnext.lowp.mm.backends.inductor import GEMV_MAX_M, strategy_for

    w = quantize(torch.randn(N, 32), "nvfp4")
    assert strategy_for(make_problem(torch.randn(1, 32), w, None)) == "gemv"
    assert strategy_for(make_problem(torch.randn(GEMV_MAX_M, 32), w, None)) == "gemv"
    assert strategy_for(make_problem(torch.randn(GEMV_MAX_M + 1, 32), w, None)) == "mm"
    assert strategy_for(make_problem(torch.randn(1, 32), torch.randn(N, 32), None)) == "mm"
