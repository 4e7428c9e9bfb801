"""Public entry points: :func:`quantize`, :func:`dequantize`, :func:`quantization_error`.

The block matrix and the stochastic-rounding counters (fixed for every quantizer kernel)::

    xm = x.movedim(dim, -1), zero-padded along its last dim to a multiple of B (the block size)
    x2 = xm.reshape(-1, B)                        # (n_blocks, B), row-major: block b = row b
    noise[r, j] = rng.uniform(seed, offset + r * B + j)      # i = r * B + j: the flat index in x2

so padding elements consume counters too, and the counters of a tensor depend only on its padded shape. The
kernels receive ``CounterNoise(seed, offset)`` (see :mod:`torchnext.lowp.quantizers`), never a generator state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchnext.lowp import scales as _scales
from torchnext.lowp.errors import FormatDTypeError, FormatError
from torchnext.lowp.formats import Format, FormatSpec, format_spec
from torchnext.lowp.options import QuantOptions, ResolvedOptions
from torchnext.lowp.quantizers import get_quantizer
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["dequantize", "quantization_error", "quantize"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flush_denormal_on(device: torch.device) -> bool:
    """Whether CPU arithmetic flushes subnormals to zero (``torch.set_flush_denormal(True)``)."""
    if device.type != "cpu":
        return False
    return bool(torch.tensor([2.0**-127]).mul(1.0).item() == 0.0)


def check_input(x: Any, dim: int) -> int:
    """``dim`` made non-negative after checking that ``x`` is a quantizable tensor (FormatError /
    FormatDTypeError otherwise)."""
    if not isinstance(x, torch.Tensor):
        raise FormatDTypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise FormatDTypeError(
            f"cannot quantize a {x.dtype} tensor: expected one of float32, bfloat16, float16 (convert first)"
        )
    if x.dim() == 0:
        raise FormatError("cannot quantize a 0-d tensor: blocks need at least one dimension")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise FormatError(f"dim={dim!r} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def global_scales(
    x: torch.Tensor, spec: FormatSpec, opts: ResolvedOptions, *, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(decode, encode) 0-d fp32 global scales of ``x`` under ``opts`` (from its amax, or the given scale), or
    (None, None) for single-level formats. The amax is ``max |x|`` (NaN if ``x`` holds one), computed by the
    options' quantizer kernel when it offers ``tensor_amax`` (one pass), else by ``torch.aminmax``; or given as
    ``amax`` (a 0-d fp32 tensor) by a caller that has it."""
    if not spec.two_level or opts.global_scale is False:
        return None, None
    if not isinstance(opts.global_scale, bool):
        dec = torch.tensor(opts.global_scale, dtype=torch.float32, device=x.device)
        return dec, 1.0 / dec
    if amax is not None:
        pass
    elif opts.amax is not None:
        amax = opts.amax.to(x.device)
    elif x.numel():
        tensor_amax = getattr(get_quantizer(opts.backend, x.device, spec), "tensor_amax", None)
        if tensor_amax is not None:
            amax = tensor_amax(x)
        else:
            lo, hi = torch.aminmax(x)  # one pass in the input dtype (no fp32 copy); NaN propagates
            amax = torch.maximum(hi, -lo).float()
    else:
        amax = torch.zeros((), device=x.device)
    if opts.recipe == "te":
        enc = _scales.te_encode_scale(amax)
        return 1.0 / enc, enc
    dec = _scales.torchao_global_scale(amax)
    return dec, 1.0 / dec


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    fmt: Format | str | FormatSpec,
    *,
    dim: int = -1,
    options: QuantOptions | None = None,
    **kwargs: Any,
) -> BlockScaledTensor:
    """Quantize ``x`` to a block-scaled format, blocks along ``dim``.

    Meaning (per block ``b`` of ``block_size`` consecutive elements along ``dim``)::

        scale[b], mult = recipe(amax(|x[b]|))            # see torchnext.lowp.scales
        code[i] = round(clamp(x[i] * mult, -max, max))   # RNE (or stochastic), saturating; see .elements
        # stochastic: round up with probability frac, using rng.uniform(seed, offset + i), i = the element's flat
        # index in the padded block matrix (module docstring)

    The block dim is padded with zeros to a multiple of the block size (the logical shape is kept). Quantization
    is not differentiable: it runs under ``torch.no_grad()`` (inputs that require grad are fine).

    Args:
        x: float32, bfloat16 or float16 tensor with at least one dimension (any shape, may be empty).
        fmt: ``Format.NVFP4`` / ``"nvfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"``.
        dim: the dimension the blocks run along.
        options: a :class:`QuantOptions`; keyword arguments (``recipe="te"``, ``swizzle=True``, ...) override
            its fields.

    Raises:
        FormatError: unknown format/option, option for another format, bad ``dim``.
        FormatDTypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        DeterminismError: stochastic rounding without a ``seed`` while determinism is requested.

    Example::

        >>> q = quantize(torch.randn(128, 64), "nvfp4", recipe="te")
        >>> q.dequantize().shape
        torch.Size([128, 64])
    """
    spec = format_spec(fmt)
    opts = options if options is not None else QuantOptions()
    if kwargs:
        opts = opts.with_(**kwargs)
    ro = opts.resolve(spec)
    dim = check_input(x, dim)
    if flush_denormal_on(x.device):
        raise FormatError(
            "torch.set_flush_denormal(True) is in effect: the E8M0/E2M1 scales and codes need fp32 subnormals; "
            "call torch.set_flush_denormal(False) before quantizing"
        )
    backend = get_quantizer(ro.backend, x.device, spec)
    dec, enc = global_scales(x, spec, ro)
    inputs = _scales.ScaleInputs(spec, dec, enc)
    quantize_tensor = getattr(backend, "quantize_tensor", None)
    if quantize_tensor is not None:  # the kernel reads x in place along dim and writes the final layout
        qdata, scale_t = quantize_tensor(x, dim, spec, ro, inputs, ro.noise)
        return assemble(qdata, scale_t, dec, spec, ro, shape=x.shape, dim=dim, orig_dtype=x.dtype, final=True)
    block = spec.block_size
    xm = x.movedim(dim, -1) if dim != x.dim() - 1 else x
    k = xm.shape[-1]
    k_padded = -(-k // block) * block
    if k_padded != k:
        xm = torch.nn.functional.pad(xm, (0, k_padded - k))
    xm = xm.contiguous()
    rest = xm.shape[:-1]
    x2 = xm.reshape(-1, block) if xm.numel() else xm.new_empty(math.prod(rest) * (k_padded // block), block)
    codes, scales = backend.quantize_blocks(x2, spec, ro, inputs, ro.noise)
    return assemble(codes, scales, dec, spec, ro, shape=x.shape, dim=dim, orig_dtype=x.dtype)


def assemble(
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_decode: torch.Tensor | None,
    spec: FormatSpec,
    ro: ResolvedOptions,
    *,
    shape: torch.Size,
    dim: int,
    orig_dtype: torch.dtype,
    final: bool = False,
) -> BlockScaledTensor:
    """A :class:`BlockScaledTensor` of logical ``shape`` blocked along ``dim`` from a kernel's flat outputs: codes
    ``(n_blocks, B / per_byte)`` (or already ``(*rest, k_padded / per_byte)``) and scales ``(n_blocks,)``, in the
    order of the padded block matrix (see the module docstring); swizzles the scales if ``ro.swizzle``.
    ``final=True``: the scales are already in their stored layout (swizzled if ``ro.swizzle``) and kept as given."""
    block = spec.block_size
    rest = [s for i, s in enumerate(shape) if i != dim]
    k_padded = -(-shape[dim] // block) * block
    qdata = codes.reshape(*rest, k_padded // spec.element.per_byte)
    n_blocks = k_padded // block
    if final:
        scale_t = scales
    elif ro.swizzle:
        scale_t = _scales.swizzle(scales.reshape(math.prod(rest), n_blocks))
    else:
        scale_t = scales.reshape(*rest, n_blocks)
    return BlockScaledTensor(
        qdata=qdata,
        scales=scale_t,
        global_scale=global_decode,
        spec=spec,
        shape=torch.Size(shape),
        block_dim=dim,
        swizzled=ro.swizzle,
        orig_dtype=orig_dtype,
        recipe=ro.recipe,
        scale_mode=ro.scale_mode,
        rounding=ro.rounding,
    )


def dequantize(
    q: BlockScaledTensor, dtype: torch.dtype | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """Dense values of ``q``: ``decode(code) * float(scale) * global_scale`` computed in fp32, cast to ``dtype``
    (default: the dtype that was quantized), padding dropped, logical shape and block dim restored (contiguous).
    Same as ``q.dequantize(dtype, backend=backend)``.

    Raises:
        FormatError: ``q`` is not a BlockScaledTensor, or ``dtype`` is not a floating dtype.
    """
    if not isinstance(q, BlockScaledTensor):
        raise FormatError(f"dequantize expects a BlockScaledTensor, got {type(q).__name__}")
    return q.dequantize(dtype, backend=backend)


def quantization_error(x: torch.Tensor, fmt: Format | str | FormatSpec, **kwargs: Any) -> dict[str, float]:
    """How much ``fmt`` (with the options in ``kwargs``, as for :func:`quantize`) loses on ``x``.

    Returns a dict: ``sqnr_db`` (10·log10(Σx² / Σ(x - x̂)²), ``inf`` when exact), ``rel_l2`` (‖x - x̂‖ / ‖x‖),
    ``max_abs_err``, ``mean_abs_err``, ``bits_per_element`` (storage incl. scales) and ``compression`` (dense bytes /
    quantized bytes). Computed in float64 over all elements (NaN inputs propagate).
    """
    q = quantize(x, fmt, **kwargs)
    ref = x.double()
    err = q.dequantize(torch.float32).double() - ref
    signal = float((ref * ref).sum())
    noise = float((err * err).sum())
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    n = max(1, x.numel())
    return {
        "sqnr_db": sqnr,
        "rel_l2": math.sqrt(noise / signal) if signal > 0 else (0.0 if noise == 0 else math.inf),
        "max_abs_err": float(err.abs().max()) if x.numel() else 0.0,
        "mean_abs_err": float(err.abs().sum()) / n,
        "bits_per_element": 8 * q.nbytes / n,
        "compression": q.dense_nbytes / q.nbytes if q.nbytes else 1.0,
    }
