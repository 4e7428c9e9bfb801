"""The 16-point random Hadamard transform (RHT) of the NVFP4 training recipe, defined bit for bit.

Meaning, for each group ``v`` of 16 consecutive elements along ``dim`` (the dim zero-padded to a multiple of 16)::

    u = signs * v                                  # signs: 16 values in {+1, -1}, fp32 (exact)
    for h in (1, 2, 4, 8):                         # the fast Walsh-Hadamard butterfly, in this order, fp32 adds
        for i in range(16):
            if i & h == 0:
                u[i], u[i + h] = u[i] + u[i + h], u[i] - u[i + h]
    rht(v) = 0.25 * u                              # exact scaling (a power of two)

Mathematically ``rht(v) = H @ (signs * v)`` with ``H`` the 16x16 Sylvester-Hadamard matrix over 4 (``H[i, j] =
(-1)**popcount(i & j) / 4``), an orthogonal matrix: ``inverse_rht(rht(v)) = v`` and, applied to both operands
along their reduction dim, ``rht(a).T @ rht(b) = a.T @ b`` — why the wgrad GEMM can run on transformed operands.
The butterfly fixes the rounding, so every implementation (this torch one, a compiled kernel) gives the same bits;
:func:`rht_reference` is the dense fp64 product, for tests. Inputs are widened to fp32 (exact for bf16/fp16).

:func:`rht_signs` draws the sign vector from a seed with :mod:`torchnext.lowp.rng` (bit 0 of draw ``i`` set →
``signs[i] = -1``), so every rank derives the same vector from the model seed.
"""

from __future__ import annotations

import torch

from torchnext.lowp.rng import bits

__all__ = ["RHT_SIZE", "check_signs", "hadamard_matrix", "inverse_rht", "rht", "rht_plain", "rht_reference", "rht_signs"]

RHT_SIZE = 16
"""Points of the transform (the NVFP4 block size)."""


def rht_signs(seed: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 fp32 signs (+1/-1) of the transform drawn from ``seed``: ``-1`` where ``rng.bits(seed, i) & 1``."""
    b = bits(seed, 0, RHT_SIZE, device=device)
    return 1.0 - 2.0 * (b & 1).to(torch.float32)


def check_signs(signs: torch.Tensor) -> None:
    """Raise ValueError unless ``signs`` is a (16,) tensor of +1/-1 values."""
    if not isinstance(signs, torch.Tensor) or signs.shape != (RHT_SIZE,):
        raise ValueError(f"RHT signs must be a tensor of shape ({RHT_SIZE},), got {getattr(signs, 'shape', signs)!r}")
    if not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError("RHT signs must all be +1 or -1")


def _grouped(x: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """``x`` widened to ``dtype``, ``dim`` moved last and zero-padded to a multiple of 16, viewed as (..., groups, 16)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"rht expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0:
        raise ValueError("rht needs at least one dimension")
    d = dim % x.dim()
    xm = x.movedim(d, -1).to(dtype)
    n = xm.shape[-1]
    pad = -n % RHT_SIZE
    if pad:
        xm = torch.nn.functional.pad(xm, (0, pad))
    return xm.reshape(*xm.shape[:-1], -1, RHT_SIZE), d


def _butterfly(u: torch.Tensor) -> torch.Tensor:
    """Stages h = 1, 2, 4, 8 of the Walsh-Hadamard butterfly on the last dim (16), unnormalized."""
    lead = u.shape[:-1]
    for h in (1, 2, 4, 8):
        v = u.reshape(*lead, RHT_SIZE // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        u = torch.stack((a + b, a - b), dim=-2).reshape(*lead, RHT_SIZE)
    return u


def _rht_rows(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The transform along dim 0 of ``x`` (L, ...), L a multiple of 16, on fp32 ping-pong buffers: every
    add/sub works on whole contiguous rows (no transpose), in the butterfly's order."""
    g = x.shape[0] // RHT_SIZE
    rest = x.shape[1:]
    r = 1
    for d in rest:
        r *= int(d)
    s = signs.to(device=x.device, dtype=torch.float32).reshape(1, RHT_SIZE, 1)
    u = x.reshape(g, RHT_SIZE, r).to(torch.float32)
    u = u * s if not inverse else u.clone()
    w = torch.empty_like(u)
    for h in (1, 2, 4, 8):
        v = u.view(g, RHT_SIZE // (2 * h), 2, h, r)
        o = w.view(g, RHT_SIZE // (2 * h), 2, h, r)
        torch.add(v[:, :, 0], v[:, :, 1], out=o[:, :, 0])
        torch.sub(v[:, :, 0], v[:, :, 1], out=o[:, :, 1])
        u, w = w, u
    u.mul_(0.25)
    if inverse:
        u.mul_(s)
    return u.reshape(x.shape[0], *rest)


def _transform(x: torch.Tensor, signs: torch.Tensor, dim: int, inverse: bool) -> torch.Tensor:
    check_signs(signs)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"rht expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0:
        raise ValueError("rht needs at least one dimension")
    d = dim % x.dim()
    xm = x.movedim(d, 0) if d else x
    pad = -xm.shape[0] % RHT_SIZE
    if pad:
        xm = torch.cat([xm.to(torch.float32), xm.new_zeros((pad, *xm.shape[1:]), dtype=torch.float32)])
    out = _rht_rows(xm.contiguous(), signs, inverse=inverse)
    return out.movedim(0, d) if d else out


def rht(x: torch.Tensor, signs: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """The transform of the module docstring along ``dim``: fp32, ``dim`` padded to a multiple of 16.

    Raises:
        ValueError: ``signs`` is not 16 values of +1/-1, or ``x`` is not a floating tensor.
    """
    return _transform(x, signs, dim, inverse=False)


def inverse_rht(y: torch.Tensor, signs: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """``signs * (H @ y)`` per group of 16 along ``dim``: the inverse of :func:`rht` (``H`` is symmetric and
    ``H @ H = I``); the padding stays (slice it off)."""
    return _transform(y, signs, dim, inverse=True)


def rht_plain(x: torch.Tensor, signs: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """The same butterfly written plainly on the moved dim (the reference of the row-wise fast path)."""
    check_signs(signs)
    g, d = _grouped(x, dim)
    u = _butterfly(g * signs.to(device=g.device, dtype=torch.float32)) * 0.25
    return u.reshape(*u.shape[:-2], -1).movedim(-1, d)


def hadamard_matrix(n: int = RHT_SIZE, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``n``-point Sylvester-Hadamard matrix over ``sqrt(n)`` (``n`` a power of two): orthogonal, symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    anded = i[:, None] & i[None, :]
    while bool(anded.any()):
        parity ^= anded & 1
        anded = anded >> 1
    return (1 - 2 * parity).to(dtype) / n**0.5


def rht_reference(x: torch.Tensor, signs: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """``H @ (signs * v)`` per group with the dense matrix in fp64 (equal to :func:`rht` up to fp32 rounding)."""
    check_signs(signs)
    g, d = _grouped(x, dim, torch.float64)
    h = hadamard_matrix(RHT_SIZE).to(g.device)
    u = (g * signs.double().to(g.device)) @ h.T
    return u.reshape(*u.shape[:-2], -1).movedim(-1, d)
