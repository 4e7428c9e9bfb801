"""Grouped (MoE) training: grouped_scaled_mm in forward and backward with uneven token groups (empty, and sizes
that are not multiples of 32), against torchao 0.18's emulated MXFP8 grouped training and a per-expert loop."""

from __future__ import annotations

import math

import pytest
import torch

from torchnext.lowp import FormatError, grouped_scaled_mm, quantize, rht_signs
from torchnext.lowp.training import Recipe, convert_to_lowp_training
from torchnext.lowp.training.grouped import LowpGroupedLinear, lowp_grouped_mm

SIZES = [7, 0, 45, 33, 11]  # an empty group; none a multiple of 16 or 32


def _data(dtype: torch.dtype, k: int = 64, n: int = 96) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = sum(SIZES)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = (torch.randn(len(SIZES), n, k, generator=g) * 0.1).to(dtype)
    dy = torch.randn(t, n, generator=g).to(dtype)
    return x, w, dy, torch.tensor(SIZES).cumsum(0).to(torch.int32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return 10 * math.log10(float(ref.double().pow(2).sum()) / float((ref.double() - x.double()).pow(2).sum()))


def _ours(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, recipe: Recipe, **kw: object) -> tuple[torch.Tensor, ...]:
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = lowp_grouped_mm(xa, wa, offs, recipe=recipe, rht_signs=rht_signs(1), **kw)  # type: ignore[arg-type]
    y.backward(dy)
    return y.detach(), xa.grad, wa.grad  # type: ignore[return-value]


def test_mxfp8_matches_torchao_emulated_grouped_training() -> None:
    pytest.importorskip("torchao")
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    x, w, dy, offs = _data(torch.bfloat16)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = _to_mxfp8_then_scaled_grouped_mm(
        xa, wa.transpose(-2, -1), offs, out_dtype=torch.bfloat16, kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=ScaleCalculationMode.RCEIL, pad_token_groups_for_grouped_mm=True)
    ya.backward(dy)
    y, dx, dw = _ours(x, w, dy, offs, Recipe.MXFP8)
    # the same quantized operands (each group padded to 32 tokens for wgrad, as torchao's padding option does);
    # stated tolerance 1e-4 relative L2 (accumulation order), measured 0 (bitwise equal)
    for ours, theirs in ((y, ya), (dx, xa.grad), (dw, wa.grad)):
        assert ours.dtype == torch.bfloat16
        assert _rel(ours, theirs) <= 1e-4  # type: ignore[arg-type]


def test_mxfp8_equals_a_loop_of_linear_layers() -> None:
    """Per-group wgrad blocks = each expert's own linear layer blocked along its tokens."""
    x, w, dy, offs = _data(torch.float32)
    y, dx, dw = _ours(x, w, dy, offs, Recipe.MXFP8)
    start = 0
    for e, size in enumerate(SIZES):
        lin = torch.nn.Linear(w.shape[2], w.shape[1], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w[e])
        lin = convert_to_lowp_training(lin, Recipe.MXFP8, backend="eager")
        xe = x[start : start + size].clone().requires_grad_()
        ye = lin(xe)
        ye.backward(dy[start : start + size])
        if size:
            assert _rel(y[start : start + size], ye) <= 1e-6
            assert _rel(dx[start : start + size], xe.grad) <= 1e-6  # type: ignore[arg-type]
            assert _rel(dw[e], lin.weight.grad) <= 1e-6  # type: ignore[arg-type]
        else:
            assert not dw[e].any()  # an empty group gets a zero gradient
        start += size


@pytest.mark.parametrize("recipe", [Recipe.NVFP4, Recipe.NVFP4.with_(rht=False, stochastic_rounding=False)])
def test_nvfp4_grouped_accuracy_and_backends(recipe: Recipe) -> None:
    x, w, dy, offs = _data(torch.float32)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = torch.cat([xr[int(s) : int(e)] @ wr[i].T for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True))])
    yr.backward(dy)
    y, dx, dw = _ours(x, w, dy, offs, recipe, quantizer="eager")
    assert _sqnr(yr, y) >= 14 and _sqnr(xr.grad, dx) >= 12 and _sqnr(wr.grad, dw) >= 12  # type: ignore[arg-type]
    y2, dx2, dw2 = _ours(x, w, dy, offs, recipe, quantizer="reference")
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_module_trains_and_round_trips() -> None:
    torch.manual_seed(0)
    x, _, _, offs = _data(torch.float32)
    target = torch.randn(x.shape[0], 32)
    mod = LowpGroupedLinear(len(SIZES), 64, 32, recipe=Recipe.NVFP4, seed=4, fqn="moe.experts")
    opt = torch.optim.SGD(mod.parameters(), lr=0.2)
    losses = []
    for _ in range(10):
        loss = (mod(x, offs) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and int(mod.lowp_step) == 10
    fresh = LowpGroupedLinear(len(SIZES), 64, 32, recipe=Recipe.NVFP4, seed=9, fqn="moe.experts")
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh.rht_signs, mod.rht_signs)  # type: ignore[arg-type]


def test_reduction_grouped_form_and_errors() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 96, generator=g), torch.randn(6, 96, generator=g)
    offs = torch.tensor([32, 32, 96])
    ref = torch.stack([a[:, :32] @ b[:, :32].T, torch.zeros(8, 6), a[:, 32:] @ b[:, 32:].T])
    assert torch.allclose(grouped_scaled_mm(a, b, offs), ref, atol=1e-5)
    qa, qb = quantize(a, "mxfp8_e4m3", scale_mode="rceil"), quantize(b, "mxfp8_e4m3", scale_mode="rceil")
    assert _rel(grouped_scaled_mm(qa, qb, offs), ref) < 0.05
    with pytest.raises(FormatError, match="multiples of the block size 32"):
        grouped_scaled_mm(qa, qb, torch.tensor([20, 96]))  # a block would straddle two groups
    with pytest.raises(FormatError, match="T differs"):
        grouped_scaled_mm(a, b[:, :64], offs)
    with pytest.raises(FormatError, match="do not fit"):
        lowp_grouped_mm(a, torch.randn(2, 4, 5), torch.tensor([4, 8]), recipe=Recipe.MXFP8)
    with pytest.raises(FormatError, match="end at T"):
        lowp_grouped_mm(torch.randn(8, 32), torch.randn(2, 4, 32), torch.tensor([4, 7]), recipe=Recipe.MXFP8)
