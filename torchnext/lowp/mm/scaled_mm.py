"""``scaled_mm``: block-scaled matmul with a fused epilogue, dispatched through the backend registry."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from torchnext.lowp.errors import FormatError
from torchnext.lowp.mm.backends import BackendUnavailable, KernelBackend, Problem, get_backend
from torchnext.lowp.mm.epilogue import Epilogue, EpilogueError, EpilogueOutput
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["ScaledMMResult", "make_problem", "run_problem", "scaled_mm"]

log = logging.getLogger("torchnext.lowp.mm.scaled_mm")


class ScaledMMResult(NamedTuple):
    """Result of :func:`scaled_mm` when the epilogue asks for ``output_amax`` and/or ``out_format``."""

    output: torch.Tensor
    """The dense (M, N) output in the epilogue's ``out_dtype``."""
    amax: torch.Tensor | None
    """``max |y|`` as a 0-d fp32 tensor (``output_amax=True``), else None."""
    quantized: BlockScaledTensor | None
    """``y`` quantized to ``out_format`` (blocks along N), else None."""


def _check_operand(x: object, name: str) -> tuple[int, int, torch.device]:
    if isinstance(x, BlockScaledTensor):
        if len(x.shape) != 2:
            raise FormatError(f"scaled_mm: {name} must be 2-D, got a BlockScaledTensor of shape {tuple(x.shape)}")
        if x.block_dim != 1:
            raise FormatError(
                f"scaled_mm: {name} must be blocked along K (its last dim, block_dim=1), got block_dim={x.block_dim}; "
                "quantize the (N, K) weight with dim=-1 (F.linear convention)"
            )
        return x.shape[0], x.shape[1], x.device
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise FormatError(f"scaled_mm: {name} must be 2-D, got shape {tuple(x.shape)}")
        if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise FormatError(
                f"scaled_mm: dense {name} must be float32/bfloat16/float16/float64, got {x.dtype} "
                "(wrap float8 data in a BlockScaledTensor)"
            )
        return x.shape[0], x.shape[1], x.device
    raise FormatError(f"scaled_mm: {name} must be a torch.Tensor or a BlockScaledTensor, got {type(x).__name__}")


def make_problem(
    a: torch.Tensor | BlockScaledTensor, w: torch.Tensor | BlockScaledTensor, epilogue: Epilogue | None
) -> Problem:
    """Validate the operands and build the :class:`~torchnext.lowp.mm.backends.Problem` the backends receive."""
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise EpilogueError(f"epilogue must be a torchnext.lowp.Epilogue or None, got {type(epilogue).__name__}")
    ep = epilogue or Epilogue()
    m, ka, dev_a = _check_operand(a, "a")
    n, kw, dev_w = _check_operand(w, "w")
    if ka != kw:
        raise FormatError(f"scaled_mm: a is ({m}, {ka}) and w is ({n}, {kw}): K differs (w is (N, K) as in F.linear)")
    if dev_a != dev_w:
        raise FormatError(f"scaled_mm: a is on {dev_a} and w on {dev_w}")
    ep.check(m, n)
    if ep.out_dtype is not None:
        out_dtype = ep.out_dtype
    else:
        out_dtype = a.dtype if isinstance(a, torch.Tensor) else a.orig_dtype
    return Problem(a=a, w=w, epilogue=ep, out_dtype=out_dtype, m=m, n=n, k=ka, device=dev_a)


def run_problem(problem: Problem, backend: str | KernelBackend) -> EpilogueOutput:
    """Run ``problem`` on the named backend (raises :class:`BackendUnavailable` with the reason if it cannot)."""
    b = get_backend(backend)
    ok, why = b.available()
    if not ok:
        raise BackendUnavailable(f"scaled_mm backend {b.name!r} is unavailable: {why}")
    why2 = b.supports(problem)
    if why2 is not None:
        raise BackendUnavailable(f"scaled_mm backend {b.name!r} does not support {problem.formats} on {problem.device}: {why2}")
    return b.run(problem)


def scaled_mm(
    a: torch.Tensor | BlockScaledTensor,
    w: torch.Tensor | BlockScaledTensor,
    *,
    epilogue: Epilogue | None = None,
    backend: str | KernelBackend = "auto",
) -> torch.Tensor | ScaledMMResult:
    """``epilogue(a @ w.T)`` with block-scaled (or dense) operands — the F.linear convention.

    Meaning (the ``reference`` backend computes exactly this, in fp64)::

        acc = dequantize(a) @ dequantize(w).T        # a (M, K), w (N, K); dense operands used as they are
        y = acc * scale + bias; y = act(y); y = y + residual      # each step only if given (see Epilogue)
        amax = y.abs().max(); y_q = quantize(y, out_format)      # only if asked
        out = y.to(out_dtype)
        return ScaledMMResult(out, amax, y_q) if (output_amax or out_format) else out

    Args:
        a: (M, K) dense float tensor or BlockScaledTensor blocked along K.
        w: (N, K) dense float tensor or BlockScaledTensor blocked along K (``quantize(weight, fmt)``).
        epilogue: an :class:`Epilogue` (None: plain matmul).
        backend: ``"auto"`` (the autotuner picks among the available backends that support the problem and pass a
            correctness check; see :mod:`torchnext.lowp.mm.autotune`) or a :class:`KernelBackend` name.

    Raises:
        FormatError: operands of the wrong type/shape/layout, K mismatch, different devices.
        EpilogueError: epilogue tensors that do not fit (M, N).
        BackendUnavailable: the named backend is missing or does not support the problem (the message says why).

    Example::

        >>> w = quantize(torch.randn(256, 128), "nvfp4")
        >>> r = scaled_mm(torch.randn(4, 128), w, epilogue=Epilogue(bias=torch.zeros(256), activation="gelu",
        ...               output_amax=True))
        >>> r.output.shape, r.amax.shape
        (torch.Size([4, 256]), torch.Size([]))
    """
    problem = make_problem(a, w, epilogue)
    name: str | KernelBackend = backend
    if backend == "auto":
        from torchnext.lowp.mm.autotune import select

        name = select(problem)
    elif not isinstance(backend, (str, KernelBackend)):
        raise FormatError(f"backend must be 'auto' or a KernelBackend name, got {type(backend).__name__}")
    out = run_problem(problem, name)
    ep = problem.epilogue
    if ep.output_amax or ep.out_format is not None:
        return ScaledMMResult(out.output, out.amax, out.quantized)
    return out.output
