"""``PREMUL_SUM`` on torchnext process groups (NCCL's pre-multiplied sum, which FSDP2 reduces gradients with once a
gradient divide factor is set): every reduction against the math ``sum_r(x_r * factor)`` computed by torch on
each rank, scalar and tensor factors, fp32 and bf16; the refusals; and FSDP2 with a divide factor against
torch's own SUM-then-divide path on Gloo (``set_force_sum_reduction_for_comms``), which Gloo needs."""

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

FACTORS: dict[str, Any] = {"scalar": 0.3, "tensor": torch.tensor([1.7])}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _x(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * salt + rank)).to(dtype)


def _oracle(world: int, n: int, dtype: torch.dtype, salt: int, factor: Any) -> torch.Tensor:
    """sum over ranks of x_r * factor, the products in x's dtype (torch's mul by a number or a 0-d tensor), summed
    in rank order."""
    f = factor.reshape(()) if isinstance(factor, torch.Tensor) else factor
    total = torch.zeros(n, dtype=dtype)
    for r in range(world):
        total = total + _x(r, n, dtype, salt).mul(f)
    return total


def premul_body(ctx: RankContext) -> dict[str, bool]:
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    w, r = ctx.world_size, ctx.rank
    pg = dist.group.WORLD
    assert pg is not None
    out: dict[str, bool] = {}
    for fname, factor in FACTORS.items():
        for dname, dtype in DTYPES.items():
            key = f"{fname}-{dname}"
            op = dist._make_nccl_premul_sum(factor)
            t = _x(r, 12, dtype, 1)
            dist.all_reduce(t, op=op)
            out[f"all_reduce/{key}"] = torch.equal(t, _oracle(w, 12, dtype, 1, factor))

            t = _x(r, 12, dtype, 2)
            dist.reduce(t, dst=0, op=op)
            out[f"reduce/{key}"] = r != 0 or torch.equal(t, _oracle(w, 12, dtype, 2, factor))

            inp = _x(r, 12 * w, dtype, 3)
            kept = inp.clone()
            shard = torch.empty(12, dtype=dtype)
            dist.reduce_scatter_tensor(shard, inp, op=op)
            want = _oracle(w, 12 * w, dtype, 3, factor).chunk(w)[r]
            out[f"reduce_scatter_tensor/{key}"] = torch.equal(shard, want) and torch.equal(inp, kept)

            chunks = list(_x(r, 12 * w, dtype, 4).chunk(w))
            shard = torch.empty(12, dtype=dtype)
            dist.reduce_scatter(shard, chunks, op=dist._make_nccl_premul_sum(factor))
            out[f"reduce_scatter/{key}"] = torch.equal(shard, _oracle(w, 12 * w, dtype, 4, factor).chunk(w)[r])

            ts = [_x(r, 5, dtype, 5), _x(r, 7, dtype, 6)]
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = op
            work = pg.allreduce_coalesced(ts, opts)
            work.wait()
            out[f"allreduce_coalesced/{key}"] = (torch.equal(ts[0], _oracle(w, 5, dtype, 5, factor))
                                                 and torch.equal(ts[1], _oracle(w, 7, dtype, 6, factor)))
    # the factor really is applied: a plain SUM differs
    t = _x(r, 12, torch.float32, 1)
    dist.all_reduce(t)
    out["sum_differs"] = not torch.equal(t, _oracle(w, 12, torch.float32, 1, 0.3))
    dist.destroy_process_group()
    return out


def test_premul_sum_is_the_sum_of_premultiplied_tensors() -> None:
    res = run_ranks(premul_body, 2, timeout=180)
    for rank, got in enumerate(res):
        failed = sorted(k for k, ok in got.items() if not ok)
        assert not failed, f"rank {rank}: {failed}"
        assert len(got) == 5 * len(FACTORS) * len(DTYPES) + 1


def refusal_body(ctx: RankContext) -> dict[str, str]:
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    cases = {
        "int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0)),
        # (torch itself refuses a factor tensor of more than one element when the op is made)
        "int_factor": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(torch.tensor([2]))),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # refused before anything was issued: the group is still usable
    dist.destroy_process_group()
    return out


def test_premul_sum_refusals_name_the_problem() -> None:
    out = run_ranks(refusal_body, 2, timeout=120)[0]
    assert out["int"].startswith("TypeError") and "PREMUL_SUM needs a floating dtype" in out["int"]
    assert out["int_factor"].startswith("ValueError") and "one floating-point element" in out["int_factor"]


def fsdp_divide_body(ctx: RankContext, backend: str) -> list[np.ndarray]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(3.0)  # type: ignore[operator]  # FSDP2: PREMUL_SUM(1/3) for fp32
    if backend == "gloo":
        model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # Gloo refuses PREMUL_SUM
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(ctx.rank))
    model(x).square().mean().backward()
    grads = [p.grad.full_tensor().numpy().copy() for p in model.parameters()]  # type: ignore[union-attr]
    dist.destroy_process_group()
    return grads


def test_fsdp2_gradient_divide_factor_matches_torchs_sum_then_divide() -> None:
    ours = run_ranks(fsdp_divide_body, 2, args=("torchnext",), timeout=180)[0]
    theirs = run_ranks(fsdp_divide_body, 2, args=("gloo",), timeout=180)[0]
    for a, b in zip(ours, theirs, strict=True):
        # (x0 / 3 + x1 / 3) against (x0 + x1) / 3: a rounding apart, never more
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    assert any(np.abs(a).max() > 0 for a in ours)
