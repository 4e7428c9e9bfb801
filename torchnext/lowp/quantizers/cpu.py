"""``cpu``: the quantize casts as one compiled C++ pass (csrc/quantize.cpp): same bytes as
:mod:`torchnext.lowp.quantizers.reference`, at memory speed.

What ``"auto"`` picks for CPU tensors of the built-in formats when the kernels are available
(:mod:`torchnext.lowp.cpu`; otherwise ``eager``). Besides the shared interface (``quantize_blocks`` on the padded
block matrix, ``dequantize_blocks``) it offers :func:`quantize_tensor`, which :func:`torchnext.lowp.quantize` uses
when present: it reads ``x`` in place along any ``dim`` (no transposed or padded copy: the kernel gathers blocks
down the columns and pads on the fly) and writes the scales straight into the swizzled layout when asked.

One read of ``x`` (plus, for two-level NVFP4, the tensor amax pass of ``quantize``), one write of codes and scales:
rows of blocks are spread over torch's intra-op threads (``at::parallel_for``). Stochastic rounding: a
:class:`~torchnext.lowp.rng.CounterNoise` is drawn in the kernel (``uniform(seed, offset + i)``, ``i`` the element's
flat index in the padded block matrix, as :func:`torchnext.lowp.quantize` defines it); a noise tensor is read.
Rows longer than one block (the B x B tiles of :func:`torchnext.lowp.quantize_tiles`) go to the eager kernel.
Dequantize is the eager kernel's.
"""

from __future__ import annotations

import math

import torch

from torchnext.lowp import scales as _scales
from torchnext.lowp.cpu import isa_index, ops, simd, unavailable
from torchnext.lowp.formats import FORMATS, FormatSpec
from torchnext.lowp.options import ResolvedOptions, block_outputs
from torchnext.lowp.quantizers import eager as _eager
from torchnext.lowp.rng import CounterNoise
from torchnext.lowp.scales import ScaleInputs
from torchnext.lowp.workspace import fresh

__all__ = [
    "dequantize_blocks",
    "quantize_blocks",
    "quantize_pair_blocks",
    "auto_reason",
    "quantize_tensor",
    "rht_amax",
    "tensor_amax",
    "unavailable_reason",
]

_ELEMENT_CODES = {"e2m1": 0, "e4m3": 1, "e5m2": 2}
_RECIPE_CODES = {"torchao": 0, "te": 1, "floor": 2, "rceil": 3}
_BUILTIN = {s.name: s for s in FORMATS.values()}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ISA: str | None = None
"""Instruction-set variant to run (None: the best compiled one); tests set it to check each variant."""

_U64 = 1 << 64


def unavailable_reason(device: torch.device | None, spec: FormatSpec | None) -> str | None:
    """Why this kernel cannot quantize a tensor on ``device`` to ``spec`` (None: it can)."""
    if device is not None and device.type != "cpu":
        return f"CPU tensors only, not {device.type}"
    if spec is not None and (_BUILTIN.get(spec.name) is not spec or spec.element.name not in _ELEMENT_CODES):
        return f"format {spec.name!r} is not compiled into the kernel (built-in NVFP4/MXFP8/MXFP4 only)"
    return unavailable() or None


def auto_reason(device: torch.device | None, spec: FormatSpec | None) -> str | None:
    """Why ``backend="auto"`` should not pick this kernel (None: it should): unavailable here, or only the portable
    variant is compiled (no AVX-512 / AVX2), whose speed against the eager kernel is not known."""
    why = unavailable_reason(device, spec)
    if why is None and not simd():
        why = "only the portable (non-SIMD) variant is compiled here"
    return why


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the whole tensor as a 0-d fp32 tensor (NaN if ``x`` holds a NaN), one parallel pass over the
    bit patterns (the global amax of two-level NVFP4)."""
    return ops().absmax(x.contiguous(), isa_index(ISA))


def rht_amax(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``max |rht(x, signs, dim=0)|`` of the 2-D ``x`` (:mod:`torchnext.lowp.hadamard`, bit for bit) as a 0-d fp32
    tensor, without materializing the transform: the column copy's global amax for :func:`quantize_pair`."""
    return ops().rht_absmax(x.contiguous(), signs.detach().to(device="cpu", dtype=torch.float32), isa_index(ISA))


