"""Fake (meta) implementations of ``torch.ops.torchnext_cpu.*``: what FakeTensor tracing (``torch.compile``,
``torch.export``) runs instead of the kernels -- the outputs' shapes, dtypes and devices, no data.

Each mirrors the C++ kernel's allocation (csrc/gemv.cpp, csrc/quantize.cpp); the mutating casts (``quantize``,
``quantize_pair``) write into buffers their caller allocated, so their fakes return nothing. The shapes are checked
against the kernels' by ``tests/lowp/test_compile_export.py`` (compiled and exported results bitwise equal to eager).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["register"]

_GEMV_STEPS = {0: 8, 1: 16, 2: 32, 3: 32}
"""16-byte code steps per block of each gemv format code (nvfp4, mxfp4, mxfp8 e4m3, mxfp8 e5m2): csrc/gemv.cpp."""

_DONE: list[bool] = []


def _gemv_pack(qdata: torch.Tensor, scales: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if fmt not in _GEMV_STEPS:
        raise ValueError(f"torchnext_cpu.gemv_pack: unknown format code {fmt}")
    n, nb = qdata.shape[0], scales.shape[1]
    tiles = (n + 15) // 16
    block_bytes = 16 + 16 * _GEMV_STEPS[fmt]
    return (qdata.new_empty((tiles * nb * block_bytes,)), qdata.new_empty((tiles * 16,)), qdata.new_empty((1,)))


def _gemv(x: torch.Tensor, packed: torch.Tensor, nan_cols: torch.Tensor, flags: torch.Tensor, fmt: int, n: int,
          kp: int, gscale: torch.Tensor | None, scale: torch.Tensor | None, scale_kind: int, bias: torch.Tensor | None,
          act: int, residual: torch.Tensor | None, want_amax: bool, bf16_out: bool,
          isa: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.new_empty((x.shape[0], n), dtype=torch.bfloat16 if bf16_out else torch.float32)
    return y, x.new_empty((), dtype=torch.float32)


def _nothing(*args: Any) -> None:
    return None


def _amax(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


def _rng_uniform(seed: int, offset: int, numel: int) -> torch.Tensor:
    return torch.empty((numel,), dtype=torch.float32, device="cpu")


def register() -> None:
    """Register every fake (once per process; the library must be loaded)."""
    if _DONE:
        return
    fakes: dict[str, Callable[..., Any]] = {
        "gemv_pack": _gemv_pack, "gemv": _gemv, "quantize": _nothing, "quantize_pair": _nothing, "absmax": _amax,
        "rht_absmax": _amax, "rng_uniform": _rng_uniform}
    for name, fn in fakes.items():
        torch.library.register_fake(f"torchnext_cpu::{name}", fn)
    _DONE.append(True)
