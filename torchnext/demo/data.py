"""The demo's built-in dataset: a deterministic synthetic language, generated on the fly (no downloads).

Sentences come from a tiny grammar with arithmetic facts (``"seven plus two is nine."``) and simple clauses
(``"the red fox sees a small cat."``). A character-level model starts at ``ln(vocab) ≈ 3.3`` nats per character and
learns spelling, word order and (slowly) the arithmetic; loss falls clearly within a few dozen steps.

``batches(seed, rank, world_size, batch_size, seq_len)`` yields ``(inputs, targets)`` int64 tensors of shape
``(batch_size, seq_len)``; each data-parallel rank reads a disjoint, deterministic stream for a given step, so a run
is reproducible and a rank that replaces a dead one reads exactly what the dead rank would have read.
"""

from __future__ import annotations

import random

import torch

__all__ = ["VOCAB", "encode", "decode", "corpus", "batch_for_step"]

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_ADJ = ["red", "small", "quick", "lazy", "green", "old"]
_NOUN = ["fox", "cat", "dog", "bird", "fish", "frog"]
_VERB = ["sees", "likes", "chases", "finds"]

VOCAB: str = " .abcdefghijklmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """Characters → int64 ids (every character must be in :data:`VOCAB`)."""
    try:
        return torch.tensor([_INDEX[c] for c in text], dtype=torch.int64)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the demo vocabulary") from None


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[int(i)] for i in ids.reshape(-1))


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.5:
        a, b = rng.randrange(10), rng.randrange(10)
        if a + b < 10:
            return f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}."
        return f"{_NUMBERS[max(a, b)]} minus {_NUMBERS[min(a, b)]} is {_NUMBERS[max(a, b) - min(a, b)]}."
    return f"the {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} a {rng.choice(_ADJ)} {rng.choice(_NOUN)}."


def corpus(seed: int, n_chars: int) -> str:
    """``n_chars`` characters of the language, deterministic in ``seed``."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars + 1:
        s = _sentence(rng) + " "
        parts.append(s)
        total += len(s)
    return "".join(parts)[: n_chars + 1]


def batch_for_step(
    step: int, *, seed: int, shard: int, num_shards: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that data shard ``shard`` of ``num_shards`` trains on at ``step`` (pure function of its arguments)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    text = corpus(seed * 1_000_003 + step * 1009 + shard, batch_size * (seq_len + 1))
    ids = encode(text[: batch_size * (seq_len + 1)]).view(batch_size, seq_len + 1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
