"""Reduction operators."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp"]


class ReduceOp(str, enum.Enum):
    """Reduction applied element-wise across ranks (same meaning as ``torch.distributed.ReduceOp``).

    Reference semantics over the ranks' tensors ``xs``::

        SUM: xs[0] + xs[1] + ...      PRODUCT: xs[0] * xs[1] * ...
        MIN / MAX: element-wise       AVG: SUM / len(xs)   (floating dtypes only)
        BAND / BOR / BXOR: xs[0] & xs[1] & ... (| , ^)     (integer and bool dtypes only)

    ``AVG`` is passed to the backend when it supports it natively, otherwise emulated as SUM followed by an in-place
    division on completion. Integer ``AVG`` raises ``TypeError`` (the mean of integers is not an integer).
    A plain string (``"sum"``) is accepted wherever a ``ReduceOp`` is.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """``op`` as a :class:`ReduceOp`; ``ValueError``/``TypeError`` naming the allowed values otherwise."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
            raise ValueError(f"unknown reduce op {op!r}; expected one of {[m.value for m in cls]}")
        raise TypeError(f"op must be a torchnext.comms.ReduceOp (one of {[m.name for m in cls]}), got {op!r}")

    def to_c10d(self) -> dist.ReduceOp.RedOpType:
        """The ``torch.distributed.ReduceOp`` value for this op."""
        return _TO_C10D[self]

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` when this op is undefined for ``dtype``."""
        if self is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"ReduceOp.AVG needs a floating dtype, got {dtype}; use SUM and divide yourself")
        if self in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"ReduceOp.{self.name} needs an integer or bool dtype, got {dtype}")

    @classmethod
    def from_c10d(cls, op: object) -> ReduceOp:
        """The op for a ``torch.distributed.ReduceOp`` (or its ``RedOpType``); ``ValueError`` naming ops torchnext
        has no Communicator op for (``PREMUL_SUM``: a torchnext process group runs it as a SUM of pre-multiplied
        tensors, see :mod:`torchnext.comms.process_group.group`; on a Communicator, scale and SUM)."""
        kind = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType
        found = _FROM_C10D.get(kind)
        if found is None:
            raise ValueError(f"reduce op {kind} is not supported by torchnext (it supports "
                             f"{[m.name for m in cls]}; PREMUL_SUM runs on torchnext process groups: on a "
                             "Communicator, multiply by the factor and SUM)")
        return found


_TO_C10D: dict[ReduceOp, dist.ReduceOp.RedOpType] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_FROM_C10D: dict[object, ReduceOp] = {v: k for k, v in _TO_C10D.items()}
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
