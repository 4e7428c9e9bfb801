"""convert_to_lowp_training, LowpTrainingLinear, the bf16 tail filter, state dicts, edge inputs and errors."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from torchnext.lowp import FormatError
from torchnext.lowp.training import LowpTrainingLinear, Recipe, bf16_tail_filter, convert_to_lowp_training, lowp_linear

RECIPES = [Recipe.MXFP8, Recipe.NVFP4]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.router = nn.Linear(d, 4)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, _, _ = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.proj(q) + self.router(x).mean(-1, keepdim=True)


class Tiny(nn.Module):
    def __init__(self, d: int = 64, n_blocks: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_recipes_are_documented_and_round_trip() -> None:
    assert Recipe.MXFP8.block_shapes == {"fprop": {"x": (1, 32), "w": (1, 32)}, "dgrad": {"dy": (1, 32), "w": (32, 1)},
                                         "wgrad": {"dy": (32, 1), "x": (32, 1)}}
    assert Recipe.NVFP4.block_shapes["fprop"]["w"] == (16, 16) == Recipe.NVFP4.block_shapes["dgrad"]["w"]
    for r in (*RECIPES, Recipe.NVFP4.with_(rht=False), Recipe.MXFP8.with_(scale_mode="floor")):
        assert Recipe.from_key(r.key) == r
    with pytest.raises(FormatError, match="scale_mode"):
        Recipe(format="nvfp4", scale_mode="rceil")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="mxfp8_e4m3 and nvfp4"):
        Recipe(format="mxfp4", scale_mode="rceil")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="no field"):
        Recipe.NVFP4.with_(hadamard=False)
    with pytest.raises(FormatError, match="bool"):
        Recipe.NVFP4.with_(rht=1)


def test_bf16_tail_filter_keeps_head_routers_and_last_blocks() -> None:
    model = Tiny(n_blocks=7)  # ceil(0.15 * 7) = 2 blocks kept
    convert_to_lowp_training(model, Recipe.NVFP4, bf16_tail_filter(model))
    converted = {n for n, m in model.named_modules() if isinstance(m, LowpTrainingLinear)}
    assert converted == {f"blocks.{i}.{p}" for i in range(5) for p in ("qkv", "proj")}
    assert type(model.head) is nn.Linear and type(model.blocks[0].router) is nn.Linear
    two = Tiny(n_blocks=2)  # the demo's size: block 1 stays in high precision
    convert_to_lowp_training(two, Recipe.MXFP8, bf16_tail_filter(two))
    assert isinstance(two.blocks[0].qkv, LowpTrainingLinear) and type(two.blocks[1].qkv) is nn.Linear
    with pytest.raises(ValueError, match="tail_fraction"):
        bf16_tail_filter(two, tail_fraction=1.5)
    with pytest.raises(ValueError, match=r"not an nn\.ModuleList"):
        bf16_tail_filter(two, block_list="head")
    explicit = bf16_tail_filter(Tiny(n_blocks=4), block_list="blocks", tail_fraction=0.5)
    assert explicit(nn.Linear(1, 1), "blocks.1.qkv") and not explicit(nn.Linear(1, 1), "blocks.2.qkv")


@pytest.mark.parametrize("recipe", RECIPES)
def test_trains_state_dict_round_trips_and_parameters_are_shared(recipe: Recipe) -> None:
    torch.manual_seed(0)
    model = Tiny(n_blocks=2)
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the conversion: still valid after
    convert_to_lowp_training(model, recipe, seed=11, backend="eager")
    assert [id(p) for p in model.parameters()] == params_before
    ids = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    layer = model.blocks[0].qkv
    assert int(layer.lowp_step) == 8
    sd = model.state_dict()
    assert "blocks.0.qkv.lowp_step" in sd and ("blocks.0.qkv.rht_signs" in sd) == recipe.rht
    buf = io.BytesIO()
    torch.save(sd, buf)
    fresh = convert_to_lowp_training(Tiny(n_blocks=2), recipe, seed=99, backend="eager")  # other seed: signs differ
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    if recipe.rht:
        assert torch.equal(fresh.blocks[0].qkv.rht_signs, layer.rht_signs)
    assert fresh.blocks[0].qkv.seed == 11  # the seed comes with the checkpoint
    # the loaded model continues the same streams: one more step gives the same gradients bit for bit
    for mod in (model, fresh):
        mod.zero_grad()
        nn.functional.cross_entropy(mod(ids).reshape(-1, 50), ids.reshape(-1)).backward()
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n  # type: ignore[arg-type]


def test_unconverted_checkpoint_loads() -> None:
    plain = Tiny(n_blocks=2)
    conv = convert_to_lowp_training(Tiny(n_blocks=2), Recipe.NVFP4)
    conv.load_state_dict(plain.state_dict())
    assert torch.equal(conv.blocks[0].qkv.weight, plain.blocks[0].qkv.weight)


def test_root_linear_and_frozen_weight() -> None:
    lin = nn.Linear(32, 32)
    conv = convert_to_lowp_training(lin, Recipe.MXFP8, backend="eager")
    assert isinstance(conv, LowpTrainingLinear) and conv.weight is lin.weight
    conv.weight.requires_grad_(False)
    x = torch.randn(8, 32, requires_grad=True)
    conv(x).sum().backward()
    assert conv.weight.grad is None and x.grad is not None
    assert "recipe=mxfp8_e4m3/rceil" in repr(conv)


@pytest.mark.parametrize("recipe", RECIPES)
def test_edge_inputs(recipe: Recipe) -> None:
    """Zeros are exact; NaN/Inf in a gradient make the gradients that use them non-finite (see docs: MXFP8 per
    block, NVFP4 the whole tensor); an empty batch works; 3-D inputs; K and M off the block size."""
    torch.manual_seed(0)
    layer = convert_to_lowp_training(nn.Linear(45, 50), recipe, backend="eager")
    zero = torch.zeros(37, 45, requires_grad=True)
    y = layer(zero)
    assert torch.equal(y, layer.bias.detach().expand(37, 50))
    y.backward(torch.zeros(37, 50))
    assert not zero.grad.any() and not layer.weight.grad.any()  # type: ignore[union-attr]
    x = torch.randn(37, 45, requires_grad=True)
    for bad in (math.nan, math.inf):
        layer.zero_grad()
        x.grad = None
        dy = torch.randn(37, 50)
        dy[3, 5] = bad
        layer(x).backward(dy)
        fin_dx, fin_dw = x.grad.isfinite(), layer.weight.grad.isfinite()  # type: ignore[union-attr]
        if recipe.format.value == "nvfp4":
            assert not fin_dx.any() and not fin_dw.any()
        else:
            assert not fin_dx[3].any() and fin_dx[torch.arange(37) != 3].all()
            assert not fin_dw[5].any() and fin_dw[torch.arange(50) != 5].all()
    empty = torch.zeros(0, 45, requires_grad=True)
    layer(empty).sum().backward()
    assert empty.grad.shape == (0, 45)  # type: ignore[union-attr]
    y3 = layer(torch.randn(2, 5, 45))
    assert y3.shape == (2, 5, 50)


def test_errors() -> None:
    with pytest.raises(FormatError, match="recipe"):
        convert_to_lowp_training(nn.Linear(8, 8), "nvfp4")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="seed"):
        convert_to_lowp_training(nn.Sequential(nn.Linear(8, 8)), Recipe.MXFP8, seed=-1)
    layer = convert_to_lowp_training(nn.Linear(32, 16), Recipe.MXFP8)
    with pytest.raises(FormatError, match="input has 31 features"):
        layer(torch.randn(4, 31))
    with pytest.raises(FormatError, match="rht_signs"):
        lowp_linear(torch.randn(4, 32), torch.randn(16, 32), recipe=Recipe.NVFP4)
    with pytest.raises(FormatError, match="bias"):
        lowp_linear(torch.randn(4, 32), torch.randn(16, 32), torch.randn(3), recipe=Recipe.MXFP8)


def test_set_lowp_step_realigns_replicas_that_retried_a_step() -> None:
    """A replica that ran an extra (failed) attempt draws other noise until the loop sets the step again."""
    from torchnext.lowp.training import set_lowp_step

    torch.manual_seed(0)
    a = convert_to_lowp_training(Tiny(n_blocks=2), Recipe.NVFP4, seed=3, backend="eager")
    b = convert_to_lowp_training(Tiny(n_blocks=2), Recipe.NVFP4, seed=3, backend="eager")
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 50, (2, 16))
    b(ids).sum().backward()  # b's failed attempt: its counters ran ahead
    b.zero_grad()
    grads = []
    for mod in (a, b):
        assert set_lowp_step(mod, 7) == 7  # every Linear: 2 x (qkv, proj, router) + head
        nn.functional.cross_entropy(mod(ids).reshape(-1, 50), ids.reshape(-1)).backward()
        grads.append([p.grad.clone() for p in mod.parameters() if p.grad is not None])
    assert all(torch.equal(x, y) for x, y in zip(*grads, strict=True))
    assert int(a.blocks[0].qkv.lowp_step) == int(b.blocks[0].qkv.lowp_step) == 7 * 2**20 + 1
    with pytest.raises(ValueError, match="step"):
        set_lowp_step(a, -1)
