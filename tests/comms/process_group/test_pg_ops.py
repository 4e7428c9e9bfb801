"""Every ``dist.*`` op on a torchnext process group gives what plain Gloo gives: 2 and 3 ranks, the default group and
a ``new_group`` sub-group, sync and async, object collectives and the coalesced form. The oracle is a plain Gloo
group run on the same inputs in the same test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.timeout(300)


def _full(v: float, n: int = 4) -> torch.Tensor:
    return torch.full((n,), float(v))


def ops(rank: int, world: int, group: Any = None) -> dict[str, Any]:
    """Run every op on ``group`` (ranks are group ranks; torch's global-rank arguments are mapped)."""
    g: Callable[[int], int] = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    out: dict[str, Any] = {}

    x = _full(rank + 1)
    dist.all_reduce(x, group=group)
    out["all_reduce"] = x.tolist()
    for name in ("AVG", "PRODUCT", "MIN", "MAX"):
        x = _full(rank + 1)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name), group=group)
        out[name] = x.tolist()
    for name in ("BAND", "BOR", "BXOR"):
        xi = torch.tensor([rank + 1, 6, 7 * rank])
        dist.all_reduce(xi, op=getattr(dist.ReduceOp, name), group=group)
        out[name] = xi.tolist()

    x = _full(rank)
    dist.broadcast(x, g(1), group=group)
    out["broadcast"] = x.tolist()
    x = _full(rank + 1)
    dist.reduce(x, g(0), group=group)
    out["reduce"] = x.tolist() if rank == 0 else None

    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, _full(rank), group=group)
    out["all_gather"] = [t.tolist() for t in gathered]
    flat = torch.empty(4 * world)
    dist.all_gather_into_tensor(flat, _full(rank), group=group)
    out["all_gather_into_tensor"] = flat.tolist()
    half = torch.empty(2)
    dist.reduce_scatter_tensor(half, torch.arange(2.0 * world) + rank, group=group)
    out["reduce_scatter_tensor"] = half.tolist()
    quarter = torch.empty(4)
    dist.reduce_scatter(quarter, [_full(rank + r) for r in range(world)], group=group)
    out["reduce_scatter"] = quarter.tolist()

    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(float(world)) + 10 * rank, group=group)
    out["all_to_all_single"] = a2a.tolist()
    uneven = torch.empty(sum(r + 1 for r in range(world)))
    dist.all_to_all_single(uneven, torch.full((world * (rank + 1),), float(rank)),
                           output_split_sizes=[r + 1 for r in range(world)],
                           input_split_sizes=[rank + 1] * world, group=group)
    out["all_to_all_single_uneven"] = uneven.tolist()
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * rank + r)) for r in range(world)], group=group)
    out["all_to_all"] = [t.tolist() for t in outs]

    gather_list = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    dist.gather(_full(rank), gather_list, g(0), group=group)
    out["gather"] = [t.tolist() for t in gather_list] if gather_list else None
    x = torch.empty(4)
    dist.scatter(x, [_full(r * 3) for r in range(world)] if rank == 0 else None, g(0), group=group)
    out["scatter"] = x.tolist()
    dist.barrier(group=group)

    if rank == 0:
        dist.send(_full(7), g(1), group=group)
    elif rank == 1:
        x = torch.empty(4)
        dist.recv(x, g(0), group=group)
        out["recv"] = x.tolist()
    received = torch.empty(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, _full(rank), g((rank + 1) % world), group),
                                   dist.P2POp(dist.irecv, received, g((rank - 1) % world), group)])
    for req in reqs:
        req.wait()
    out["batch_isend_irecv"] = received.tolist()

    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"r": rank}, group=group)
    out["all_gather_object"] = objs
    x = _full(1)
    work = dist.all_reduce(x, async_op=True, group=group)
    assert work is not None
    out["async"] = (work.wait(), work.is_completed(), x.tolist(), work.get_future().wait()[0].tolist())
    xs = [_full(1), _full(2)]
    dist.all_reduce_coalesced(xs, group=group)
    out["all_reduce_coalesced"] = [t.tolist() for t in xs]
    lists = [[torch.empty(2), torch.empty(3, 2)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.full((2,), float(rank)), torch.full((3, 2), 10.0 + rank)], group=group)
    out["all_gather_coalesced"] = [[t.tolist() for t in ts] for ts in lists]
    return out


def body(ctx: RankContext, backend: str) -> dict[str, Any]:
    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    res = ops(ctx.rank, ctx.world_size)
    if ctx.world_size >= 3:
        sub = dist.new_group([0, 2])
        if ctx.rank in (0, 2):
            res["sub"] = ops([0, 2].index(ctx.rank), 2, sub)
            res["sub_rank"] = (dist.get_rank(sub), dist.get_world_size(sub), dist.get_process_group_ranks(sub))
    res["pg"] = (type(dist.group.WORLD).__name__, dist.get_backend())
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_matches_gloo(world_size: int) -> None:
    gloo = run_ranks(body, world_size, args=("gloo",), timeout=180)
    ours = run_ranks(body, world_size, args=("torchnext",), timeout=180)
    for rank in range(world_size):
        assert gloo[rank].pop("pg") == ("ProcessGroup", "gloo")
        assert ours[rank].pop("pg") == ("TorchnextProcessGroup", "torchnext")
        assert ours[rank] == gloo[rank], rank
    if world_size == 3:
        assert ours[0]["sub_rank"] == (0, 2, [0, 2]) and ours[2]["sub_rank"] == (1, 2, [0, 2])


def two_threads_body(ctx: RankContext) -> dict[str, Any]:
    """Two threads of each rank all_reduce on the same group at once (values chosen so that any pairing of the two
    ranks' ops sums the same): torch's own groups accept this; ours must serialize, not raise."""
    import threading

    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    errors: list[str] = []
    sums: list[float] = []
    go = threading.Barrier(2)

    def run() -> None:
        go.wait(30)
        try:
            for _ in range(100):
                t = torch.full((4,), float(ctx.rank + 1))
                dist.all_reduce(t)
                sums.append(float(t[0]))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    alive = any(th.is_alive() for th in threads)
    dist.destroy_process_group()
    return {"errors": errors, "sums": sorted(set(sums)), "n": len(sums), "alive": alive}


def test_two_threads_issuing_on_one_group_are_serialized() -> None:
    for r in run_ranks(two_threads_body, 2, timeout=120):
        assert r["errors"] == [] and not r["alive"], r
        assert r["n"] == 200 and r["sums"] == [3.0], r
