"""The eager fast quantizer: vectorized torch ops on cache-sized chunks of blocks.

Same interface and same bytes as :mod:`torchnext.lowp.quantizers.reference`. Speed comes from three things: (1) the tensor is
processed in chunks of about :data:`CHUNK_ELEMENTS` elements, so the intermediates of the ~15 elementwise passes
stay in L2/L3 cache and are recycled by the allocator instead of being page-faulted in; (2) the block amax is one
``aminmax`` pass (no ``abs`` temporary); (3) rounding and encoding are bit manipulations on the fp32 view
(:func:`~torchnext.lowp.elements.encode_fast`) and in-place ops.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from torchnext.lowp.elements import decode_reference, encode_fast, stochastic_round_fast
from torchnext.lowp.formats import FormatSpec
from torchnext.lowp.options import ResolvedOptions, block_outputs
from torchnext.lowp.rng import CounterNoise, noise_rows
from torchnext.lowp.scales import SCALE_RECIPES, ScaleInputs
from torchnext.lowp.tracing import compiling

__all__ = ["CHUNK_ELEMENTS", "dequantize_blocks", "quantize_blocks"]

CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk (1 MiB of fp32)."""

_POOL: ThreadPoolExecutor | None = None
_POOL_KEY: tuple[int, int] = (0, 0)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The worker-lane pool, created lazily; re-created after a fork (a forked child has none of the threads)."""
    global _POOL, _POOL_KEY
    key = (workers, os.getpid())
    with _POOL_LOCK:
        if _POOL is None or _POOL_KEY != key:
            if _POOL is not None and _POOL_KEY[1] == key[1]:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchnext-lowp")
            _POOL_KEY = key
        return _POOL


def run_chunks(n: int, rows: int, work: Callable[[int, int], None], *, parallel: bool = True) -> None:
    """Call ``work(start, stop)`` for every chunk of ``rows`` rows out of ``n``.

    Chunks are spread over ``torch.get_num_threads()`` Python threads, each running torch single-threaded: the
    ~15 small ops per chunk then need no OpenMP barrier each, which matters most on a busy machine (measured
    on the 2-core CI VM under load: 2 intra-op threads per op 300-4800 ms vs 140 ms single-threaded for NVFP4 at
    4096x4096). torch ops release the GIL, so the threads run in parallel. ``parallel=False`` (CUDA tensors) runs
    the plain loop. ``work`` must only write its own rows.
    """
    starts = list(range(0, n, rows))
    # traced (torch.compile/export): no Python threads in a graph
    threaded = parallel and not compiling()
    default = torch.get_num_threads() if threaded else 1  # this thread's setting; workers restore it as the default
    workers = min(default, len(starts))
    if workers <= 1:
        for start in starts:
            work(start, min(n, start + rows))
        return

    def lane(first: int) -> None:
        torch.set_num_threads(1)
        try:
            for i in range(first, len(starts), workers):
                work(starts[i], min(n, starts[i] + rows))
        finally:
            torch.set_num_threads(default)

    for fut in [_pool(workers).submit(lane, i) for i in range(workers)]:
        fut.result()


def _rows_per_chunk(block: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(block, 1))


_ABS_MASK = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF)}


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| per row, NaN if the row holds a NaN: the integer max of the bit patterns with the sign cleared
    (monotonic in |x| for non-negative floats, and every NaN pattern is above Inf). One fast integer reduction."""
    int_dtype, mask = _ABS_MASK[x.dtype]
    top = torch.bitwise_and(x.view(int_dtype), mask).amax(dim=1)
    return top.view(x.dtype).float()


_SATURATES: dict[torch.dtype, bool] = {}


def _cast_saturates(dtype: torch.dtype) -> bool:
    """Whether torch's cast to ``dtype`` already saturates (finite overflow and ±Inf → ±max, NaN → NaN), making the
    clamp redundant: true for float8_e4m3fn since torch 2.12; never for float8_e5m2 (it has Inf)."""
    ok = _SATURATES.get(dtype)
    if ok is None:
        finfo = torch.finfo(dtype)
        probe = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, finfo.max * 1.05])
        want = torch.tensor([finfo.max, -finfo.max, finfo.max, -finfo.max, finfo.max])
        ok = bool(torch.equal(probe.to(dtype).float(), want))
        _SATURATES[dtype] = ok
    return ok