def _global_args(inp: ScaleInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The two-level scale as the kernel takes it: 0-d tensors (None: one-level), never values read from them
    (``float(t)`` would break a ``torch.compile`` graph); the kernel rounds them to fp32 as ``float()`` did."""
    if inp.global_decode is None:
        return None, None
    return inp.global_decode, inp.global_encode


def _signed64(v: int) -> int:
    return v - _U64 if v >= 1 << 63 else v


def _run(
    x: torch.Tensor,
    outer: int,
    k: int,
    inner: int,
    codes: torch.Tensor,
    scale_buf: torch.Tensor,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
    *,
    swizzle_cols: int | None,
) -> None:
    dec, enc = _global_args(inp)
    counter = noise if isinstance(noise, CounterNoise) else None
    tensor = noise if isinstance(noise, torch.Tensor) else None
    ops().quantize(
        x,
        outer,
        k,
        inner,
        codes.view(torch.uint8),
        scale_buf,
        _ELEMENT_CODES[spec.element.name],
        spec.block_size,
        _RECIPE_CODES[opts.scale_recipe],
        dec,
        enc,
        swizzle_cols is not None,
        swizzle_cols or 0,
        tensor,
        counter is not None,
        _signed64(counter.seed if counter is not None else 0),
        _signed64(counter.offset if counter is not None else 0),
        isa_index(ISA),
    )


def quantize_blocks(
    x2: torch.Tensor,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x2`` (one block per row); see :mod:`torchnext.lowp.quantizers.reference`."""
    n, block = x2.shape
    if block != spec.block_size:  # B x B tiles (one scale per B*B elements): the eager kernel's job
        return _eager.quantize_blocks(x2, spec, opts, inp, noise)
    codes, scale_bytes = block_outputs(x2, spec)
    if n and block:
        x = x2 if x2.dtype in _DTYPES else x2.float()
        _run(x.contiguous(), n, block, 1, codes, scale_bytes, spec, opts, inp, noise, swizzle_cols=None)
    return codes, scale_bytes.view(spec.scale_dtype)


def quantize_tensor(
    x: torch.Tensor,
    dim: int,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scales)`` of ``quantize(x, spec, dim=dim)`` in their final layout (``opts.swizzle`` respected),
    reading ``x`` where it lies. ``noise``: a :class:`~torchnext.lowp.rng.CounterNoise` (the kernel draws
    ``uniform(seed, offset + i)``, ``i`` the element's flat index in the padded block matrix), or those draws as an
    fp32 tensor shaped like that matrix ``(rows * n_blocks, block)``."""
    xc = x.contiguous()
    shape = list(xc.shape)
    outer = math.prod(shape[:dim])
    k = shape[dim]
    inner = math.prod(shape[dim + 1 :])
    block = spec.block_size
    kp = -(-k // block) * block
    nb = kp // block
    rows = outer * inner
    rest = shape[:dim] + shape[dim + 1 :]
    el = spec.element
    storage = el.torch_dtype if el.torch_dtype is not None else torch.uint8
    codes = fresh((rows, kp // el.per_byte), storage, x.device)  # huge pages advised: no 4 KiB page faults
    if opts.swizzle:
        srows, scols = _scales.swizzled_shape(rows, nb)
        padded = (rows % 128) or (nb % 4)
        scale_buf = (torch.zeros if padded else torch.empty)(srows * scols, dtype=torch.uint8, device=x.device)
        scales = scale_buf.view(srows, scols)
    else:
        scale_buf = fresh((rows * nb,), torch.uint8, x.device)
        scales = scale_buf.view(*rest, nb)
    if rows and kp:
        _run(xc, outer, k, inner, codes, scale_buf, spec, opts, inp, noise, swizzle_cols=nb if opts.swizzle else None)
    return codes.view(*rest, kp // el.per_byte), scales.view(spec.scale_dtype)


def _noise_args(noise: object) -> tuple[bool, int, int] | None:
    """(stochastic?, seed, offset) for the pair kernel; None for a noise tensor (not taken: the torch path runs)."""
    if noise is None:
        return False, 0, 0
    if isinstance(noise, CounterNoise):
        return True, _signed64(noise.seed), _signed64(noise.offset)
    return None


def quantize_pair_blocks(
    x: torch.Tensor,
    spec: FormatSpec,
    row_opts: ResolvedOptions,
    col_opts: ResolvedOptions,
    row_inputs: ScaleInputs,
    col_inputs: ScaleInputs,
    signs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Both training copies of the 2-D ``x`` from one read (the contract of :mod:`torchnext.lowp.pair`): each
    B x B tile is loaded once, quantized along its rows for the rowwise copy and along its columns — after the
    16-point RHT butterfly of :mod:`torchnext.lowp.hadamard` when ``signs`` is given — for the columnwise copy,
    with both copies' stochastic-rounding draws computed in the kernel. Declines (None) what it does not cover:
    non-CPU tensors, custom formats, noise given as a tensor."""
    if unavailable_reason(x.device, spec) is not None or x.dim() != 2 or x.dtype not in _DTYPES:
        return None
    rn, cn = _noise_args(row_opts.noise), _noise_args(col_opts.noise)
    if rn is None or cn is None:
        return None
    m, k = x.shape
    block = spec.block_size
    pb = spec.element.per_byte
    kp = -(-k // block) * block
    mprime = -(-m // 16) * 16 if signs is not None else m
    mp = -(-mprime // block) * block
    el = spec.element
    storage = el.torch_dtype if el.torch_dtype is not None else torch.uint8
    row_codes = fresh((m, kp // pb), storage, x.device)  # huge pages advised: no 4 KiB page faults
    col_codes = fresh((k, mp // pb), storage, x.device)
    row_scales = fresh((m * kp // block,), torch.uint8, x.device)
    col_scales = fresh((k * mp // block,), torch.uint8, x.device)
    rdec, renc = _global_args(row_inputs)
    cdec, cenc = _global_args(col_inputs)
    ops().quantize_pair(
        x.contiguous(),
        row_codes.view(torch.uint8),
        row_scales,
        col_codes.view(torch.uint8),
        col_scales,
        _ELEMENT_CODES[el.name],
        block,
        _RECIPE_CODES[row_opts.scale_recipe],
        rdec,
        renc,
        rn[0],
        rn[1],
        rn[2],
        _RECIPE_CODES[col_opts.scale_recipe],
        cdec,
        cenc,
        cn[0],
        cn[1],
        cn[2],
        None if signs is None else signs.detach().to(device="cpu", dtype=torch.float32),
        isa_index(ISA),
    )
    return row_codes, row_scales, col_codes, col_scales


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, spec: FormatSpec, global_decode: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``decode(code) * (float(scale) * global_decode)`` in fp32, then cast to ``dtype`` (the eager kernel's)."""
    return _eager.dequantize_blocks(codes, scales, spec, global_decode, dtype)
