"""grouped_scaled_mm vs the per-expert reference loop: uneven, empty and non-multiple-of-16/32 groups."""

from __future__ import annotations

import pytest
import torch
from mm_helpers import SQNR_BACKEND_DB, sqnr_db

from torchnext.lowp import Epilogue, FormatError, ScaledMMResult, grouped_scaled_mm, quantize
from torchnext.lowp.mm import grouped as grouped_mod
from torchnext.lowp.mm.grouped import grouped_reference

SIZES = [0, 13, 1, 40, 0, 7, 33]


def _setup(fmt: str, k: int = 72, n: int = 48) -> tuple[torch.Tensor, object, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = sum(SIZES)
    a = torch.randn(t, k, generator=g)
    w = quantize(torch.randn(len(SIZES), n, k, generator=g), fmt)
    return a, w, torch.tensor(SIZES).cumsum(0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3", "mxfp4"])
@pytest.mark.parametrize("per_expert_bias", [False, True])
@pytest.mark.parametrize("fallback", [False, True])
def test_grouped_vs_per_group_reference(fmt: str, per_expert_bias: bool, fallback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if fallback:
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    a, w, offs = _setup(fmt)
    t, e, n = a.shape[0], len(SIZES), 48
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(e, n, generator=g) if per_expert_bias else torch.randn(n, generator=g)
    ep = Epilogue(scale=torch.rand(t, 1, generator=g) + 0.5, bias=bias, activation="silu", residual=torch.randn(t, n, generator=g))
    y = grouped_scaled_mm(a, w, offs, epilogue=ep)  # type: ignore[arg-type]
    ref = grouped_reference(a, w, offs, epilogue=ep)  # type: ignore[arg-type]
    assert isinstance(y, torch.Tensor)
    assert sqnr_db(y, ref) >= SQNR_BACKEND_DB


def test_grouped_amax_and_output_quantization() -> None:
    a, w, offs = _setup("nvfp4")
    r = grouped_scaled_mm(a, w, offs, epilogue=Epilogue(output_amax=True, out_format="nvfp4"))  # type: ignore[arg-type]
    assert isinstance(r, ScaledMMResult) and r.amax is not None and r.quantized is not None
    assert float(r.amax) == float(r.output.abs().max())
    assert torch.equal(r.quantized.qdata, quantize(r.output, "nvfp4").qdata)


def test_grouped_dense_weights_and_all_empty() -> None:
    w = torch.randn(3, 8, 16)
    a = torch.zeros(0, 16)
    y = grouped_scaled_mm(a, w, torch.tensor([0, 0, 0]))
    assert isinstance(y, torch.Tensor) and y.shape == (0, 8)


def test_grouped_errors() -> None:
    a, w, offs = _setup("nvfp4")
    with pytest.raises(FormatError, match="offsets must be non-decreasing"):
        grouped_scaled_mm(a, w, offs.flip(0))  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="entries for 7 experts"):
        grouped_scaled_mm(a, w, offs[:3])  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="int32/int64"):
        grouped_scaled_mm(a, w, offs.float())  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="has K=16"):
        grouped_scaled_mm(a[:, :16], w, offs)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="blocked along K"):
        grouped_scaled_mm(a, quantize(torch.randn(7, 48, 72), "nvfp4", dim=1), offs)


def test_no_python_loop_over_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    orig = grouped_mod.expert_weight
    monkeypatch.setattr(grouped_mod, "expert_weight", lambda *a: calls.append(1) or orig(*a))
    a, w, offs = _setup("nvfp4")
    grouped_scaled_mm(a, w, offs)  # type: ignore[arg-type]
    assert calls == []
