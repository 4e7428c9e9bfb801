"""NVFP4 training: every quantized operand bit-exact against the independent numpy + ml_dtypes oracle
(nvfp4_oracle.py: the paper's and TE's formulas), stochastic rounding unbiased (TE's test), forward SQNR, and
RHT/SR/2-D ablations doing what they say."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import nvfp4_oracle as oracle
import pytest
import torch
from torch import nn

from torchnext.lowp.formats import format_spec
from torchnext.lowp.training import Operand, Recipe, convert_to_lowp_training
from torchnext.lowp.training import function as fn_module
from torchnext.lowp.training.ops import copy_operand, train_cast


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach().double()
    noise = float((ref - x).detach().pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


@pytest.fixture
def casts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[torch.Tensor]]]:
    rec: dict[str, list[torch.Tensor]] = {}
    real = fn_module.train_cast

    def spy(x: torch.Tensor, signs: Any, step: Any, recipe: str, role: str, *args: Any) -> list[torch.Tensor]:
        out = real(x, signs, step, recipe, role, *args)
        rec[role] = [t.clone() for t in out]
        return out

    monkeypatch.setattr(fn_module, "train_cast", spy)
    yield rec


def _layer(n: int, k: int, recipe: Recipe, dtype: torch.dtype = torch.float32, seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_lowp_training(nn.Sequential(nn.Linear(k, n, dtype=dtype)), recipe, seed=seed, backend="eager")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


@pytest.mark.parametrize(("m", "k", "n"), [(64, 96, 48), (37, 45, 50)])  # the second: M, K and N all padded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operands_bit_exact_vs_numpy_oracle(casts: dict[str, list[torch.Tensor]], m: int, k: int, n: int,
                                            dtype: torch.dtype) -> None:
    model = _layer(n, k, Recipe.NVFP4, dtype)
    layer = model[0]
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    step = int(layer.lowp_step)
    y = model(x)
    y.backward(dy)
    signs = _np(layer.rht_signs)
    w = _np(layer.weight)
    # X: rowwise 1x16 along K (RNE); columnwise along M after the RHT (RNE)
    want = {
        "x row": oracle.blocks_1x16(_np(x)),
        "x col": oracle.blocks_1x16(oracle.rht_rows(_np(x), signs).T),
    }
    (wr, wrs), (wc, wcs), wdec = oracle.tiles_16x16(w)
    want["w row"], want["w col"] = (wr, wrs, wdec), (wc, wcs, wdec)
    seed_row = Recipe.NVFP4.quant_options(Operand.DY_ROW, seed=3, layer=layer.layer, step=step).seed
    seed_col = Recipe.NVFP4.quant_options(Operand.DY_COL, seed=3, layer=layer.layer, step=step).seed
    assert seed_row is not None and seed_col is not None and seed_row != seed_col
    want["dy row"] = oracle.blocks_1x16(_np(dy), seed=seed_row)
    want["dy col"] = oracle.blocks_1x16(oracle.rht_rows(_np(dy), signs).T, seed=seed_col)
    for role in ("x", "w", "dy"):
        got = casts[role]
        for side, (codes, scales, gs) in (("row", got[0:3]), ("col", got[3:6])):
            wc_, ws_, wg_ = want[f"{role} {side}"]
            assert np.array_equal(codes.numpy(), wc_), f"{role} {side}: codes"
            assert np.array_equal(scales.numpy(), ws_), f"{role} {side}: scales"
            assert float(gs) == float(wg_), f"{role} {side}: global decode scale"


def test_stochastic_rounding_is_unbiased() -> None:
    """TransformerEngine's check: the mean of 50 stochastically rounded copies has a lower RMSE than RNE."""
    x = torch.randn(128, 256)
    spec = format_spec("nvfp4")
    step = torch.zeros((), dtype=torch.int64)
    draws = []
    for s in range(50):
        step.fill_(s)
        out = train_cast(x, None, step, Recipe.NVFP4.with_(rht=False).key, "dy", 7, 1, "auto", True, False)
        draws.append(copy_operand((out[0], out[1], out[2]), spec, 128, 256).dequantize(torch.float32))
    rne = train_cast(x, None, step, Recipe.NVFP4.with_(rht=False, stochastic_rounding=False).key, "dy", 7, 1, "auto",
                     True, False)
    rne_x = copy_operand((rne[0], rne[1], rne[2]), spec, 128, 256).dequantize(torch.float32)
    rmse_sr = float((torch.stack(draws).mean(0) - x).pow(2).mean().sqrt())
    rmse_rne = float((rne_x - x).pow(2).mean().sqrt())
    assert rmse_sr < 0.5 * rmse_rne, (rmse_sr, rmse_rne)
    single = float((draws[0] - x).pow(2).mean().sqrt())
    assert single > rmse_rne  # one SR draw is noisier than RNE: the gain is in expectation
    assert not torch.equal(draws[0], draws[1])  # each step draws new noise


@pytest.mark.parametrize("recipe", [Recipe.NVFP4, Recipe.NVFP4.with_(rht=False), Recipe.NVFP4.with_(weight_2d=False)])
def test_forward_sqnr_and_gradients(recipe: Recipe) -> None:
    m, k, n = 256, 512, 384
    model = _layer(n, k, recipe)
    ref = nn.Linear(k, n)
    ref.load_state_dict({"weight": model[0].weight.detach(), "bias": model[0].bias.detach()})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g)
    dy = torch.randn(m, n, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = model(xa)
    y.backward(dy)
    yr = ref(xb)
    yr.backward(dy)
    assert sqnr(yr, y) >= 15.0
    assert sqnr(xb.grad, xa.grad) >= 12.0  # type: ignore[arg-type]
    assert sqnr(ref.weight.grad, model[0].weight.grad) >= 12.0  # type: ignore[arg-type]
    assert torch.equal(model[0].bias.grad, ref.bias.grad)  # type: ignore[arg-type]  # db = dy.sum(0), exact


def test_2d_weights_make_fprop_and_dgrad_see_the_same_weight(casts: dict[str, list[torch.Tensor]]) -> None:
    spec = format_spec("nvfp4")
    for recipe, same in ((Recipe.NVFP4, True), (Recipe.NVFP4.with_(weight_2d=False), False)):
        model = _layer(48, 64, recipe)
        model(torch.randn(32, 64, requires_grad=True)).sum().backward()
        c = casts["w"]
        w_row = copy_operand((c[0], c[1], c[2]), spec, 48, 64).dequantize(torch.float32)
        w_col = copy_operand((c[3], c[4], c[5]), spec, 64, 48).dequantize(torch.float32)
        assert torch.equal(w_row, w_col.t()) is same


def test_seeds_follow_layer_step_and_operand() -> None:
    """dY's noise changes with the step and the layer, not with anything a replica could differ in."""
    spec = format_spec("nvfp4")
    x = torch.randn(64, 64)
    key = Recipe.NVFP4.with_(rht=False).key

    def cast(step: int, layer: int, seed: int = 5) -> torch.Tensor:
        return train_cast(x, None, torch.tensor(step), key, "dy", seed, layer, "auto", True, False)[0]

    assert torch.equal(cast(3, 1), cast(3, 1))
    assert not torch.equal(cast(3, 1), cast(4, 1))
    assert not torch.equal(cast(3, 1), cast(3, 2))
    assert not torch.equal(cast(3, 1), cast(3, 1, seed=6))
    del spec
