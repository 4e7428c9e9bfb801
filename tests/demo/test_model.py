"""The demo's data and model pieces, checked against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnext.demo.data import VOCAB, batch_for_step, corpus, decode, encode
from torchnext.demo.model import LowpLinear, ModelConfig, MoETransformerLM, Precision


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
def test_lowp_linear_matches_dequantized_reference(precision: str) -> None:
    from torchnext.lowp import quantize

    torch.manual_seed(0)
    lin = LowpLinear(64, 96, precision=Precision(precision))
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = lin(x)
    fmt = "nvfp4" if precision == "nvfp4" else "mxfp8_e4m3"
    w_deq = quantize(lin.weight.detach(), fmt).dequantize(torch.float32)
    ref = F.linear(x.detach(), w_deq, lin.bias.detach())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # straight-through estimator: gradients are those of F.linear with the dequantized weight
    g = torch.randn_like(y)
    y.backward(g)
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    torch.testing.assert_close(x.grad, g @ w_deq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, g.reshape(-1, 96).t() @ x.detach().reshape(-1, 64), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(lin.bias.grad, g.reshape(-1, 96).sum(0))


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
