"""The demo's model: a small mixture-of-experts transformer language model (character level).

* Each block: causal self-attention, then a mixture-of-experts feed-forward layer. The router scores every
  sequence (mean of its token states) and :func:`torchnext.switch` runs the chosen expert on it (sequence-level
  top-1 routing, scaled by the router probability so the router learns; a switch-transformer load-balancing loss
  keeps experts in use).
* Expert and projection layers are :class:`LowpLinear`: fp32 master weights, and in the forward pass the weight is
  quantized to the chosen block-scaled format (NVFP4 or MXFP8) and multiplied with
  :func:`torchnext.lowp.mm.scaled_mm` with the bias fused into the epilogue. The backward pass uses the straight-through
  estimator (gradients computed with the dequantized weight, applied to the master weight), as in
  quantization-aware training. ``bf16`` and ``fp32`` precisions use plain ``F.linear`` (bf16: weight and input cast).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

import torchnext

__all__ = ["Precision", "ModelConfig", "LowpLinear", "MoETransformerLM"]


class Precision(str, enum.Enum):
    """Weight precision of the demo's linear layers."""

    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"
    BF16 = "bf16"
    FP32 = "fp32"


# Precision -> block-scaled format name understood by torchnext.lowp (None: dense).
_FORMATS: dict[Precision, str | None] = {
    Precision.NVFP4: "nvfp4",
    Precision.MXFP8: "mxfp8_e4m3",
    Precision.BF16: None,
    Precision.FP32: None,
}


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Size of the demo model."""

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
    """Weight precision of projections and experts."""
    lowp_backend: str = "eager"
    """``torchnext.lowp.mm.scaled_mm`` backend for the block-scaled layers."""


class _QuantLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, fmt: str, backend: str) -> Any:
        from torchnext.lowp import Epilogue, quantize, scaled_mm

        wq = quantize(weight.detach(), fmt)
        x2 = x.reshape(-1, x.shape[-1])
        y = cast(torch.Tensor, scaled_mm(x2, wq, epilogue=Epilogue(bias=bias.detach()), backend=backend))
        w_deq = wq.dequantize(torch.float32)
        ctx.save_for_backward(x2, w_deq)
        ctx.in_shape = x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x2, w_deq = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (g2 @ w_deq).reshape(ctx.in_shape)
        grad_w = g2.t() @ x2  # straight-through estimator: d(quantize)/dw := identity
        grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None


class LowpLinear(nn.Module):
    """``y = x @ q(W).T + b`` where ``q`` quantizes to ``precision`` (straight-through gradients)."""

    def __init__(self, in_features: int, out_features: int, *, precision: Precision, backend: str = "eager") -> None:
        super().__init__()
        self.precision = Precision(precision)
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = _FORMATS[self.precision]
        if fmt is not None:
            out: torch.Tensor = _QuantLinearFn.apply(x, self.weight, self.bias, fmt, self.backend)
            return out
        if self.precision is Precision.BF16:
            return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), self.bias.to(torch.bfloat16)).float()
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.weight.shape[0]}, precision={self.precision.value}"


class _Expert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = LowpLinear(cfg.d_model, cfg.d_hidden, precision=cfg.precision, backend=cfg.lowp_backend)
        self.down = LowpLinear(cfg.d_hidden, cfg.d_model, precision=cfg.precision, backend=cfg.lowp_backend)

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
        self.qkv = LowpLinear(cfg.d_model, 3 * cfg.d_model, precision=cfg.precision, backend=cfg.lowp_backend)
        self.proj = LowpLinear(cfg.d_model, cfg.d_model, precision=cfg.precision, backend=cfg.lowp_backend)
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, aux_weight: float = 0.01) -> tuple[torch.Tensor, float]:
        """(total loss for backward, language-model loss in nats/char for reporting)."""
        logits = self(ids)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        aux = torch.zeros(())
        for blk in self.blocks:
            aux = aux + cast(_Block, blk).moe.aux_loss
        return lm + aux_weight * aux, float(lm.detach())
