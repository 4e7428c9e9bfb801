"""MoE token dispatch over RMA windows: tokens go to the expert's rank with ``put`` + ``signal``; results come
back with ``put`` + ``signal``. Checked against a single-process reference.

    python examples/window_moe.py [--transport shm|tcp]

Rank e hosts expert e (a linear map). Each rank routes its tokens by argmax of a router projection. Two windows:
``inbox`` (rank e's slot s receives the tokens rank s routed to e) and ``outbox`` (rank s's slot e receives
expert e's results for them). A signal of value ``k + 1`` tells the target that ``k`` rows were put before it
(a signal is observed only after the puts issued before it to the same target are visible).
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch

from torchnext.comms import Communicator
from torchnext.testing import RankContext, run_ranks

WORLD, TOKENS, DIM = 4, 64, 32


def params() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    router = torch.randn(DIM, WORLD, generator=g)
    experts = torch.randn(WORLD, DIM, DIM, generator=g) / DIM**0.5
    return router, experts


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1000 + rank))


def reference(rank: int) -> torch.Tensor:
    """Single process: token i goes through expert argmax(x_i @ router)."""
    router, experts = params()
    x = tokens(rank)
    choice = (x @ router).argmax(1)
    return torch.stack([x[i] @ experts[int(choice[i])] for i in range(TOKENS)])


def rank_main(ctx: RankContext, transport: str | None) -> float:
    me, n = ctx.rank, ctx.world_size
    comm = Communicator(ctx.store, me, n, timeout=timedelta(seconds=60), name="moe")
    router, experts = params()
    x = tokens(me)
    choice = (x @ router).argmax(1)
    inbox = comm.new_window(torch.zeros(n, TOKENS, DIM), transport=transport)
    outbox = comm.new_window(torch.zeros(n, TOKENS, DIM), transport=transport)
    slot = TOKENS * DIM  # elements per (rank, slot)
    # 1. dispatch: my tokens for expert e go to e's inbox slot `me`, then a signal carrying the count
    picks = [(choice == e).nonzero().squeeze(1) for e in range(n)]
    for e in range(n):
        inbox.put(x[picks[e]], e, me * slot, async_op=True)
        inbox.signal(e, picks[e].numel() + 1, async_op=True)
    # 2. expert `me`: wait for every source, apply, send the results back to the source's outbox slot `me`
    for s in range(n):
        k = inbox.wait_signal(s, 1, timeout=30) - 1
        y = inbox.tensor[s, :k] @ experts[me]
        outbox.put(y, s, me * slot)
        outbox.signal(s, k + 1)
    # 3. gather the results in token order
    out = torch.empty(TOKENS, DIM)
    for e in range(n):
        k = outbox.wait_signal(e, 1, timeout=30) - 1
        out[picks[e]] = outbox.tensor[e, :k]
    err = float((out - reference(me)).abs().max())
    counts = [int(p.numel()) for p in picks]
    print(f"[rank {me}] tokens per expert {counts}; max |moe - reference| = {err:.2e}", flush=True)
    inbox.close()
    outbox.close()
    comm.shutdown()
    return err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=["shm", "tcp"], default=None)
    args = p.parse_args(argv)
    errs = run_ranks(rank_main, WORLD, args=(args.transport,), timeout=120)
    ok = max(errs) < 1e-5
    print("MoE dispatch equals the single-process reference" if ok else f"MISMATCH {errs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
