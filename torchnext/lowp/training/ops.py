"""The two custom ops a training step is made of: the training cast and the GEMM on its copies.

Both are ``torch.library.custom_op``\\ s with fake (meta) implementations, so ``torch.compile`` (fullgraph) treats them
as opaque nodes and runs exactly the eager code: a compiled layer gives the eager bits. Operands travel as plain
tensors — a copy is ``(codes, scales, global_scale)`` with codes and scales as uint8 bytes (``(rows, kp /
per_byte)`` and ``(rows, kp / block)``) and the global scale a 0-d fp32 tensor, or an empty tensor when the
format has none (or the copy was not requested).

``train_cast(x, signs, step, recipe, role, seed, layer, quantizer, need_row, need_col)`` means::

    row_opts = recipe.quant_options(rowwise operand of role, seed=seed, layer=layer, step=int(step))
    col_opts = recipe.quant_options(columnwise operand of role, ...)
    row, col = quantize_pair(x, recipe.format, options=row_opts, col_options=col_opts,
                             rht_signs=signs if recipe.uses_rht(role) else None,
                             block_2d=recipe.weight_2d and role == "w")
    return flat(row), flat(col.t())          # a copy not needed comes back empty

Non-finite input (NVFP4): the per-tensor encode scale would absorb an Inf (``S_enc = 2688 / inf`` falls back to 1
and the Inf saturates to a finite 6 * 448), hiding an overflow; so when ``amax`` is not finite both copies get a
NaN global scale and every GEMM output that uses them is NaN. MX formats propagate NaN/Inf through their block
scales already.

``train_mm(a..., w..., bias, fmt, out_dtype, backend)`` is ``scaled_mm(a, w, epilogue=Epilogue(bias=bias,
out_dtype=out_dtype), backend=backend)`` on the rebuilt :class:`~torchnext.lowp.BlockScaledTensor` operands.
"""

from __future__ import annotations

import functools

import torch
from torch.library import custom_op

from torchnext.lowp.formats import Format, FormatSpec, format_spec
from torchnext.lowp.hadamard import RHT_SIZE, rht
from torchnext.lowp.mm.epilogue import Epilogue
from torchnext.lowp.mm.scaled_mm import scaled_mm
from torchnext.lowp.options import QuantOptions
from torchnext.lowp.pair import quantize_pair, quantize_tiles
from torchnext.lowp.quantize import quantize
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.training.recipe import Recipe

__all__ = ["Copy", "bias_grad", "check_copy_shapes", "col_length", "copy_operand", "flat_copy", "train_cast", "train_mm"]

