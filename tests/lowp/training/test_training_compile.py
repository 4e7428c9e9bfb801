"""torch.compile of converted models: fullgraph forward and backward; the converted layers give the eager bits
(their casts and GEMMs are custom ops that run the eager code), the step counter never recompiles, and a model
with norms, attention and activations compiles whole. Few, small compiles (each costs seconds on CI)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

from torchnext.lowp.training import Recipe, convert_to_lowp_training

pytestmark = pytest.mark.slow


def _pair(recipe: Recipe, make: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = convert_to_lowp_training(make(), recipe, seed=3, backend="eager")
    other = convert_to_lowp_training(make(), recipe, seed=3, backend="eager")
    other.load_state_dict(eager.state_dict())
    return eager, other


class Stack(nn.Module):
    """Converted layers with only exact ops between them: their inputs match eager bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 80), nn.Linear(80, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


@pytest.mark.parametrize("recipe", [Recipe.NVFP4, Recipe.MXFP8])
def test_compiled_layers_equal_eager_bit_for_bit(recipe: Recipe) -> None:
    eager, other = _pair(recipe, Stack)
    compiled = torch.compile(other, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(40, 64, generator=g)
        dy = torch.randn(40, 48, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ctx = torch._dynamo.config.patch(error_on_recompile=True) if step else torch._dynamo.config.patch()
        with ctx:
            yb = compiled(xb)
            yb.backward(dy)
        ya = eager(xa)
        ya.backward(dy)
        assert torch.equal(ya, yb)
        assert torch.equal(xa.grad, xb.grad)  # type: ignore[arg-type]
        for (name, p), q in zip(eager.named_parameters(), other.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]
            p.grad = q.grad = None
    assert int(other.a.lowp_step) == 2  # the buffer mutation is part of the compiled graph


def test_transformer_block_compiles_fullgraph() -> None:
    eager, other = _pair(Recipe.MXFP8, Block)
    compiled = torch.compile(other, fullgraph=True)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = eager(xa), compiled(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    # norms/attention/gelu are Inductor's (its usual tolerance); quantization can amplify a last-bit difference
    # into a one-code change, so compare with a relative L2 bound
    for a, b in ((ya, yb), (xa.grad, xb.grad), (eager.up.weight.grad, other.up.weight.grad)):
        rel = float((a - b).norm() / a.norm())  # type: ignore[operator, union-attr]
        assert rel < 2e-2, rel
