"""Two local ranks all-reduce a tensor through torchnext.comms.Communicator (Gloo, CPU).

    python examples/comms_allreduce.py

The script is its own launcher: the parent hosts the TCPStore (no rank hosts it) and starts two processes.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from torchnext.comms import Communicator, ReduceOp


def rank_main(rank: int, world_size: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=30))
    comm = Communicator(store, rank, world_size, timeout=timedelta(seconds=30))
    comm.register_post_hook(
        lambda a: print(f"[rank {rank}] {a.info.op} #{a.op_id} {a.status.name} in {a.duration_s * 1e3:.2f} ms")
    )
    t = torch.arange(4, dtype=torch.float32) + 10 * rank
    comm.all_reduce(t)  # sum over ranks
    work = comm.all_reduce(t.clone(), ReduceOp.MAX, async_op=True)
    assert work is not None
    work.wait()
    print(f"[rank {rank}] sum = {t.tolist()}, max = {work.result()[0].tolist()}")
    comm.shutdown()


def main() -> int:
    world_size = 2
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)  # hosted by the launcher
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world_size, store.port)) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        return 0 if all(p.exitcode == 0 for p in procs) else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


if __name__ == "__main__":
    sys.exit(main())
