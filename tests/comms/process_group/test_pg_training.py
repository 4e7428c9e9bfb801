"""torch's own parallelism on a torchnext process group gives bitwise what it gives on plain Gloo: DDP (default group
and ``process_group=``), FSDP2 ``fully_shard`` over ``init_device_mesh`` (1-D and a 2-D HSDP mesh), DTensor
redistribute, and functional collectives eagerly and under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.timeout(300)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def ddp_body(ctx: RankContext, backend: str, explicit_group: bool) -> list[np.ndarray]:
    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    group = dist.new_group(list(range(ctx.world_size))) if explicit_group else None
    model = nn.parallel.DistributedDataParallel(_model(), process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        model(_batch(step, ctx.rank)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    out = [p.detach().numpy().copy() for p in model.parameters()]
    del model, opt  # DDP's reducer before its group: torch's own Gloo run hung in the other order (4 of 9 runs)
    dist.destroy_process_group()
    return out


def fsdp_body(ctx: RankContext, backend: str, shape: tuple[int, ...]) -> tuple[list[np.ndarray], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(4):
        model(_batch(step, ctx.rank)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    out = [p.full_tensor().detach().numpy().copy() for p in model.parameters()]  # type: ignore[operator]
    kinds = sorted({type(g).__name__ for g in mesh.get_all_groups()})
    dist.destroy_process_group()
    return out, kinds


def funcol_body(ctx: RankContext, backend: str) -> tuple[Any, ...]:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    group = dist.group.WORLD

    def f(x: torch.Tensor) -> torch.Tensor:
        y = fc.all_reduce(x, "sum", group)
        z = fc.all_gather_tensor(y * 2, 0, group)
        return fc.reduce_scatter_tensor(z, "sum", 0, group) + 1

    x = torch.arange(4.0) + ctx.rank
    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    replicated = dt.redistribute(mesh, [Replicate()]).to_local()
    dist.destroy_process_group()
    return eager.numpy(), compiled.numpy(), replicated.numpy()


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("explicit_group", [False, True], ids=["default-group", "process_group="])
def test_ddp_bitwise_equal_to_gloo(explicit_group: bool) -> None:
    gloo = run_ranks(ddp_body, 2, args=("gloo", explicit_group))
    ours = run_ranks(ddp_body, 2, args=("torchnext", explicit_group))
    assert _same(gloo[0], ours[0]) and _same(ours[0], ours[1])


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["fsdp-1d", "hsdp-2x2"])
def test_fsdp2_bitwise_equal_to_gloo(shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape))
    gloo = run_ranks(fsdp_body, n, args=("gloo", shape), timeout=240)
    ours = run_ranks(fsdp_body, n, args=("torchnext", shape), timeout=240)
    for rank in range(n):
        assert _same(gloo[rank][0], ours[rank][0]), rank
    assert ours[0][1] == ["TorchnextProcessGroup"]  # every mesh dimension is a torchnext group


@pytest.mark.slow
def test_functional_collectives_and_dtensor_compiled_equal_eager() -> None:
    gloo = run_ranks(funcol_body, 2, args=("gloo",), timeout=240)
    ours = run_ranks(funcol_body, 2, args=("torchnext",), timeout=240)
    for rank in range(2):
        eager, compiled, replicated = ours[rank]
        assert eager.tobytes() == compiled.tobytes()
        assert _same(list(gloo[rank]), list(ours[rank]))
        assert replicated.tolist() == torch.arange(8.0).reshape(4, 2).tolist()