Copy = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(codes uint8 (rows, kp / per_byte), scales uint8 (rows, kp / block), global decode scale 0-d fp32 or empty)."""


@functools.lru_cache(maxsize=64)
def _recipe(key: str) -> Recipe:
    return Recipe.from_key(key)


def _empty_copy(device: torch.device) -> Copy:
    return (torch.empty(0, dtype=torch.uint8, device=device), torch.empty(0, dtype=torch.uint8, device=device),
            torch.empty(0, dtype=torch.float32, device=device))


def flat_copy(q: BlockScaledTensor) -> Copy:
    """A BlockScaledTensor operand blocked along its last dim (block_dim 1) as the three tensors of a copy."""
    rows, cols = q.scale_matrix_shape
    gs = q.global_scale.reshape(()).float() if q.global_scale is not None else torch.empty(0, device=q.device)
    return q.qdata.view(torch.uint8), q.unswizzled_scales().reshape(rows, cols).view(torch.uint8), gs


def copy_operand(c: Copy, spec: FormatSpec, rows: int, k: int, *, recipe: str | None = None,
                 scale_mode: str | None = None, orig_dtype: torch.dtype = torch.float32) -> BlockScaledTensor:
    """Inverse of :func:`flat_copy`: the (rows, k) operand blocked along k."""
    codes, scales, gs = c
    storage = spec.element.torch_dtype if spec.element.torch_dtype is not None else torch.uint8
    return BlockScaledTensor(
        qdata=codes.view(storage), scales=scales.view(spec.scale_dtype), global_scale=gs if gs.numel() else None,
        spec=spec, shape=torch.Size((rows, k)), block_dim=1, orig_dtype=orig_dtype, recipe=recipe,
        scale_mode=scale_mode,
    )


def col_length(m: int, recipe: Recipe, role: str) -> int:
    """Length along M of the columnwise copy of an (M, ...) tensor of ``role`` (padded to 16 under RHT)."""
    return -(-m // RHT_SIZE) * RHT_SIZE if recipe.uses_rht(role) else m


@custom_op("torchnext_lowp::train_cast", mutates_args=())
def train_cast(
    x: torch.Tensor, signs: torch.Tensor | None, step: torch.Tensor, recipe: str, role: str, seed: int, layer: int,
    quantizer: str, need_row: bool, need_col: bool,
) -> list[torch.Tensor]:
    """See the module docstring. Returns the six tensors ``row codes, row scales, row global, col codes, col
    scales, col global``."""
    r = _recipe(recipe)
    step_i = int(step.reshape(()).item())
    op_row, op_col = r.copies(role)
    row_opts = r.quant_options(op_row, seed=seed, layer=layer, step=step_i, quantizer=quantizer)
    col_opts = r.quant_options(op_col, seed=seed, layer=layer, step=step_i, quantizer=quantizer)
    finite = True
    if r.format is Format.NVFP4 and x.numel():
        # one amax pass, shared by the copies that use x's own amax (the RHT copy takes the transformed one)
        lo, hi = torch.aminmax(x)
        amax = torch.maximum(hi, -lo).float()
        finite = bool(torch.isfinite(amax))
        row_opts = row_opts.with_(amax=amax)
        if not r.uses_rht(role):
            col_opts = col_opts.with_(amax=amax)
    row, col = _copies(x, r, role, row_opts, col_opts, signs, need_row, need_col)
    empty = _empty_copy(x.device)
    out_row = flat_copy(row) if row is not None else empty
    out_col = flat_copy(col.t()) if col is not None else empty
    if not finite:
        nan = torch.full((), float("nan"), device=x.device)
        out_row = (out_row[0], out_row[1], nan if out_row[2].numel() else out_row[2])
        out_col = (out_col[0], out_col[1], nan.clone() if out_col[2].numel() else out_col[2])
    outs: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in (*out_row, *out_col):  # a custom op's outputs may not share memory (2-D copies share a global scale)
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        outs.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return outs


def _copies(
    x: torch.Tensor, r: Recipe, role: str, row_opts: QuantOptions, col_opts: QuantOptions,
    signs: torch.Tensor | None, need_row: bool, need_col: bool,
) -> tuple[BlockScaledTensor | None, BlockScaledTensor | None]:
    """The requested copies of ``x`` (None for the others), each from ``x`` itself."""
    rht_signs = signs if r.uses_rht(role) else None
    if r.uses_rht(role) and signs is None:
        raise ValueError(f"recipe {r} transforms the wgrad copy of {role!r} but no RHT signs were given")
    if r.weight_2d and role == "w":
        if not (need_row or need_col):
            return None, None
        tile_row, tile_col = quantize_tiles(x, r.format, options=row_opts)
        return (tile_row if need_row else None), (tile_col if need_col else None)
    if need_row and need_col:
        return quantize_pair(x, r.format, options=row_opts, col_options=col_opts, rht_signs=rht_signs)
    row = quantize(x, r.format, options=row_opts) if need_row else None
    col: BlockScaledTensor | None = None
    if need_col:
        col = quantize(rht(x, rht_signs, dim=0) if rht_signs is not None else x, r.format, dim=0, options=col_opts)
    return row, col


def _fake_copy(x: torch.Tensor, rows: int, k: int, spec: FormatSpec) -> Copy:
    kp = -(-k // spec.block_size) * spec.block_size
    gs = x.new_empty((), dtype=torch.float32) if spec.two_level else x.new_empty(0, dtype=torch.float32)
    return (x.new_empty(rows, kp // spec.element.per_byte, dtype=torch.uint8),
            x.new_empty(rows, kp // spec.block_size, dtype=torch.uint8), gs)


@train_cast.register_fake
def _(x: torch.Tensor, signs: torch.Tensor | None, step: torch.Tensor, recipe: str, role: str, seed: int,
      layer: int, quantizer: str, need_row: bool, need_col: bool) -> list[torch.Tensor]:
    r = _recipe(recipe)
    spec = format_spec(r.format)
    m, k = x.shape
    empty = (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32))
    row = _fake_copy(x, m, k, spec) if need_row else empty
    col = _fake_copy(x, k, col_length(m, r, role), spec) if need_col else empty
    return [*row, *col]


@custom_op("torchnext_lowp::train_mm", mutates_args=())
def train_mm(
    a_codes: torch.Tensor, a_scales: torch.Tensor, a_global: torch.Tensor, a_rows: int,
    w_codes: torch.Tensor, w_scales: torch.Tensor, w_global: torch.Tensor, w_rows: int,
    k: int, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype, backend: str,
) -> torch.Tensor:
    """``scaled_mm(a, w, epilogue=Epilogue(bias=bias, out_dtype=out_dtype), backend=backend)`` on the copies
    ``a`` (a_rows, k) and ``w`` (w_rows, k), both blocked along k."""
    spec = format_spec(fmt)
    a = copy_operand((a_codes, a_scales, a_global), spec, a_rows, k)
    w = copy_operand((w_codes, w_scales, w_global), spec, w_rows, k)
    out = scaled_mm(a, w, epilogue=Epilogue(bias=bias, out_dtype=out_dtype), backend=backend)
    assert isinstance(out, torch.Tensor)
    return out if out.dtype == out_dtype else out.to(out_dtype)


@train_mm.register_fake
def _(a_codes: torch.Tensor, a_scales: torch.Tensor, a_global: torch.Tensor, a_rows: int,
      w_codes: torch.Tensor, w_scales: torch.Tensor, w_global: torch.Tensor, w_rows: int,
      k: int, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    return a_codes.new_empty(a_rows, w_rows, dtype=out_dtype)


@custom_op("torchnext_lowp::bias_grad", mutates_args=())
def bias_grad(dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``dy.sum(0)`` accumulated in fp32, cast to ``out_dtype`` (an op so a compiled backward sums in the eager
    order: the bias gradient of a compiled layer equals eager bit for bit)."""
    return dy.sum(0, dtype=torch.float32).to(out_dtype)


@bias_grad.register_fake
def _(dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return dy.new_empty(dy.shape[1], dtype=out_dtype)


def check_copy_shapes(c: Copy, spec: FormatSpec, rows: int, k: int) -> None:
    """Raise ValueError if ``c`` is not a (rows, k) copy of ``spec`` (used on copies handed in from outside,
    e.g. weights all-gathered by FSDP)."""
    kp = -(-k // spec.block_size) * spec.block_size
    want = ((rows, kp // spec.element.per_byte), (rows, kp // spec.block_size))
    got = (tuple(c[0].shape), tuple(c[1].shape))
    if got != want:
        raise ValueError(f"quantized copy has codes/scales of shapes {got}, expected {want} for ({rows}, {k})")
    if (spec.two_level and c[2].numel() != 1) or (not spec.two_level and c[2].numel() != 0):
        raise ValueError(f"quantized copy's global scale has {c[2].numel()} values for {spec.name}")
