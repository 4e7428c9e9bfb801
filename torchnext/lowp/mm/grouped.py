"""``grouped_scaled_mm``: one op for a mixture-of-experts layer (tokens grouped by expert, uneven group sizes).

Meaning (:func:`grouped_reference` is this loop, written plainly)::

    start = 0
    for e, end in enumerate(offsets):               # offsets[e] = end row of expert e's tokens (non-decreasing)
        out[start:end] = epilogue_e(a[start:end] @ dequantize(w_stack)[e].T)
        start = end
    # epilogue_e: as in scaled_mm; a (E, N) bias picks row e, per-row scale / residual are sliced like a

The fast path has no Python loop over experts: the stacked weights are dequantized once (eager LUT decoder),
``torch._grouped_mm`` multiplies every group in one call (fallback: groups padded to the largest one and one
``torch.bmm``), and the epilogue runs once over all rows (a per-expert bias is gathered by each row's expert id).
Empty groups and sizes that are not multiples of 16/32 are allowed.

The *reduction-grouped* form (``w`` 2-D, as ``torch._grouped_mm``'s 2-D x 2-D case; a MoE layer's weight
gradient): the groups run along the reduction dim, ``a`` (N, T) and ``w`` (K, T) (dense, or block-scaled along T),
and ``out[e] = a[:, start_e:end_e] @ w[:, start_e:end_e].T`` is (E, N, K). Block-scaled operands need every group
to start at a multiple of their block size (so no block straddles two groups: pad each group, as
:func:`torchnext.lowp.training.lowp_grouped_mm` does); no epilogue.

``compute_dtype=torch.bfloat16`` (opt-in, changes results): the weights are decoded straight to bf16 — *exact*
for FP4/FP8 elements with E4M3/E8M0 scales (:mod:`torchnext.lowp.mm.decode`; an NVFP4 global scale is left out of the
decode and multiplies the fp32 output instead) — the activations are rounded to bf16, and the GEMM runs on bf16
kernels (oneDNN's AVX512-BF16 / AMX on CPU, ≈ 4-5x the fp32 GEMM here) whose output is bf16; the epilogue runs in
fp32. Versus the fp32 semantics the error is the bf16 rounding of the activations and of the product (SQNR
≈ 50 dB on Gaussian data, far below the 4-bit weights' own error of ≈ 14 dB). The default
(``torch.float32``) keeps the loop's fp32 semantics exactly.

Under ``torch.compile``/``torch.export`` the grouped GEMMs are two custom ops, ``torchnext_lowp::grouped_mm`` and
``torchnext_lowp::grouped_mm_reduce``, whose kernels are the eager code above (``torch._grouped_mm`` or its
fallback) and whose fake implementations give the output shape from the input shapes alone: a graph cannot hold a
buffer sized by the offsets' values, and running the same kernel keeps compiled results bitwise equal to eager.
Their backward is the grouped pair (``grad_a = grouped_mm(grad, w^T)``, ``grad_w = grouped_mm_reduce(grad^T, a^T)``).
The offsets' *values* are checked in eager only.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchnext.lowp.errors import FormatError
from torchnext.lowp.mm.backends._common import dense_operand
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.epilogue import Epilogue, EpilogueError, apply_epilogue
from torchnext.lowp.mm.scaled_mm import ScaledMMResult
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.tracing import compiling
from torchnext.lowp.workspace import fresh, reusable

__all__ = ["expert_weight", "grouped_reference", "grouped_scaled_mm"]


def expert_weight(w_stack: torch.Tensor | BlockScaledTensor, e: int) -> torch.Tensor | BlockScaledTensor:
    """Expert ``e``'s (N, K) weight (a view of the codes; scales unswizzled)."""
    if isinstance(w_stack, torch.Tensor):
        return w_stack[e]
    scales = w_stack.unswizzled_scales()[e]
    return replace(
        w_stack, qdata=w_stack.qdata[e], scales=scales, shape=torch.Size(w_stack.shape[1:]), block_dim=1, swizzled=False
    )


