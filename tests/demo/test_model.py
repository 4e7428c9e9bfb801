"""The demo's data and model pieces, checked against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnext.demo.data import VOCAB, batch_for_step, corpus, decode, encode
from torchnext.demo.model import BF16Linear, ModelConfig, MoETransformerLM, Precision


def test_data_is_deterministic_and_sharded() -> None:
    a = batch_for_step(3, seed=0, shard=1, num_shards=4, batch_size=2, seq_len=16)
    b = batch_for_step(3, seed=0, shard=1, num_shards=4, batch_size=2, seq_len=16)
    c = batch_for_step(3, seed=0, shard=2, num_shards=4, batch_size=2, seq_len=16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one
    assert decode(encode("the fox.")) == "the fox."
    assert set(corpus(1, 500)) <= set(VOCAB)
    with pytest.raises(ValueError, match="not in the demo vocabulary"):
        encode("Z")
    with pytest.raises(ValueError, match="shard"):
        batch_for_step(0, seed=0, shard=4, num_shards=4, batch_size=1, seq_len=4)


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_low_precision_layers_and_the_bf16_tail(precision: str) -> None:
    """Block 0's projections and experts train in the format (all three GEMMs); block 1 and the head run in
    bf16; embeddings, norms, routers stay fp32; master weights are fp32."""
    from torchnext.lowp import LowpTrainingLinear, Recipe

    model = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), precision=Precision(precision)))
    b0, b1 = model.blocks[0], model.blocks[1]
    lowp = [b0.qkv, b0.proj, *(m for e in b0.moe.experts for m in (e.up, e.down))]
    assert all(isinstance(m, LowpTrainingLinear) for m in lowp)
    assert lowp[0].recipe == (Recipe.NVFP4 if precision == "nvfp4" else Recipe.MXFP8)
    assert sorted(model.lowp_layers) == sorted(n for n, m in model.named_modules() if m in lowp)
    bf16 = [b1.qkv, b1.proj, model.head, *(m for e in b1.moe.experts for m in (e.up, e.down))]
    assert all(type(m) is BF16Linear for m in bf16)
    assert type(b0.moe.router) is torch.nn.Linear and type(b1.moe.router) is torch.nn.Linear
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randint(0, len(VOCAB), (2, 16))
    loss, _ = model.loss(x, x)
    loss.backward()
    assert lowp[0].weight.grad is not None and bf16[0].weight.grad is not None
    assert lowp[0].weight.grad.dtype == torch.float32


def test_bf16_linear_is_f_linear_in_bf16() -> None:
    torch.manual_seed(0)
    lin = BF16Linear(32, 16)
    x = torch.randn(4, 32)
    ref = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    assert torch.equal(lin(x), ref)


def test_ablations_select_the_recipe_and_the_layers() -> None:
    from torchnext.lowp import LowpTrainingLinear, Recipe

    no_rht = Recipe.NVFP4.with_(rht=False)
    model = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), lowp_recipe=no_rht.key, lowp_all_layers=True))
    assert isinstance(model.head, LowpTrainingLinear) and model.head.recipe == no_rht
    assert isinstance(model.blocks[1].moe.router, LowpTrainingLinear)
    fp32 = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), precision=Precision.FP32))
    assert not fp32.lowp_layers and all(type(m) is not BF16Linear for m in fp32.modules())


def test_model_trains_and_routes_with_switch() -> None:
    torch.manual_seed(0)
    model = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), precision=Precision.NVFP4, n_layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(25):
        x, y = batch_for_step(step, seed=0, shard=0, num_shards=1, batch_size=8, seq_len=32)
        loss, lm = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(lm)
    assert losses[-1] < losses[0] - 0.7, losses
    # the router received gradient through the chosen expert's probability
    assert model.blocks[0].moe.router.weight.grad is not None
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 1000, dtype=torch.int64))
