"""The demo's model: a small mixture-of-experts transformer language model (character level).

* Each block: causal self-attention, then a mixture-of-experts feed-forward layer. The router scores every
  sequence (mean of its token states) and :func:`torchnext.switch` runs the chosen expert on it (sequence-level
  top-1 routing, scaled by the router probability so the router learns; a switch-transformer load-balancing loss
  keeps experts in use).
* Precision (``ModelConfig.precision``), with fp32 master weights, gradients and optimizer state throughout:

  ==========  ==========================================================================================
  ``nvfp4``   :func:`torchnext.lowp.convert_to_lowp_training` with ``Recipe.NVFP4`` (2-D weight tiles, RHT,
  ``mxfp8``   stochastic rounding) or ``Recipe.MXFP8``: fprop, dgrad and wgrad of the converted layers run in
              the format. Converted: block 0's attention projections (qkv, proj) and experts (up, down).
              Kept in bf16 (:class:`BF16Linear`), as :func:`torchnext.lowp.bf16_tail_filter` chooses for 2
              blocks (the last ceil(15 %) of the blocks, the head): block 1's projections and experts, the head.
              Kept in fp32: embeddings, layer norms, attention scores (SDPA), the routers, the loss.
  ``bf16``    every projection, expert and the head in bf16 (:class:`BF16Linear`); the rest fp32
  ``fp32``    everything fp32
  ==========  ==========================================================================================

  ``ModelConfig.lowp_recipe`` (a :attr:`Recipe.key`) and ``lowp_all_layers`` select ablations (e.g. NVFP4 without
  RHT, or every linear layer including the head and routers in NVFP4) for ``benchmarks/lowp/train_parity.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import torchnext

__all__ = ["BF16Linear", "ModelConfig", "MoETransformerLM", "Precision", "apply_precision"]


class Precision(str, enum.Enum):
    """Precision of the demo's linear layers (see the module docstring)."""

    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Size and precision of the demo model."""

    vocab_size: int
    """Number of token ids."""
    d_model: int = 64
    """Width of the residual stream (a multiple of 32, the MX block)."""
    n_heads: int = 4
    """Attention heads."""
    n_layers: int = 2
    """Transformer blocks."""
    n_experts: int = 4
    """Experts per MoE layer."""
    d_hidden: int = 128
    """Hidden width of each expert."""
    max_seq_len: int = 128
    """Longest sequence (positional embedding size)."""
    precision: Precision = Precision.NVFP4
    """Precision of projections, experts and head (module docstring)."""
    lowp_backend: str = "eager"
    """``torchnext.lowp.scaled_mm`` backend of the converted layers."""
    lowp_recipe: str | None = None
    """A :attr:`torchnext.lowp.Recipe.key` replacing the precision's recipe (ablations); None: the published one."""
    lowp_all_layers: bool = False
    """Convert every linear layer (head and routers included) instead of keeping the bf16 tail."""
    lowp_seed: int = 0
    """Model seed of the converted layers (RHT signs, stochastic-rounding streams): the same on every rank."""


class BF16Linear(nn.Linear):
    """``nn.Linear`` computed in bf16 (input, weight and bias cast; fp32 master weights), output in the input's
    dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(torch.bfloat16) if self.bias is not None else None
        return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias).to(x.dtype)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    """A plain linear layer with the demo's initialization (normal, std 1/sqrt(in); zero bias)."""
    lin = nn.Linear(in_features, out_features)
    with torch.no_grad():
        nn.init.normal_(lin.weight, std=1.0 / math.sqrt(in_features))
        lin.bias.zero_()
    return lin


def _to_bf16(lin: nn.Linear) -> BF16Linear:
    mod = BF16Linear.__new__(BF16Linear)
    nn.Module.__init__(mod)
    mod.in_features, mod.out_features = lin.in_features, lin.out_features
    mod.weight, mod.bias = lin.weight, lin.bias
    return mod


def apply_precision(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """Swap ``model``'s linear layers for ``cfg.precision`` in place (module docstring); returns the names of the
    layers converted to low precision."""
    from torchnext.lowp import LowpTrainingLinear, Recipe, bf16_tail_filter, convert_to_lowp_training

    precision = Precision(cfg.precision)
    if precision in (Precision.NVFP4, Precision.MXFP8):
        recipe = Recipe.from_key(cfg.lowp_recipe) if cfg.lowp_recipe else (
            Recipe.NVFP4 if precision is Precision.NVFP4 else Recipe.MXFP8)
        keep = None if cfg.lowp_all_layers else bf16_tail_filter(model)
        convert_to_lowp_training(model, recipe, keep, seed=cfg.lowp_seed, backend=cfg.lowp_backend)
    if precision is not Precision.FP32:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name != "router":
                    setattr(parent, name, _to_bf16(child))
    return [n for n, m in model.named_modules() if isinstance(m, LowpTrainingLinear)]


class _Expert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = _linear(cfg.d_model, cfg.d_hidden)
        self.down = _linear(cfg.d_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Sequence-level top-1 mixture of experts; experts chosen with :func:`torchnext.switch`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.d_model, cfg.n_experts)
        self.experts = nn.ModuleList(_Expert(cfg) for _ in range(cfg.n_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        probs = self.router(x.mean(dim=1)).softmax(dim=-1)  # (B, E)
        choice = probs.argmax(dim=-1)  # (B,)
        branches = list(self.experts)
        outs = [torchnext.switch(choice[b], branches, (x[b],)) * probs[b, choice[b]] for b in range(x.shape[0])]
        n = len(branches)
        frac = torch.bincount(choice, minlength=n).float() / x.shape[0]
        self.aux_loss = n * (frac * probs.mean(dim=0)).sum()
        return torch.stack(outs)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = _linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = _linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ln2(x))


class MoETransformerLM(nn.Module):
    """Token ids ``(B, T)`` → logits ``(B, T, vocab)``; ``loss(inputs, targets)`` adds the load-balancing loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.lowp_layers = apply_precision(self, cfg)
        """Qualified names of the layers trained in low precision."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, aux_weight: float = 0.01,
             step: int | None = None, forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, float]:
        """(total loss for backward, language-model loss in nats/char for reporting). ``step``: the training step
        number, which the low-precision layers' stochastic rounding draws from (so replicas that retried a step,
        or joined and healed, draw the same noise: :func:`torchnext.lowp.set_lowp_step`). ``forward``: what runs
        the model (a DDP wrapper of it: DDP must see the forward), default ``self``."""
        if step is not None and self.lowp_layers:
            from torchnext.lowp.training import set_lowp_step

            set_lowp_step(self, step)
        logits = (forward or self)(ids)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        aux = torch.zeros(())
        for blk in self.blocks:
            aux = aux + cast(_Block, blk).moe.aux_loss
        return lm + aux_weight * aux, float(lm.detach())