def _validate(
    a: torch.Tensor | BlockScaledTensor, w_stack: torch.Tensor | BlockScaledTensor, offsets: torch.Tensor, ep: Epilogue
) -> tuple[int, int, int, int]:
    if isinstance(w_stack, BlockScaledTensor):
        if len(w_stack.shape) != 3 or w_stack.block_dim != 2:
            raise FormatError(
                f"grouped_scaled_mm: w_stack must be an (E, N, K) BlockScaledTensor blocked along K, got shape "
                f"{tuple(w_stack.shape)} block_dim={w_stack.block_dim}"
            )
    elif isinstance(w_stack, torch.Tensor):
        if w_stack.dim() != 3 or not w_stack.is_floating_point():
            raise FormatError(f"grouped_scaled_mm: dense w_stack must be a 3-D float tensor, got {tuple(w_stack.shape)} {w_stack.dtype}")
    else:
        raise FormatError(f"grouped_scaled_mm: w_stack must be a tensor or BlockScaledTensor, got {type(w_stack).__name__}")
    e, n, k = w_stack.shape
    if isinstance(a, (torch.Tensor, BlockScaledTensor)) and len(a.shape) == 2:
        t, ka = a.shape
    else:
        raise FormatError("grouped_scaled_mm: a must be a 2-D (T, K) tensor or BlockScaledTensor")
    if ka != k:
        raise FormatError(f"grouped_scaled_mm: a has K={ka} but w_stack has K={k}")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise FormatError("grouped_scaled_mm: offsets must be a 1-D int32/int64 tensor of group end rows")
    if offsets.numel() != e:
        raise FormatError(f"grouped_scaled_mm: offsets has {offsets.numel()} entries for {e} experts")
    # the values are data: checked in eager; a traced graph (torch.compile/export) cannot branch on them
    if e and not compiling() and (
            bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[0]) < 0 or int(offsets[-1]) != t):
        raise FormatError(f"grouped_scaled_mm: offsets must be non-decreasing, start >= 0 and end at T={t}: {offsets.tolist()}")
    if ep.bias is not None and tuple(ep.bias.shape) not in ((n,), (e, n)):
        raise EpilogueError(f"grouped bias must be ({n},) or ({e}, {n}), got {tuple(ep.bias.shape)}")
    return e, t, n, k


def _expert_ids(offsets: torch.Tensor, t: int) -> torch.Tensor:
    counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64))
    return torch.repeat_interleave(torch.arange(offsets.numel(), device=offsets.device), counts, output_size=t)


def _padded_bmm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Fallback without torch._grouped_mm: scatter rows into (E, max_group, K), one bmm, gather back."""
    e = w.shape[0]
    t = a.shape[0]
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    ids = _expert_ids(offsets, t)
    pos = torch.arange(t, device=a.device) - starts[ids]
    g = int((ends - starts).max()) if e else 0
    buf = a.new_zeros(e, max(g, 1), a.shape[1])
    buf[ids, pos] = a
    out = torch.bmm(buf, w.transpose(1, 2))
    return out[ids, pos]


def _grouped_acc_eager(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None and a.shape[0] > 0:
        try:
            return gm(a, w.transpose(1, 2), offs=offsets.to(torch.int32))
        except (RuntimeError, NotImplementedError):
            pass
    return _padded_bmm(a, w, offsets)


def _reduce_acc_eager(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(E, N, K) ``out[e] = a[:, g_e] @ w[:, g_e].T`` of dense (N, T) and (K, T) operands, in their dtype."""
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None and offsets.numel() and a.shape[1] > 0:
        try:
            return gm(a, w.t(), offs=offsets.to(torch.int32))
        except (RuntimeError, NotImplementedError):
            pass
    ends = [int(v) for v in offsets.tolist()]
    out = a.new_zeros(len(ends), a.shape[0], w.shape[0])  # fallback: one GEMM per group
    for e, (s0, s1) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if s1 > s0:
            out[e] = a[:, s0:s1] @ w[:, s0:s1].t()
    return out


@torch.library.custom_op("torchnext_lowp::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[g_e] = a[g_e] @ w[e].T``: the eager grouped GEMM as one op of a traced graph (module docstring)."""
    return _grouped_acc_eager(a, w, offsets)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], w.shape[1]))


