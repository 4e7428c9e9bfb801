"""Test inputs shared by the lowp tests: named distributions that stress block scaling."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def distributions(shape: tuple[int, ...], seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) pairs: Gaussian, heavy-tailed, outliers, tiny, huge, subnormal, constant blocks, zeros,
    values spanning 120 binades, and exact element-grid ties."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(shape, generator=g)
    yield "gaussian", n
    yield "heavy_tailed", torch.distributions.StudentT(1.5).sample(shape).clamp(-1e30, 1e30)
    o = n.clone()
    o.view(-1)[:: 97] *= 1e4
    yield "outliers", o
    yield "tiny", n * 1e-30
    yield "huge", n * 1e30
    yield "subnormal", n * 1e-40
    yield "constant", torch.full(shape, 3.0)
    yield "zeros", torch.zeros(shape)
    yield "wide", n * torch.exp2(torch.randint(-60, 60, shape, generator=g).float())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0.0, -0.0, 0.1, -6.0, 4.0, 1.0])
    yield "fp4_ties", ties.repeat(n.numel() // 16 + 1)[: n.numel()].reshape(shape)
