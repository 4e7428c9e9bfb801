"""The workload every variant of ``bench_parallel.py`` (and its torchft peer, ``torchft_peer.py``) trains: one model,
one data stream, one kind of simulated compute, and the statistics they are summarised with. Only torch and the
standard library here: the torchft peer imports this module from another virtual environment."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

IN = 64
BATCH = 32


def model(hidden: int, seed: int = 0) -> nn.Sequential:
    """An MLP, the same initial weights for a given ``seed`` (about ``2 * hidden**2`` parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, IN))


def batch(step: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s input at step ``step`` (the same for every variant)."""
    return torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(1000 * step + replica))


def compute(ms: float, kind: str) -> None:
    """Simulated compute of ``ms`` milliseconds: ``sleep`` (the CPU is idle, as while an accelerator computes) or
    ``busy`` (a spinning loop that holds a core for the whole time)."""
    if ms <= 0:
        return
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs`` (nan when empty)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def palindrome(variants: Sequence[str], rounds: int) -> list[str]:
    """Block order A B C C B A A B C ...: every variant sits at every position equally often (ABBA generalised)."""
    order: list[str] = []
    for r in range(rounds):
        order += list(variants) if r % 2 == 0 else list(reversed(variants))
    return order
