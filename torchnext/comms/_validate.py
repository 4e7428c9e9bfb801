"""Argument checks run before an op is issued (a bad call raises here, on this rank, with a clear message)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_list", "check_rank", "check_same_dtype", "check_tensor"]

_STRIDED = torch.strided
_CPU = torch.device("cpu")  # ``device == _CPU`` costs a fifth of ``device.type == "cpu"`` (which builds a str)


def check_tensor(t: object, what: str, op: str, device: torch.device, *, sparse: bool = False) -> torch.Tensor:
    """``t`` if it is a contiguous dense tensor on ``device`` (a sparse COO tensor too where ``sparse``: Gloo's
    all_reduce sums those); ``TypeError``/``ValueError`` naming ``op`` and ``what`` otherwise."""
    if type(t) is torch.Tensor and t.is_cpu and device == _CPU and t.layout is _STRIDED and t.is_contiguous():
        return t  # fast path for the common case
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise ValueError(f"{op}: {what} is on {t.device}, but this communicator's backend communicates {device} tensors")
    if t.is_sparse:
        if sparse and t.layout is torch.sparse_coo:
            return t
        raise ValueError(f"{op}: {what} is sparse; only dense tensors are supported"
                         + (" (all_reduce takes sparse COO tensors)" if op != "all_reduce" else ""))
    if not t.is_contiguous():
        raise ValueError(f"{op}: {what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); call .contiguous()")
    return t


def check_list(ts: object, what: str, op: str, device: torch.device, length: int) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{op}: {what} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != length:
        raise ValueError(f"{op}: {what} must hold {length} tensors (one per rank), got {len(ts)}")
    return [check_tensor(t, f"{what}[{i}]", op, device) for i, t in enumerate(ts)]


def check_same_dtype(op: str, ref: torch.Tensor, ref_name: str, others: Sequence[torch.Tensor], name: str) -> None:
    for i, t in enumerate(others):
        if t.dtype != ref.dtype:
            raise TypeError(f"{op}: dtype mismatch: {ref_name} is {ref.dtype} but {name}[{i}] is {t.dtype}")


def check_same_numel(op: str, ref: torch.Tensor, ref_name: str, others: Sequence[torch.Tensor], name: str) -> None:
    for i, t in enumerate(others):
        if t.numel() != ref.numel():
            raise ValueError(
                f"{op}: size mismatch: {ref_name} has shape {tuple(ref.shape)} but {name}[{i}] has shape {tuple(t.shape)}"
            )


def check_rank(r: object, size: int, what: str, op: str) -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"{op}: {what} must be an int rank, got {r!r}")
    if not 0 <= r < size:
        raise ValueError(f"{op}: {what}={r} is out of range for a communicator of size {size} (valid: 0..{size - 1})")
    return r


def check_splits(splits: object, what: str, op: str, size: int, dim0: int, tensor_name: str) -> list[int]:
    if not isinstance(splits, (list, tuple)):
        raise TypeError(f"{op}: {what} must be a list of {size} ints, got {type(splits).__name__}")
    if len(splits) != size:
        raise ValueError(f"{op}: {what} must have {size} entries (one per rank), got {len(splits)}")
    out = []
    for s in splits:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"{op}: {what} entries must be non-negative ints, got {list(splits)}")
        out.append(s)
    if sum(out) != dim0:
        raise ValueError(f"{op}: {what} sums to {sum(out)} but {tensor_name}.shape[0] is {dim0}")
    return out