@torch.library.custom_op("torchnext_lowp::grouped_mm_reduce", mutates_args=())
def _grouped_mm_reduce_op(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[e] = a[:, g_e] @ w[:, g_e].T`` (E, N, K): the reduction-grouped GEMM as one op (module docstring)."""
    return _reduce_acc_eager(a, w, offsets)


@_grouped_mm_reduce_op.register_fake
def _grouped_mm_reduce_fake(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty((offsets.shape[0], a.shape[0], w.shape[0]))


def _grouped_mm_setup(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _grouped_mm_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a, w, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
    need_a, need_w, _ = ctx.needs_input_grad  # type: ignore[attr-defined]
    grad_a = _grouped_mm_op(grad.to(w.dtype), w.transpose(1, 2).contiguous(), offsets) if need_a else None
    grad_w = _grouped_mm_reduce_op(grad.t().to(a.dtype).contiguous(), a.t().contiguous(), offsets) if need_w else None
    return (None if grad_a is None else grad_a.to(a.dtype), None if grad_w is None else grad_w.to(w.dtype), None)


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_acc(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if compiling():
        return _grouped_mm_op(a, w, offsets)
    return _grouped_acc_eager(a, w, offsets)


def _grouped_acc_bf16(
    a: torch.Tensor | BlockScaledTensor, w_stack: torch.Tensor | BlockScaledTensor, offsets: torch.Tensor, reuse: bool
) -> torch.Tensor:
    """fp32 accumulator of the bf16 compute path (an NVFP4 global scale applied to the output)."""
    gs = None
    if isinstance(w_stack, BlockScaledTensor):
        wd = dequantize_operand(w_stack, torch.bfloat16, with_global_scale=False, scratch_tag="grouped.w" if reuse else None)
        gs = w_stack.global_scale
    else:
        wd = dense_operand(w_stack, torch.bfloat16, scratch_tag="grouped.w" if reuse else None)
    ad = dense_operand(a, torch.bfloat16, scratch_tag="grouped.a" if reuse else None)
    acc16 = _grouped_acc(ad, wd, offsets)
    # widen into a fresh fp32 tensor (huge pages: see torchnext.lowp.workspace.fresh); it is the accumulator the
    # epilogue then overwrites in place
    acc = fresh(acc16.shape, torch.float32, acc16.device).copy_(acc16) if reuse else acc16.to(torch.float32)
    if gs is not None:
        acc = acc.mul_(gs.to(torch.float32)) if reuse else acc * gs.to(torch.float32)
    return acc


def grouped_scaled_mm(
    a: torch.Tensor | BlockScaledTensor,
    w_stack: torch.Tensor | BlockScaledTensor,
    offsets: torch.Tensor,
    *,
    epilogue: Epilogue | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | ScaledMMResult:
    """Grouped ``epilogue(a[g] @ w_stack[e].T)`` (see the module docstring); returns like :func:`scaled_mm`.

    Args:
        a: (T, K) tokens sorted by expert (dense or block-scaled along K).
        w_stack: (E, N, K) expert weights (``quantize(w, fmt)`` of a 3-D tensor: blocks along K).
        offsets: (E,) int32/int64 cumulative group ends (``offsets[-1] == T``), as ``torch._grouped_mm``.
        epilogue: as for :func:`scaled_mm`; ``bias`` may also be per expert, shape (E, N).
        compute_dtype: ``torch.float32`` (default: fp32 GEMM, the loop's semantics) or ``torch.bfloat16`` (bf16
            activations and GEMM, exact bf16 weights; see the module docstring).

    Raises:
        FormatError / EpilogueError: shapes, layouts or offsets that do not fit.
        ValueError: ``compute_dtype`` is neither fp32 nor bf16.
    """
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grouped_scaled_mm: compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}")
    if len(w_stack.shape) == 2:
        if epilogue is not None:
            raise EpilogueError("grouped_scaled_mm: the reduction-grouped form (2-D w) takes no epilogue")
        return _grouped_reduce(a, w_stack, offsets, compute_dtype)
    ep = epilogue or Epilogue()
    _, t, _, _ = _validate(a, w_stack, offsets, ep)
    # decoded operands go to scratch memory and the epilogue runs in place on the fresh accumulator, unless autograd
    # could save them (see torchnext.lowp.workspace)
    reuse = reusable(a, w_stack)
    if compute_dtype == torch.bfloat16:
        acc = _grouped_acc_bf16(a, w_stack, offsets, reuse)
    else:
        ad = dense_operand(a, scratch_tag="grouped.a" if reuse else None)
        wd = dense_operand(w_stack, scratch_tag="grouped.w" if reuse else None)
        acc = _grouped_acc(ad, wd, offsets)
    if ep.bias is not None and ep.bias.dim() == 2:
        ids = _expert_ids(offsets, t)
        s = ep.scale_tensor(acc.device)
        acc = acc * s if s is not None else acc
        acc = acc + ep.bias.to(torch.float32)[ids]
        ep = replace(ep, scale=None, bias=None)
    out_dtype = ep.out_dtype or (a.dtype if isinstance(a, torch.Tensor) else a.orig_dtype)
    res = apply_epilogue(acc, ep, out_dtype, inplace=True)
    if ep.output_amax or ep.out_format is not None:
        return ScaledMMResult(res.output, res.amax, res.quantized)
    return res.output


def _grouped_reduce(
    a: torch.Tensor | BlockScaledTensor, w: torch.Tensor | BlockScaledTensor, offsets: torch.Tensor,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """(E, N, K) ``out[e] = a[:, g_e] @ w[:, g_e].T`` (module docstring), fp32 (or bf16-computed) output."""
    for name, x in (("a", a), ("w", w)):
        if not isinstance(x, (torch.Tensor, BlockScaledTensor)) or len(x.shape) != 2:
            raise FormatError(f"grouped_scaled_mm (reduction-grouped): {name} must be 2-D, got {getattr(x, 'shape', x)}")
        if isinstance(x, BlockScaledTensor) and x.block_dim != 1:
            raise FormatError(f"grouped_scaled_mm (reduction-grouped): {name} must be blocked along T (its dim 1)")
    n, t = a.shape
    k, tw = w.shape
    if t != tw:
        raise FormatError(f"grouped_scaled_mm (reduction-grouped): a is ({n}, {t}) and w is ({k}, {tw}): T differs")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise FormatError("grouped_scaled_mm: offsets must be a 1-D int32/int64 tensor of group end columns")
    if not compiling():  # the values are data: checked in eager (a traced graph cannot branch on them)
        ends = [int(v) for v in offsets.tolist()]
        if any(b < a_ for a_, b in zip([0, *ends[:-1]], ends, strict=True)) or (ends and ends[-1] != t):
            raise FormatError(f"grouped_scaled_mm: offsets must be non-decreasing and end at T={t}: {ends}")
        starts = [0, *ends[:-1]]
        for x in (a, w):
            if isinstance(x, BlockScaledTensor) and any(s % x.block_size for s in starts):
                raise FormatError(
                    f"grouped_scaled_mm (reduction-grouped): groups must start at multiples of the block size "
                    f"{x.block_size} (a block may not straddle two groups), got starts {starts}"
                )
    dtype = compute_dtype
    ad = dense_operand(a, dtype) if isinstance(a, BlockScaledTensor) else a.to(dtype)
    wd = dense_operand(w, dtype) if isinstance(w, BlockScaledTensor) else w.to(dtype)
    out = _grouped_mm_reduce_op(ad, wd, offsets) if compiling() else _reduce_acc_eager(ad, wd, offsets)
    return out.to(torch.float32)


def grouped_reference(
    a: torch.Tensor | BlockScaledTensor,
    w_stack: torch.Tensor | BlockScaledTensor,
    offsets: torch.Tensor,
    *,
    epilogue: Epilogue | None = None,
    backend: str = "reference",
) -> torch.Tensor:
    """The per-expert loop of the module docstring using ``scaled_mm(..., backend=backend)`` on each group (the
    oracle for tests, and the "Python loop" peer in the benchmark). Returns the dense output only."""
    from torchnext.lowp.mm.scaled_mm import scaled_mm

    ep = epilogue or Epilogue()
    e, t, n, _ = _validate(a, w_stack, offsets, ep)
    out_dtype = ep.out_dtype or (a.dtype if isinstance(a, torch.Tensor) else a.orig_dtype)
    ad = dense_operand(a) if isinstance(a, BlockScaledTensor) else a
    out = torch.empty(t, n, dtype=out_dtype, device=ad.device)
    start = 0
    for i in range(e):
        end = int(offsets[i])
        if end > start:
            rows = slice(start, end)
            bias = ep.bias[i] if ep.bias is not None and ep.bias.dim() == 2 else ep.bias
            scale = ep.scale[rows] if isinstance(ep.scale, torch.Tensor) and ep.scale_kind == "row" else ep.scale
            res = ep.residual[rows] if ep.residual is not None else None
            sub = Epilogue(scale=scale, bias=bias, activation=ep.activation, residual=res, out_dtype=out_dtype)
            out[rows] = scaled_mm(ad[rows], expert_weight(w_stack, i), epilogue=sub, backend=backend)  # type: ignore[assignment]
        start = end
    return out
