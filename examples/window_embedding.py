"""Sharded embedding table: 4 ranks each hold a block of rows; each looks up a random batch with ``get_rows``.

    python examples/window_embedding.py [--transport shm|tcp]

Every rank registers its shard (shards differ in size) in one window, draws global row ids, asks each owner for
its rows with one vectorized ``get_rows`` per owner, and checks the result against a dense ``table[ids]``.
The script is its own launcher (the parent hosts the store; ranks are processes).
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch

from torchnext.comms import Communicator, Window
from torchnext.testing import RankContext, run_ranks

ROWS, DIM, BATCH, WORLD = 10_000, 64, 2048, 4


def full_table() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def shard_bounds() -> list[int]:
    """Row boundaries of the shards: uneven on purpose (rank r owns rows [b[r], b[r+1]))."""
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cuts = (weights.cumsum(0) / weights.sum() * ROWS).round().long().tolist()
    return [0, *cuts]


def lookup(win: Window, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Dense-equivalent lookup ``table[ids]`` through the window: one get_rows per owning rank."""
    owner = torch.bucketize(ids, torch.tensor(bounds[1:]), right=True)
    out = torch.empty(ids.numel(), DIM)
    for r in range(len(bounds) - 1):
        pos = (owner == r).nonzero().squeeze(1)
        if pos.numel():
            rows = win.get_rows(r, ids[pos] - bounds[r])
            assert isinstance(rows, torch.Tensor)
            out[pos] = rows
    return out


def rank_main(ctx: RankContext, transport: str | None) -> bool:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=60), name="emb")
    bounds = shard_bounds()
    table = full_table()  # every rank builds the same table here only to check the result
    shard = table[bounds[ctx.rank] : bounds[ctx.rank + 1]].contiguous()
    ok = True
    with comm.new_window(shard, transport=transport) as win:
        ids = torch.randint(0, ROWS, (BATCH,), generator=torch.Generator().manual_seed(100 + ctx.rank))
        got = lookup(win, ids, bounds)
        ok = bool(torch.equal(got, table[ids]))
        print(f"[rank {ctx.rank}] shard rows {shard.shape[0]}, transport to rank 0: {win.transport(0).value}, "
              f"lookup of {BATCH} rows equals dense table[ids]: {ok}", flush=True)
        win.fence()
    comm.shutdown()
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=["shm", "tcp"], default=None)
    args = p.parse_args(argv)
    results = run_ranks(rank_main, WORLD, args=(args.transport,), timeout=120)
    print("all ranks match the dense lookup" if all(results) else "MISMATCH")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