def quantize_blocks(
    x2: torch.Tensor,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x2`` (one block per row); see :mod:`torchnext.lowp.quantizers.reference`. A
    :class:`~torchnext.lowp.rng.CounterNoise` is expanded chunk by chunk (its draws never exist all at once)."""
    el = spec.element
    n, block = x2.shape
    codes, scale_bytes = block_outputs(x2, spec)
    scales = scale_bytes.view(spec.scale_dtype)
    if n == 0 or block == 0:
        return codes, scales
    scale_fn = SCALE_RECIPES[(opts.scale_recipe, True)]
    rows = _rows_per_chunk(block)
    skip_clamp = el.torch_dtype is not None and _cast_saturates(el.torch_dtype)

    widen = x2.dtype != torch.float32

    def work(start: int, stop: int) -> None:
        xc = x2[start:stop]
        if widen:
            # bf16/fp16 → fp32 is exact, and torch computes ``bf16 * fp32`` in fp32 anyway: widening the chunk
            # first gives the same bytes, but the fp32 amax and an in-place multiply are 2-60x faster on CPU
            # than the int16 amax and the mixed-dtype broadcast multiply (measured single-threaded, 1 MiB chunks).
            y = xc.float()
            scale, mult = scale_fn(block_amax(y), inp)
            y.mul_(mult[:, None])
        else:
            scale, mult = scale_fn(block_amax(xc), inp)
            y = xc * mult[:, None]
        if noise is not None:
            y = stochastic_round_fast(y, el, noise_rows(noise, start, stop, block, device=y.device))
        elif not skip_clamp:
            y.clamp_(-el.max_value, el.max_value)
        encode_fast(y, el, codes[start:stop])
        scales[start:stop] = scale

    run_chunks(n, rows, work, parallel=x2.device.type == "cpu")
    return codes, scales


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode_table(spec: FormatSpec, device: torch.device) -> torch.Tensor:
    """Byte → value(s) lookup table, built once per (element, device): 256 float16 values (every FP8 and FP6 value
    is exact in float16), or for packed FP4 256 int32 words holding the two float16 values of the byte's nibbles
    (element 2i, the low nibble, in the low half)."""
    el = spec.element
    key = (el.name, device)
    lut = _LUTS.get(key)
    if lut is None:
        byte = torch.arange(256, dtype=torch.int32)
        if el.per_byte == 2:
            lo = decode_reference(byte & 15, el).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
            hi = decode_reference(byte >> 4, el).to(torch.float16).view(torch.int16).to(torch.int32)
            lut = lo | (hi << 16)
        elif el.torch_dtype is not None:
            lut = byte.to(torch.uint8).view(el.torch_dtype).to(torch.float16)
        else:
            lut = decode_reference(byte & ((1 << el.bits) - 1), el).to(torch.float16)
        lut = lut.to(device)
        _LUTS[key] = lut
    return lut


def _decode_f16(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Codes (rows, B / per_byte) → float16 values (rows, B), exact."""
    el = spec.element
    rows = codes.shape[0]
    u8 = codes.view(torch.uint8)
    if el.torch_dtype is torch.float8_e5m2:  # e5m2 is the top byte of float16
        return torch.bitwise_left_shift(u8.to(torch.int16), 8).view(torch.float16)
    lut = decode_table(spec, codes.device)
    picked = torch.index_select(lut, 0, u8.reshape(-1).to(torch.int32))
    return picked.view(torch.float16).view(rows, -1)


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, spec: FormatSpec, global_decode: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``decode(code) * (float(scale) * global_decode)`` in fp32, then cast to ``dtype`` (chunked; codes decoded
    exactly to float16 by a table lookup or a shift, then one broadcast multiply)."""
    el = spec.element
    n = codes.shape[0]
    block = codes.shape[1] * el.per_byte
    out = torch.empty(n, block, dtype=dtype, device=codes.device)
    if n == 0 or block == 0:
        return out
    if el.torch_dtype is not torch.float8_e5m2:
        decode_table(spec, codes.device)  # build the table once, outside the worker threads

    def work(start: int, stop: int) -> None:
        factor = scales[start:stop].float()
        if global_decode is not None:
            factor = factor * global_decode
        values = _decode_f16(codes[start:stop], spec)
        if dtype == torch.float32:
            torch.mul(values, factor[:, None], out=out[start:stop])
        else:
            out[start:stop] = values * factor[:, None]

    run_chunks(n, _rows_per_chunk(block), work, parallel=codes.device.type == "cpu")
    return out
