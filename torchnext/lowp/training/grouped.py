"""Grouped (MoE) training: the three GEMMs of a mixture-of-experts layer through ``grouped_scaled_mm``.

For tokens ``x`` (T, K) sorted by expert, expert weights ``w`` (E, N, K) and ``offsets`` (E,) (group ends, as
``torch._grouped_mm``), :func:`lowp_grouped_mm` is ``y[g_e] = x[g_e] @ w[e].T`` trained in low precision::

    forward:   Xr = cast of x along K;   Wr, Wc = casts of every expert's W (2-D tiles under NVFP4)
               y  = grouped_scaled_mm(Xr, Wr, offsets)                              # fprop
               Xc = cast along tokens of x_pad (each group padded with zero rows to a multiple of P)
    backward:  dYr = cast of dy along N;  dYc = cast along tokens of dy_pad (same padding)
               dx = grouped_scaled_mm(dYr, Wc (E, K, N), offsets)                   # dgrad
               dw = grouped_scaled_mm(dYc (N, Tp), Xc (K, Tp), padded offsets)      # wgrad: (E, N, K)

The wgrad blocks run along tokens, so a block must not straddle two experts' tokens: every group is padded to a
multiple of ``P`` (the block size; 16 under NVFP4, which also aligns the 16-point RHT groups with the experts), so
groups whose sizes are not multiples of 32 (MXFP8) or 16 (NVFP4) are exact — the zero rows add nothing to the
products. Each expert's N is likewise padded to the block for the weight casts. Every copy is quantized from the
high-precision tensor (padding only inserts zeros); one global scale per copy (NVFP4) covers all experts. Seeds and
counters as in :mod:`torchnext.lowp.training.function` (the counters of a padded copy count its padding rows).

Eager only: the group sizes are read on the host (``offsets.tolist()``), which ``torch.compile`` would have to
treat as data-dependent; the linear layers are the compiled path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import format_spec
from torchnext.lowp.hadamard import rht_signs as draw_signs
from torchnext.lowp.mm.grouped import grouped_scaled_mm
from torchnext.lowp.rng import stream_seed
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.training.module import RHT_STREAM, layer_id
from torchnext.lowp.training.ops import copy_operand, train_cast
from torchnext.lowp.training.recipe import Recipe

__all__ = ["LowpGroupedLinear", "lowp_grouped_mm"]


def _padded_layout(offsets: torch.Tensor, p: int, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row index of each token in the padded layout (T,), padded group ends (E,), padded length)."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    pcounts = (counts + p - 1) // p * p
    pends = torch.cumsum(pcounts, 0)
    starts, pstarts = ends - counts, pends - pcounts
    expert = torch.repeat_interleave(torch.arange(len(ends), device=offsets.device), counts, output_size=t)
    idx = torch.arange(t, device=offsets.device) - starts[expert] + pstarts[expert]
    total = int(pends[-1]) if len(ends) else 0
    return idx, pends, total


def _stack_operand(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, spec: Any, e: int, rows: int,
                   rows_p: int, k: int) -> BlockScaledTensor:
    """The (E, rows, k) operand from the flat copy of a stack of E matrices with ``rows_p`` rows each."""
    storage = spec.element.torch_dtype if spec.element.torch_dtype is not None else torch.uint8
    q = codes.reshape(e, rows_p, -1)[:, :rows].contiguous().view(storage)
    s = scales.reshape(e, rows_p, -1)[:, :rows].contiguous().view(spec.scale_dtype)
    return BlockScaledTensor(qdata=q, scales=s, global_scale=gs if gs.numel() else None, spec=spec,
                             shape=torch.Size((e, rows, k)), block_dim=2)


class _GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, signs: torch.Tensor | None,
        step: torch.Tensor, recipe_key: str, seed: int, layer: int, quantizer: str,
    ) -> torch.Tensor:
        recipe = Recipe.from_key(recipe_key)
        spec = format_spec(recipe.format)
        b = spec.block_size
        t, k = x.shape
        e, n, _ = w.shape
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cast_args = (seed, layer, quantizer)
        xr = train_cast(x, signs, step, recipe_key, "x", *cast_args, True, False)
        # every expert's rows padded to the block: tiles / column blocks stay inside one expert
        n_p = -(-n // b) * b
        w_pad = torch.nn.functional.pad(w.detach(), (0, 0, 0, n_p - n)).reshape(e * n_p, k)
        wc = train_cast(w_pad, None, step, recipe_key, "w", *cast_args, True, need_dx)
        a = copy_operand((xr[0], xr[1], xr[2]), spec, t, k, orig_dtype=x.dtype)
        wr = _stack_operand(wc[0], wc[1], wc[2], spec, e, n, n_p, k)
        y = grouped_scaled_mm(a, wr, offsets)
        assert isinstance(y, torch.Tensor)
        idx, pends, tp = _padded_layout(offsets, b, t)
        saved: list[torch.Tensor | None] = [None] * 3
        if need_dw:
            x_pad = x.new_zeros(tp, k).index_copy_(0, idx, x.detach())
            xc = train_cast(x_pad, signs, step, recipe_key, "x", *cast_args, False, True)
            saved = [xc[3], xc[4], xc[5]]
        w_col: list[torch.Tensor | None] = [None] * 3
        if need_dx:  # (K, E * n_p) column copy → per expert (K, n_p): transpose the expert and K dims
            w_col = [wc[3], wc[4], wc[5]]
        ctx.save_for_backward(*saved, *w_col, offsets, idx, pends, signs, step)
        ctx.dims = (t, k, e, n, n_p, tp)
        ctx.cfg = (recipe_key, seed, layer, quantizer)
        ctx.dtypes = (x.dtype, w.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xc0, xc1, xc2, wc0, wc1, wc2, offsets, idx, pends, signs, step = ctx.saved_tensors
        t, k, e, n, n_p, tp = ctx.dims
        recipe_key, seed, layer, quantizer = ctx.cfg
        x_dtype, w_dtype = ctx.dtypes
        spec = format_spec(Recipe.from_key(recipe_key).format)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dy.contiguous()
        dx = dw = None
        cast_args = (seed, layer, quantizer)
        if need_dx:
            dyr = train_cast(dy, signs, step, recipe_key, "dy", *cast_args, True, False)
            a = copy_operand((dyr[0], dyr[1], dyr[2]), spec, t, n)
            storage = spec.element.torch_dtype if spec.element.torch_dtype is not None else torch.uint8
            wq = wc0.reshape(k, e, -1).transpose(0, 1).contiguous().view(storage)
            ws = wc1.reshape(k, e, -1).transpose(0, 1).contiguous().view(spec.scale_dtype)
            w_t = BlockScaledTensor(qdata=wq, scales=ws, global_scale=wc2 if wc2.numel() else None, spec=spec,
                                    shape=torch.Size((e, k, n_p)), block_dim=2)
            w_t = replace(w_t, shape=torch.Size((e, k, n)))  # the padding columns stay storage padding
            out = grouped_scaled_mm(a, w_t, offsets)
            assert isinstance(out, torch.Tensor)
            dx = out.to(x_dtype)
        if need_dw:
            dy_pad = dy.new_zeros(tp, n).index_copy_(0, idx, dy)
            dyc = train_cast(dy_pad, signs, step, recipe_key, "dy", *cast_args, False, True)
            a_c = copy_operand((dyc[3], dyc[4], dyc[5]), spec, n, tp)
            x_c = copy_operand((xc0, xc1, xc2), spec, k, tp)
            dw_acc = grouped_scaled_mm(a_c, x_c, pends)
            assert isinstance(dw_acc, torch.Tensor)
            dw = dw_acc.to(w_dtype)
        return dx, dw, None, None, None, None, None, None, None


def lowp_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    recipe: Recipe,
    step: torch.Tensor | None = None,
    rht_signs: torch.Tensor | None = None,
    seed: int = 0,
    layer: int = 0,
    quantizer: str = "auto",
) -> torch.Tensor:
    """``y[g_e] = x[g_e] @ w[e].T`` for the token groups ending at ``offsets``, trained in low precision (module
    docstring). ``x`` (T, K) float, ``w`` (E, N, K), ``offsets`` (E,) int32/int64 non-decreasing, last = T.

    Raises:
        FormatError: shapes or offsets that do not fit, a missing RHT sign vector.
    """
    if not isinstance(recipe, Recipe):
        raise FormatError(f"lowp_grouped_mm: recipe must be a torchnext.lowp.Recipe, got {type(recipe).__name__}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise FormatError(f"lowp_grouped_mm: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (w is (E, N, K))")
    if offsets.dim() != 1 or offsets.numel() != w.shape[0] or offsets.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"lowp_grouped_mm: offsets must be a 1-D int tensor with one end per expert ({w.shape[0]})")
    ends = offsets.tolist()
    if any(b < a for a, b in zip([0, *ends[:-1]], ends, strict=True)) or (ends and ends[-1] != x.shape[0]):
        raise FormatError(f"lowp_grouped_mm: offsets must be non-decreasing and end at T={x.shape[0]}: {ends}")
    if recipe.rht and rht_signs is None:
        raise FormatError(f"lowp_grouped_mm: recipe {recipe} uses the RHT: pass rht_signs")
    if step is None:
        step = torch.zeros((), dtype=torch.int64, device=x.device)
    out: torch.Tensor = _GroupedFn.apply(x, w, offsets, rht_signs if recipe.rht else None, step, recipe.key, seed,
                                         layer, quantizer)
    return out


class LowpGroupedLinear(nn.Module):
    """``num_experts`` bias-free linear layers applied to token groups (a MoE expert projection), trained with
    :func:`lowp_grouped_mm`; ``weight`` is (E, out_features, in_features) in its own (master) dtype. Buffers as
    :class:`~torchnext.lowp.training.LowpTrainingLinear` (``lowp_step``, ``rht_signs``)."""

    lowp_step: torch.Tensor
    rht_signs: torch.Tensor | None

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, recipe: Recipe, seed: int = 0,
                 fqn: str = "", quantizer: str = "auto", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if min(num_experts, in_features, out_features) <= 0:
            raise FormatError("LowpGroupedLinear: num_experts, in_features and out_features must be positive")
        self.recipe, self.seed, self.fqn, self.quantizer = recipe, seed, fqn, quantizer
        self.layer = layer_id(fqn)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=in_features**-0.5)
        self.register_buffer("lowp_step", torch.zeros((), dtype=torch.int64, device=device))
        signs = draw_signs(stream_seed(seed, self.layer, RHT_STREAM), device=device) if recipe.rht else None
        self.register_buffer("rht_signs", signs)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.lowp_step.add_(1)
            step = self.lowp_step - 1
        else:
            step = self.lowp_step + 0
        return lowp_grouped_mm(x, self.weight, offsets, recipe=self.recipe, step=step, rht_signs=self.rht_signs,
                               seed=self.seed, layer=self.layer, quantizer=self.quantizer)
