"""The training linear: one autograd function, three quantized GEMMs through ``scaled_mm``.

Meaning of :func:`lowp_linear` (``x`` (..., K), ``weight`` (N, K)), ``x2 = x.reshape(-1, K)`` (M, K)::

    forward:   Xr, Xc = casts of x2 (Xc transformed under RHT)       # torchnext.lowp.training.ops.train_cast
               Wr, Wc = casts of weight (2-D tiles: same values)     # or the copies an FSDP all-gather brought
               y  = scaled_mm(Xr, Wr, bias) (out dtype = x.dtype)    # fprop
               save Xc, Wc (the quantized copies: no high-precision activation is kept)
    backward:  dYr, dYc = casts of dy (stochastic rounding; dYc transformed under RHT)
               dx = scaled_mm(dYr, Wc.T)  (M, K)                     # dgrad, blocks along N
               dw = scaled_mm(dYc.T, Xc.T) (N, K), dtype of weight  # wgrad, blocks along M
               db = dy.sum(0)

A copy that no gradient needs is not made (a frozen weight: no Xc; an input that needs no grad: no Wc, no dgrad).
Stochastic rounding seeds come from ``(seed, layer, step, operand)`` (see :mod:`torchnext.lowp.training.recipe`);
``step`` is a 0-d int64 tensor so that a changing step never recompiles a compiled model.
"""

from __future__ import annotations

from typing import Any

import torch

from torchnext.lowp.errors import FormatError
from torchnext.lowp.hadamard import RHT_SIZE
from torchnext.lowp.training.ops import Copy, bias_grad, train_cast, train_mm
from torchnext.lowp.training.recipe import Recipe

__all__ = ["PrequantizedWeight", "lowp_linear"]


class PrequantizedWeight:
    """Mixin marker for a weight tensor that already carries its training copies (an FSDP2 all-gather in low
    precision, :mod:`torchnext.lowp.training.fsdp`): ``lowp_copies(recipe_key)`` returns the (rowwise,
    columnwise) :data:`~torchnext.lowp.training.ops.Copy` pair, or None to have them made from the values."""

    def lowp_copies(self, recipe: str) -> tuple[Copy, Copy] | None:  # pragma: no cover - interface
        raise NotImplementedError


def _as_list(c: list[torch.Tensor]) -> tuple[Copy, Copy]:
    return (c[0], c[1], c[2]), (c[3], c[4], c[5])


class _LowpLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, signs: torch.Tensor | None,
        step: torch.Tensor, recipe: str, fmt: str, seed: int, layer: int, quantizer: str, backend: str,
        rht_x: bool, rht_dy: bool,
    ) -> torch.Tensor:
        k = x.shape[-1]
        n = weight.shape[0]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xr, xc = _as_list(train_cast(x2, signs, step, recipe, "x", seed, layer, quantizer, True, need_dw))
        pre = weight.lowp_copies(recipe) if isinstance(weight, PrequantizedWeight) else None
        if pre is not None:
            wr, wc = pre
        else:
            wr, wc = _as_list(train_cast(weight.detach(), None, step, recipe, "w", seed, layer, quantizer, True,
                                         need_dx))
        y = train_mm(*xr, m, *wr, n, k, bias, fmt, x.dtype, backend)
        ctx.save_for_backward(*xc, *wc, signs, step)
        ctx.dims = (m, n, k, -(-m // RHT_SIZE) * RHT_SIZE if rht_x else m, -(-m // RHT_SIZE) * RHT_SIZE if rht_dy else m)
        ctx.cfg = (recipe, fmt, seed, layer, quantizer, backend)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.x_shape = x.shape
        return y.reshape(*lead, n)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xc0, xc1, xc2, wc0, wc1, wc2, signs, step = ctx.saved_tensors
        m, n, k, mx, mdy = ctx.dims
        recipe, fmt, seed, layer, quantizer, backend = ctx.cfg
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dy2 = dy.reshape(-1, n).contiguous()
        dyr, dyc = _as_list(train_cast(dy2, signs, step, recipe, "dy", seed, layer, quantizer, need_dx, need_dw))
        dx = dw = db = None
        if need_dx:
            dx = train_mm(*dyr, m, wc0, wc1, wc2, k, n, None, fmt, x_dtype, backend).reshape(ctx.x_shape)
        if need_dw:
            if mx != mdy:  # both wgrad operands are padded alike (RHT on both, or on neither)
                raise FormatError(f"lowp_linear: wgrad operands differ in length along M ({mdy} vs {mx})")
            dw = train_mm(*dyc, n, xc0, xc1, xc2, k, mx, None, fmt, w_dtype, backend)
        if need_db:
            db = bias_grad(dy2, b_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


def lowp_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Recipe,
    step: torch.Tensor | None = None,
    rht_signs: torch.Tensor | None = None,
    seed: int = 0,
    layer: int = 0,
    quantizer: str = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` trained in low precision: the three GEMMs quantized by ``recipe`` (see the
    module docstring).

    Args:
        x: (..., K) float32 / bfloat16 / float16 activations.
        weight: (N, K) master weight (or a :class:`PrequantizedWeight`).
        bias: (N,) or None.
        recipe: a :class:`~torchnext.lowp.training.Recipe` (``Recipe.MXFP8``, ``Recipe.NVFP4``, ...).
        step: 0-d int64 tensor, the step part of the stochastic-rounding seeds (None: 0).
        rht_signs: the 16 RHT signs (needed when ``recipe.rht``).
        seed, layer: the other parts of the seeds (ints in [0, 2**63)).
        quantizer: quantizer kernel (``QuantOptions.backend``); backend: ``scaled_mm`` backend (``"auto"``: the
            autotuner).

    Raises:
        FormatError: shapes that do not fit, a missing RHT sign vector, a bad recipe.
    """
    if not isinstance(recipe, Recipe):
        raise FormatError(f"lowp_linear: recipe must be a torchnext.lowp.Recipe, got {type(recipe).__name__}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise FormatError(f"lowp_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit (weight is (N, K))")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise FormatError(f"lowp_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if recipe.rht and rht_signs is None:
        raise FormatError(f"lowp_linear: recipe {recipe} uses the RHT: pass rht_signs (torchnext.lowp.rht_signs(seed))")
    for name, v in (("seed", seed), ("layer", layer)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise FormatError(f"lowp_linear: {name} must be an int in [0, 2**63), got {v!r}")
    if step is None:
        step = torch.zeros((), dtype=torch.int64, device=x.device)
    out: torch.Tensor = _LowpLinearFn.apply(
        x, weight, bias, rht_signs if recipe.rht else None, step, recipe.key, recipe.format.value, seed, layer,
        quantizer, backend, recipe.uses_rht("x"), recipe.uses_rht("dy"),
    )
    return out
