"""FSDP2 all-gathers of converted weights in the low-precision format: codes and scales travel, not the weight.

``enable_fsdp_lowp_all_gather(model, shard_size)`` (before ``fully_shard``) wraps the master weight of every
:class:`~torchnext.lowp.training.LowpTrainingLinear` whose rows split evenly into whole blocks per rank in a
:class:`LowpShardedWeight`, FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``):

    pre (each rank, its shard W_r of rows):  amax = all_reduce(max |W_r|)          # NVFP4: one global scale
                                             rowwise and columnwise copies of W_r  # with that amax: the bytes
                                                                                   # of the whole W's copies
                                             → uint8 codes and scales, rows first
    all-gather (FSDP2, along dim 0)
    post: the (N, K) copies → LowpGatheredWeight, which the layer's GEMMs use as they are (no dequantize)

Bytes gathered per weight element: NVFP4 with 2-D tiles 0.5 (codes; the columnwise copy is rebuilt from the
same tiles by a nibble transpose) + 1/256 (tile scales); NVFP4 1-D and MXFP8 carry both copies: 2 x (0.5 + 1/16)
and 2 x (1 + 1/32) — vs 4 for an fp32 and 2 for a bf16 dense gather. Because each copy of a shard equals the rows
of the whole weight's copy (blocks never straddle shards; the global amax is all-reduced), training is bitwise the
same as with a dense all-gather of the same recipe (tests/lowp/training/test_training_fsdp.py).

The wrapper keeps the fp32/bf16 shard as its inner tensor: the optimizer, gradient reduce-scatter and state dict
see the master weight (``LowpShardedWeight.unwrap``). A weight whose rows do not split into whole blocks per rank
(``N % (shard_size * block) != 0``) is left alone and gathered densely.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from torchnext.lowp.elements import pack_nibbles, unpack_nibbles
from torchnext.lowp.formats import format_spec
from torchnext.lowp.pair import quantize_pair, quantize_tiles
from torchnext.lowp.training.function import PrequantizedWeight
from torchnext.lowp.training.module import LowpTrainingLinear
from torchnext.lowp.training.ops import Copy, check_copy_shapes, copy_operand
from torchnext.lowp.training.recipe import Operand, Recipe

__all__ = ["LowpGatheredWeight", "LowpShardedWeight", "enable_fsdp_lowp_all_gather"]

aten = torch.ops.aten

_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.clone.default, aten.detach.default,
}
"""Ops whose results stay wrapped (what FSDP2 does to a parameter while sharding it); all others unwrap."""


class LowpShardedWeight(torch.Tensor):
    """A master-weight shard (a wrapper subclass over the plain tensor) that FSDP2 all-gathers as low-precision
    copies. Every op runs on the inner tensor; sharding ops keep the wrapper."""

    _tensor: torch.Tensor
    _recipe: str
    _quantizer: str

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: str, quantizer: str = "auto") -> LowpShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: str, quantizer: str = "auto") -> None:
        self._tensor = tensor
        self._recipe = recipe
        self._quantizer = quantizer

    def unwrap(self) -> torch.Tensor:
        """The plain shard."""
        return self._tensor

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        meta: list[tuple[str, str]] = []

        def unwrap(t: LowpShardedWeight) -> torch.Tensor:
            meta.append((t._recipe, t._quantizer))
            return t._tensor

        args, kwargs = pytree.tree_map_only(LowpShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        recipe, quantizer = meta[0]
        return pytree.tree_map_only(torch.Tensor, lambda t: LowpShardedWeight(t, recipe, quantizer), out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, str]]:
        return ["_tensor"], {"recipe": self._recipe, "quantizer": self._quantizer}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, str], outer_size: Any,
                             outer_stride: Any) -> LowpShardedWeight:
        return LowpShardedWeight(inner["_tensor"], meta["recipe"], meta["quantizer"])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LowpShardedWeight({self._tensor!r}, recipe={self._recipe})"

    # ------------------------------------------------------------------------------- the all-gather extension
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        recipe = Recipe.from_key(self._recipe)
        spec = format_spec(recipe.format)
        w = self._tensor.detach()
        n_local, k = w.shape
        opts = recipe.quant_options(Operand.W_ROW, quantizer=self._quantizer)
        finite = True
        if spec.two_level:  # one global scale for the whole weight: the all-reduced amax
            amax = w.abs().amax().float() if w.numel() else torch.zeros((), device=w.device)
            amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)  # NaN wins the max
            if mesh is not None and mesh.size() > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            finite = bool(torch.isfinite(amax))
            opts = opts.with_(amax=amax)
        if recipe.weight_2d:
            row, _ = quantize_tiles(w, recipe.format, options=opts)
            b = spec.block_size
            tiles = row.scale_bytes[::b].contiguous()  # (n_local / B, Kp / B): one scale per tile
            inputs: tuple[torch.Tensor, ...] = (row.qdata.view(torch.uint8), tiles)
        else:
            row, col = quantize_pair(w, recipe.format, options=opts)
            ct = col.t()  # (K, n_local) blocked along n: sent rows-first (transposed bytes)
            inputs = (row.qdata.view(torch.uint8), row.scale_bytes,
                      ct.qdata.view(torch.uint8).t().contiguous(), ct.scale_bytes.t().contiguous())
        gs = row.global_scale if row.global_scale is not None else None
        if gs is not None and not finite:
            gs = torch.full((), float("nan"), device=w.device)
        return inputs, (self._recipe, n_local, k, gs)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        recipe_key, _, k, gs = metadata
        recipe = Recipe.from_key(recipe_key)
        spec = format_spec(recipe.format)
        b = spec.block_size
        gs_t = gs.clone() if gs is not None else torch.empty(0, device=outputs[0].device)
        if recipe.weight_2d:
            codes, tiles = outputs
            n = codes.shape[0]
            row_scales = tiles.repeat_interleave(b, dim=0)
            col_codes = pack_nibbles(unpack_nibbles(codes).t().contiguous()) if spec.element.per_byte == 2 else (
                codes.t().contiguous())
            col_codes = col_codes[:k].contiguous()
            col_scales = tiles.t().repeat_interleave(b, dim=0)[:k].contiguous()
            row: Copy = (codes, row_scales, gs_t)
            col: Copy = (col_codes, col_scales, gs_t.clone())
        else:
            r_codes, r_scales, c_codes_t, c_scales_t = outputs
            n = r_codes.shape[0]
            row = (r_codes, r_scales, gs_t)
            col = (c_codes_t.t().contiguous(), c_scales_t.t().contiguous(), gs_t.clone())
        if out is not None:
            if not isinstance(out, LowpGatheredWeight):
                raise RuntimeError(f"fsdp_post_all_gather: out must be a LowpGatheredWeight, got {type(out).__name__}")
            out.refill(row, col)
            return None
        gathered = LowpGatheredWeight(row, col, recipe_key, torch.Size((n, k)), param_dtype)
        return gathered, gathered.inner_tensors()


class LowpGatheredWeight(torch.Tensor, PrequantizedWeight):
    """The unsharded weight FSDP2 hands the layer: its rowwise and columnwise training copies (no dense values).
    :func:`~torchnext.lowp.training.lowp_linear` multiplies them directly; any other op sees the dequantized
    rowwise copy (a fallback, e.g. for printing)."""

    _NAMES = ("r0", "r1", "r2", "c0", "c1", "c2")
    r0: torch.Tensor
    r1: torch.Tensor
    r2: torch.Tensor
    c0: torch.Tensor
    c1: torch.Tensor
    c2: torch.Tensor
    _recipe: str

    @staticmethod
    def __new__(cls, row: Copy, col: Copy, recipe: str, shape: torch.Size, dtype: torch.dtype) -> LowpGatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=row[0].device, requires_grad=False)

    def __init__(self, row: Copy, col: Copy, recipe: str, shape: torch.Size, dtype: torch.dtype) -> None:
        spec = format_spec(Recipe.from_key(recipe).format)
        check_copy_shapes(row, spec, shape[0], shape[1])
        check_copy_shapes(col, spec, shape[1], shape[0])
        for name, t in zip(self._NAMES, (*row, *col), strict=True):
            setattr(self, name, t)
        self._recipe = recipe

    @property
    def _row(self) -> Copy:
        return (self.r0, self.r1, self.r2)

    @property
    def _col(self) -> Copy:
        return (self.c0, self.c1, self.c2)

    def lowp_copies(self, recipe: str) -> tuple[Copy, Copy] | None:
        return (self._row, self._col) if recipe == self._recipe else None

    def inner_tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self._row, *self._col)

    def refill(self, row: Copy, col: Copy) -> None:
        """Copy new all-gathered values into this weight's tensors (FSDP2 reuses the unsharded parameter)."""
        for dst, src in zip(self.inner_tensors(), (*row, *col), strict=True):
            if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
                # the layer's backward saved these tensors: a refill between forward and backward (FSDP2's
                # re-gather) writes the same values, so keep the version counter autograd checks
                with torch.autograd._unsafe_preserve_version_counter(dst):
                    dst.copy_(src)

    def dequantized(self) -> torch.Tensor:
        spec = format_spec(Recipe.from_key(self._recipe).format)
        n, k = self.shape
        return copy_operand(self._row, spec, n, k).dequantize(self.dtype)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return list(self._NAMES), {"recipe": self._recipe, "shape": self.shape, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> LowpGatheredWeight:
        return LowpGatheredWeight((inner["r0"], inner["r1"], inner["r2"]), (inner["c0"], inner["c1"], inner["c2"]),
                                  meta["recipe"], meta["shape"], meta["dtype"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default) or (
            func is aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape)
        ):
            w = args[0]
            return LowpGatheredWeight(w._row, w._col, w._recipe, w.shape, w.dtype)
        args, kwargs = pytree.tree_map_only(LowpGatheredWeight, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LowpGatheredWeight(shape={tuple(self.shape)}, recipe={self._recipe})"


def enable_fsdp_lowp_all_gather(model: nn.Module, shard_size: int) -> list[str]:
    """Wrap the weights of ``model``'s :class:`LowpTrainingLinear` layers so that FSDP2 (``fully_shard`` over
    ``shard_size`` ranks, called afterwards) all-gathers them in the layer's low-precision format; returns the
    qualified names of the wrapped layers. Call it before ``fully_shard`` and before building the optimizer (the
    weights become new ``nn.Parameter`` objects). Layers whose ``out_features`` is not a multiple of
    ``shard_size * block`` keep a dense all-gather.

    Raises:
        ValueError: ``shard_size`` < 1.
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive int, got {shard_size!r}")
    wrapped: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, LowpTrainingLinear) or isinstance(mod.weight.data, LowpShardedWeight):
            continue
        b = mod.recipe.block_size
        if mod.out_features % (shard_size * b):
            continue
        w = mod.weight
        mod.weight = nn.Parameter(LowpShardedWeight(w.data, mod.recipe.key, mod.quantizer), requires_grad=w.requires_grad)
        wrapped.append(name)
    return wrapped
