"""FSDP2 (2 ranks, gloo, CPU): a converted model under fully_shard trains; with the low-precision all-gather the
weights travel as codes + scales, the layers use them without dequantizing, and the parameters after three steps
are bitwise those of the dense all-gather (same recipe). Real processes (torchnext.testing.run_ranks: free port,
bounded timeout, children reaped)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchnext.lowp.training import Recipe, convert_to_lowp_training
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.slow

RECIPES = [Recipe.NVFP4.key, Recipe.MXFP8.key, Recipe.NVFP4.with_(weight_2d=False).key]


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, 8)  # 8 rows: not whole blocks per rank, so gathered densely

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(ctx: RankContext, key: str, lowp: bool) -> tuple[list[str], list[float], dict[str, np.ndarray], dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchnext.lowp.training import fsdp

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(0)
    model = _Model()
    convert_to_lowp_training(model, Recipe.from_key(key), seed=1, backend="eager")
    wrapped = fsdp.enable_fsdp_lowp_all_gather(model, ctx.world_size) if lowp else []
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    stats = {"gathered_bytes": 0, "prequantized_uses": 0, "dequantized": 0}
    pre, uses, deq = (fsdp.LowpShardedWeight.fsdp_pre_all_gather, fsdp.LowpGatheredWeight.lowp_copies,
                      fsdp.LowpGatheredWeight.dequantized)

    def counting_pre(self: Any, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> Any:
        # FSDP2 inspects the signature: keep the five named parameters
        inputs, meta = pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        stats["gathered_bytes"] += sum(t.numel() * t.element_size() for t in inputs)
        return inputs, meta

    def counting_uses(self: Any, recipe: str) -> Any:
        stats["prequantized_uses"] += 1
        return uses(self, recipe)

    def counting_deq(self: Any) -> Any:
        stats["dequantized"] += 1
        return deq(self)

    fsdp.LowpShardedWeight.fsdp_pre_all_gather = counting_pre  # type: ignore[method-assign]
    fsdp.LowpGatheredWeight.lowp_copies = counting_uses  # type: ignore[method-assign]
    fsdp.LowpGatheredWeight.dequantized = counting_deq  # type: ignore[method-assign]
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(10 + ctx.rank)
        losses = []
        for _ in range(3):
            x, t = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            loss = (model(x) - t).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        fsdp.LowpShardedWeight.fsdp_pre_all_gather = pre  # type: ignore[method-assign]
        fsdp.LowpGatheredWeight.lowp_copies = uses  # type: ignore[method-assign]
        fsdp.LowpGatheredWeight.dequantized = deq  # type: ignore[method-assign]
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        if isinstance(local, fsdp.LowpShardedWeight):
            local = local.unwrap()
        params[name] = local.detach().numpy().copy()
    return wrapped, losses, params, stats


def _rank(ctx: RankContext) -> dict[str, Any]:
    dist.init_process_group("gloo", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        return {key: (_train(ctx, key, False), _train(ctx, key, True)) for key in RECIPES}
    finally:
        dist.destroy_process_group()


def test_low_precision_all_gather_is_bitwise_the_dense_one() -> None:
    results = run_ranks(_rank, 2, timeout=300)
    for rank, per_recipe in enumerate(results):
        for key, (dense, lowp) in per_recipe.items():
            assert dense[0] == [] and lowp[0] == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
            assert lowp[1] == dense[1], (rank, key)  # the same losses ...
            for name, value in dense[2].items():
                assert np.array_equal(value, lowp[2][name]), (rank, key, name)  # ... and parameters, bit for bit
            stats = lowp[3]
            # 4 wrapped weights x 3 forwards took the gathered copies as they are (backward uses the saved copies,
            # refilled in place by FSDP2's re-gather); nothing dequantized them
            assert stats["prequantized_uses"] == 4 * 3 and stats["dequantized"] == 0, stats
            # bytes per rank per gather vs 4 (fp32) for the dense one: NVFP4 2-D ~0.5, 1-D / MXFP8 carry two copies
            elements = 2 * (64 * 128 + 128 * 64) // 2  # per rank: half of the rows of the four weights
            per_gather = stats["gathered_bytes"] / (3 * 2) / elements  # 3 steps x (forward + backward re-gather)
            want = {Recipe.NVFP4.key: 0.5 + 1 / 256, Recipe.MXFP8.key: 2 * (1 + 1 / 32)}.get(key, 2 * (0.5 + 1 / 16))
            assert abs(per_gather - want) < 1e-9, (key, per_gather)
    assert results[0][RECIPES[0]][1][1][-1] < results[0][RECIPES[0]][1][1][0]  # it trains


def test_enable_rejects_a_bad_shard_size() -> None:
    from torchnext.lowp.training.fsdp import enable_fsdp_lowp_all_gather

    with pytest.raises(ValueError, match="positive"):
        enable_fsdp_lowp_all_gather(_Model(), 0)


@pytest.mark.parametrize("key", RECIPES)
def test_one_rank_extension_round_trip_gives_the_layer_copies(key: str) -> None:
    """pre -> (a one-rank all-gather is the identity) -> post: the gathered copies are the layer's own casts of the
    whole weight, bit for bit; other ops on the gathered weight see its dequantized values."""
    from torchnext.lowp.training.fsdp import LowpGatheredWeight, LowpShardedWeight
    from torchnext.lowp.training.ops import copy_operand, train_cast

    recipe = Recipe.from_key(key)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    sharded = LowpShardedWeight(w, key)
    inputs, meta = sharded.fsdp_pre_all_gather(None, w.shape, w.stride(), nn.Module(), None)
    gathered, inner = sharded.fsdp_post_all_gather(tuple(t.clone() for t in inputs), meta, torch.float32)
    assert isinstance(gathered, LowpGatheredWeight) and len(inner) == 6
    want = train_cast(w, None, torch.tensor(0), key, "w", 0, 0, "auto", True, True)
    got = [t for copy in gathered.lowp_copies(key) for t in copy]  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert gathered.lowp_copies("other") is None
    spec = recipe.format.value
    from torchnext.lowp.formats import format_spec

    dense = copy_operand((want[0], want[1], want[2]), format_spec(spec), 64, 96).dequantize(torch.float32)
    assert torch.equal(gathered + 0, dense)  # the fallback for any other op
    assert "LowpGatheredWeight" in repr(gathered)
    # a second gather refills the same tensors in place (FSDP2 reuses the unsharded parameter)
    before = [t.data_ptr() for t in gathered.inner_tensors()]
    assert sharded.fsdp_post_all_gather(tuple(t.clone() for t in inputs), meta, torch.float32, out=gathered) is None
    assert [t.data_ptr() for t in gathered.inner_tensors()] == before
